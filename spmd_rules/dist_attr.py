"""DistAttr (the rules' view of a layout) and the uneven split arithmetic.

A tensor dim of size N sharded by mesh dims (m0, m1, ...) — in that *split order*, any order of
distinct mesh dims — is split *nested*: numpy.array_split into ``mesh_shape[m0]`` pieces and take
piece ``coord[m0]``, split that piece into ``mesh_shape[m1]`` pieces and take piece
``coord[m1]``, and so on. The first ``N mod n`` pieces
get one extra element; pieces may be empty. Partial mesh dims do not change shapes.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .placement import Partial, Placement, ReduceType, Replicate, Shard

__all__ = ["DistAttr", "split_range", "local_shape", "local_offset", "local_slices"]

PartialSpec = Mapping[int, "ReduceType | str"] | Iterable[tuple[int, "ReduceType | str"]]


def _norm_partial(partial: PartialSpec) -> tuple[tuple[int, ReduceType], ...]:
    items = partial.items() if isinstance(partial, Mapping) else partial
    return tuple(sorted((int(m), ReduceType(r)) for m, r in items))


@dataclass(frozen=True)
class DistAttr:
    """Layout of one tensor on a mesh of shape ``mesh_shape``.

    ``dims_mapping[d]``: the mesh dims sharding tensor dim ``d`` in split order (outermost
    first; any order), ``()`` when not sharded. ``partial``: sorted ``(mesh_dim, ReduceType)``
    pairs. A mesh dim appears at most once overall.
    """

    mesh_shape: tuple[int, ...]
    dims_mapping: tuple[tuple[int, ...], ...]
    partial: tuple[tuple[int, ReduceType], ...] = ()

    def __post_init__(self) -> None:
        mesh_shape = tuple(int(s) for s in self.mesh_shape)
        dims_mapping = tuple(tuple(int(m) for m in dm) for dm in self.dims_mapping)
        partial = _norm_partial(self.partial)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "dims_mapping", dims_mapping)
        object.__setattr__(self, "partial", partial)
        if any(s < 1 for s in mesh_shape):
            raise ValueError(f"DistAttr(mesh_shape): sizes must be positive, got {mesh_shape}")
        used = [m for dm in dims_mapping for m in dm] + [m for m, _ in partial]
        if any(not 0 <= m < len(mesh_shape) for m in used):
            raise ValueError(f"DistAttr: mesh dim out of range for mesh shape {mesh_shape} in "
                             f"dims_mapping={dims_mapping}, partial={partial}")
        if len(set(used)) != len(used):
            raise ValueError(f"DistAttr: a mesh dim is used twice in dims_mapping={dims_mapping}, "
                             f"partial={partial}")

    @property
    def ndim(self) -> int:
        return len(self.dims_mapping)

    @classmethod
    def replicated(cls, ndim: int, mesh_shape: Sequence[int]) -> "DistAttr":
        return cls(tuple(mesh_shape), ((),) * ndim)

    @classmethod
    def from_placements(cls, placements: Sequence[Placement], ndim: int,
                        mesh_shape: Sequence[int]) -> "DistAttr":
        """One placement per mesh dim; negative Shard dims are normalized. The mesh dims
        sharding one tensor dim split in ``shard_order`` order when their Shards give one,
        else in ascending mesh-dim order."""
        placements = list(placements)
        if len(placements) != len(mesh_shape):
            raise ValueError(f"placements {placements} must have one entry per mesh dim "
                             f"(mesh shape {list(mesh_shape)})")
        shards: list[list[tuple[int | None, int]]] = [[] for _ in range(ndim)]
        partial = []
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise ValueError(f"placements {placements}: Shard dim {p.dim} out of range "
                                     f"for a tensor of ndim {ndim}")
                shards[p.dim % ndim].append((p.shard_order, m))
            elif isinstance(p, Partial):
                partial.append((m, p.reduce_type))
            elif not isinstance(p, Replicate):
                raise ValueError(f"placements {placements}: {p!r} is not a Shard, Replicate or "
                                 "Partial")
        mapping = []
        for d, pairs in enumerate(shards):
            orders = [o for o, _ in pairs]
            if all(o is None for o in orders):
                mapping.append(tuple(m for _, m in pairs))
            elif sorted(orders, key=lambda o: -1 if o is None else o) != list(range(len(pairs))):
                raise ValueError(f"placements {placements}: the Shards of tensor dim {d} give "
                                 f"shard_order {orders}; give every one of them a distinct "
                                 f"order 0..{len(pairs) - 1}, or none")
            else:
                mapping.append(tuple(m for _, m in sorted(pairs)))
        return cls(tuple(mesh_shape), tuple(mapping), tuple(partial))

    def to_placements(self) -> list[Placement]:
        """One placement per mesh dim; a co-sharded tensor dim whose split order is not the
        ascending mesh-dim order carries ``shard_order`` on each of its Shards."""
        out: list[Placement] = [Replicate() for _ in self.mesh_shape]
        for d, dm in enumerate(self.dims_mapping):
            ordered = list(dm) != sorted(dm)
            for k, m in enumerate(dm):
                out[m] = Shard(d, k) if ordered else Shard(d)
        for m, r in self.partial:
            out[m] = Partial(r)
        return out

    def is_replicated(self) -> bool:
        """True when neither sharded nor partial on any mesh dim."""
        return not self.partial and not any(self.dims_mapping)

    def is_partial(self) -> bool:
        return bool(self.partial)

    def partial_dims(self) -> tuple[int, ...]:
        return tuple(m for m, _ in self.partial)

    def sharded_mesh_dims(self) -> tuple[int, ...]:
        return tuple(sorted(m for dm in self.dims_mapping for m in dm))

    def mesh_dims_of(self, tensor_dim: int) -> tuple[int, ...]:
        return self.dims_mapping[tensor_dim]

    def shard_counts(self) -> tuple[int, ...]:
        """Per tensor dim, the number of pieces it is cut into (product of its mesh dims' sizes)."""
        out = []
        for dm in self.dims_mapping:
            n = 1
            for m in dm:
                n *= self.mesh_shape[m]
            out.append(n)
        return tuple(out)

    def with_dims_mapping(self, dims_mapping: Sequence[Sequence[int]]) -> "DistAttr":
        return DistAttr(self.mesh_shape, tuple(tuple(dm) for dm in dims_mapping), self.partial)

    def with_partial(self, partial: PartialSpec) -> "DistAttr":
        return DistAttr(self.mesh_shape, self.dims_mapping, _norm_partial(partial))

    def without_partial(self) -> "DistAttr":
        return DistAttr(self.mesh_shape, self.dims_mapping, ())

    def __repr__(self) -> str:
        return (f"DistAttr(mesh_shape={self.mesh_shape}, dims_mapping={self.dims_mapping}, "
                f"partial={tuple((m, r.value) for m, r in self.partial)})")


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` of numpy.array_split(range(size), parts)."""
    if parts < 1 or not 0 <= index < parts or size < 0:
        raise ValueError(f"split_range: need size >= 0 and 0 <= index < parts, got "
                         f"size={size}, parts={parts}, index={index}")
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def local_slices(global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> tuple[slice, ...]:
    """Per tensor dim, the slice of the global array held at mesh coordinate ``coord``."""
    if len(global_shape) != dist_attr.ndim:
        raise ValueError(f"local_slices: shape {tuple(global_shape)} has {len(global_shape)} dims "
                         f"but dist_attr has {dist_attr.ndim}")
    if len(coord) != len(dist_attr.mesh_shape) or not all(
            0 <= c < s for c, s in zip(coord, dist_attr.mesh_shape)):
        raise ValueError(f"local_slices: coord {tuple(coord)} is not in mesh shape "
                         f"{dist_attr.mesh_shape}")
    out = []
    for size, dm in zip(global_shape, dist_attr.dims_mapping):
        start, stop = 0, int(size)
        for m in dm:
            a, b = split_range(stop - start, dist_attr.mesh_shape[m], coord[m])
            start, stop = start + a, start + b
        out.append(slice(start, stop))
    return tuple(out)


def local_shape(global_shape: Sequence[int], dist_attr: DistAttr,
                coord: Sequence[int]) -> tuple[int, ...]:
    """Shape of the local piece at ``coord`` (uneven aware)."""
    return tuple(s.stop - s.start for s in local_slices(global_shape, dist_attr, coord))


def local_offset(global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> tuple[int, ...]:
    """Global index of the local piece's first element, per dim."""
    return tuple(s.start for s in local_slices(global_shape, dist_attr, coord))
