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

__all__ = ["DistAttr", "split_range", "local_shape", "local_offset", "local_slices",
           "local_ranges", "piece_length", "strided_ranges", "locate"]

PartialSpec = Mapping[int, "ReduceType | str"] | Iterable[tuple[int, "ReduceType | str"]]


def _norm_partial(partial: PartialSpec) -> tuple[tuple[int, ReduceType], ...]:
    items = partial.items() if isinstance(partial, Mapping) else partial
    return tuple(sorted((int(m), ReduceType(r)) for m, r in items))


def _norm_factors(factors: Mapping[int, int] | Iterable[tuple[int, int]]
                  ) -> tuple[tuple[int, int], ...]:
    items = factors.items() if isinstance(factors, Mapping) else factors
    return tuple(sorted((int(m), int(k)) for m, k in items if int(k) != 1))


@dataclass(frozen=True)
class DistAttr:
    """Layout of one tensor on a mesh of shape ``mesh_shape``.

    ``dims_mapping[d]``: the mesh dims sharding tensor dim ``d`` in split order (outermost
    first; any order), ``()`` when not sharded. ``partial``: sorted ``(mesh_dim, ReduceType)``
    pairs. A mesh dim appears at most once overall. ``split_factors``: sorted ``(mesh_dim, k)``
    pairs, k >= 2, for the sharding mesh dims that split strided (see the module doc).
    """

    mesh_shape: tuple[int, ...]
    dims_mapping: tuple[tuple[int, ...], ...]
    partial: tuple[tuple[int, ReduceType], ...] = ()
    split_factors: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        mesh_shape = tuple(int(s) for s in self.mesh_shape)
        dims_mapping = tuple(tuple(int(m) for m in dm) for dm in self.dims_mapping)
        partial = _norm_partial(self.partial)
        factors = _norm_factors(self.split_factors)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "dims_mapping", dims_mapping)
        object.__setattr__(self, "partial", partial)
        object.__setattr__(self, "split_factors", factors)
        sharding = {m for dm in dims_mapping for m in dm}
        if any(m not in sharding or k < 1 for m, k in factors):
            raise ValueError(f"DistAttr: split_factors={factors} must name sharding mesh dims "
                             f"(dims_mapping={dims_mapping}) with factors >= 1")
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
        partial, factors = [], []
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise ValueError(f"placements {placements}: Shard dim {p.dim} out of range "
                                     f"for a tensor of ndim {ndim}")
                shards[p.dim % ndim].append((p.shard_order, m))
                factors.append((m, p.split_factor))
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
        return cls(tuple(mesh_shape), tuple(mapping), tuple(partial), tuple(factors))

    def to_placements(self) -> list[Placement]:
        """One placement per mesh dim; a co-sharded tensor dim whose split order is not the
        ascending mesh-dim order carries ``shard_order`` on each of its Shards."""
        out: list[Placement] = [Replicate() for _ in self.mesh_shape]
        factors = dict(self.split_factors)
        for d, dm in enumerate(self.dims_mapping):
            ordered = list(dm) != sorted(dm)
            for k, m in enumerate(dm):
                out[m] = Shard(d, k if ordered else None, factors.get(m, 1))
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

    def factor_of(self, mesh_dim: int) -> int:
        """The split factor of ``mesh_dim`` (1: a plain shard, or not sharding)."""
        for m, k in self.split_factors:
            if m == mesh_dim:
                return k
        return 1

    def is_strided(self, tensor_dim: int | None = None) -> bool:
        """True when a mesh dim splits (tensor dim ``tensor_dim``, or any dim) strided."""
        if tensor_dim is None:
            return bool(self.split_factors)
        return any(self.factor_of(m) > 1 for m in self.dims_mapping[tensor_dim])

    def with_dims_mapping(self, dims_mapping: Sequence[Sequence[int]]) -> "DistAttr":
        """The same partial with a new sharding; split factors are dropped (plain shards)."""
        return DistAttr(self.mesh_shape, tuple(tuple(dm) for dm in dims_mapping), self.partial)

    def with_split_factors(self, factors: Mapping[int, int] | Iterable[tuple[int, int]]
                           ) -> "DistAttr":
        return DistAttr(self.mesh_shape, self.dims_mapping, self.partial, _norm_factors(factors))

    def without_split_factors(self) -> "DistAttr":
        """Every shard made plain (same mesh dims on the same tensor dims)."""
        if not self.split_factors:
            return self
        return DistAttr(self.mesh_shape, self.dims_mapping, self.partial)

    def with_partial(self, partial: PartialSpec) -> "DistAttr":
        return DistAttr(self.mesh_shape, self.dims_mapping, _norm_partial(partial),
                        self.split_factors)

    def without_partial(self) -> "DistAttr":
        return DistAttr(self.mesh_shape, self.dims_mapping, (), self.split_factors)

    def __repr__(self) -> str:
        extra = f", split_factors={self.split_factors}" if self.split_factors else ""
        return (f"DistAttr(mesh_shape={self.mesh_shape}, dims_mapping={self.dims_mapping}, "
                f"partial={tuple((m, r.value) for m, r in self.partial)}{extra})")


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` of numpy.array_split(range(size), parts)."""
    if parts < 1 or not 0 <= index < parts or size < 0:
        raise ValueError(f"split_range: need size >= 0 and 0 <= index < parts, got "
                         f"size={size}, parts={parts}, index={index}")
    q, r = divmod(size, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


Ranges = tuple[tuple[int, int], ...]


def _positions(ranges: Ranges, a: int, b: int) -> Ranges:
    """Positions ``[a, b)`` of the index sequence ``ranges`` (concatenated), as ranges."""
    out, pos = [], 0
    for start, stop in ranges:
        lo, hi = max(a, pos), min(b, pos + stop - start)
        if lo < hi:
            out.append((start + lo - pos, start + hi - pos))
        pos += stop - start
    return tuple(out)


def strided_ranges(length: int, factor: int, parts: int, index: int) -> Ranges:
    """Positions held by piece ``index`` when a sequence of ``length`` is cut into ``factor``
    sections (numpy.array_split) and each section into ``parts`` pieces: ``[start, stop)``
    ranges in section order, empty ones left out (``factor`` 1: one plain piece)."""
    out = []
    for s in range(factor):
        s0, s1 = split_range(length, factor, s)
        a, b = split_range(s1 - s0, parts, index)
        if b > a:
            out.append((s0 + a, s0 + b))
    return tuple(out)


def piece_length(length: int, factor: int, parts: int, index: int) -> int:
    """Length of piece ``index`` of :func:`strided_ranges` (no list built)."""
    if factor == 1:
        a, b = split_range(length, parts, index)
        return b - a
    n = 0
    for s in range(factor):
        s0, s1 = split_range(length, factor, s)
        a, b = split_range(s1 - s0, parts, index)
        n += b - a
    return n


def _dim_ranges(size: int, attr: DistAttr, dm: Sequence[int], coord: Sequence[int]) -> Ranges:
    ranges: Ranges = ((0, int(size)),) if size else ()
    for m in dm:
        length = sum(b - a for a, b in ranges)
        held = strided_ranges(length, attr.factor_of(m), attr.mesh_shape[m], coord[m])
        ranges = tuple(r for a, b in held for r in _positions(ranges, a, b))
    return ranges


def _check_coord(fn: str, global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> None:
    if len(global_shape) != dist_attr.ndim:
        raise ValueError(f"{fn}: shape {tuple(global_shape)} has {len(global_shape)} dims "
                         f"but dist_attr has {dist_attr.ndim}")
    if len(coord) != len(dist_attr.mesh_shape) or not all(
            0 <= c < s for c, s in zip(coord, dist_attr.mesh_shape)):
        raise ValueError(f"{fn}: coord {tuple(coord)} is not in mesh shape "
                         f"{dist_attr.mesh_shape}")


def local_ranges(global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> tuple[Ranges, ...]:
    """Per tensor dim, the global index ranges held at mesh coordinate ``coord`` in local
    order (the local index runs through them one after the other); ``()`` for an empty piece.
    The global -> local map is :func:`locate`."""
    _check_coord("local_ranges", global_shape, dist_attr, coord)
    return tuple(_dim_ranges(size, dist_attr, dm, coord)
                 for size, dm in zip(global_shape, dist_attr.dims_mapping))


def locate(global_shape: Sequence[int], dist_attr: DistAttr, dim: int, index: int
           ) -> tuple[dict[int, int], int]:
    """Where global index ``index`` of tensor dim ``dim`` lives: the coordinates along the mesh
    dims sharding ``dim`` (mesh dim -> coordinate) and its local index there."""
    size = int(global_shape[dim])
    if not 0 <= index < size:
        raise ValueError(f"locate: index {index} out of range for dim {dim} of size {size}")
    ranges: Ranges = ((0, size),)
    where: dict[int, int] = {}
    for m in dist_attr.dims_mapping[dim]:
        length = sum(b - a for a, b in ranges)
        for c in range(dist_attr.mesh_shape[m]):
            held = strided_ranges(length, dist_attr.factor_of(m), dist_attr.mesh_shape[m], c)
            piece = tuple(r for a, b in held for r in _positions(ranges, a, b))
            if any(a <= index < b for a, b in piece):
                where[m], ranges = c, piece
                break
    pos = 0
    for a, b in ranges:
        if a <= index < b:
            return where, pos + index - a
        pos += b - a
    raise AssertionError("unreachable: every index has an owner")


def local_slices(global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> tuple[slice, ...]:
    """Per tensor dim, the slice of the global array held at mesh coordinate ``coord``.
    A strided dim whose piece is not one contiguous range raises ValueError (use
    :func:`local_ranges`)."""
    _check_coord("local_slices", global_shape, dist_attr, coord)
    out = []
    for d, (size, dm) in enumerate(zip(global_shape, dist_attr.dims_mapping)):
        if dist_attr.is_strided(d):
            ranges = _dim_ranges(size, dist_attr, dm, coord)
            if len(ranges) > 1:
                raise ValueError(f"local_slices: dim {d} of shape {tuple(global_shape)} is "
                                 f"sharded strided ({dist_attr.to_placements()}): the piece at "
                                 f"{tuple(coord)} is {len(ranges)} ranges, not one slice")
            out.append(slice(*ranges[0]) if ranges else slice(0, 0))
            continue
        start, stop = 0, int(size)
        for m in dm:
            a, b = split_range(stop - start, dist_attr.mesh_shape[m], coord[m])
            start, stop = start + a, start + b
        out.append(slice(start, stop))
    return tuple(out)


def local_shape(global_shape: Sequence[int], dist_attr: DistAttr,
                coord: Sequence[int]) -> tuple[int, ...]:
    """Shape of the local piece at ``coord`` (uneven and strided aware)."""
    if not dist_attr.split_factors:
        return tuple(s.stop - s.start for s in local_slices(global_shape, dist_attr, coord))
    return tuple(sum(b - a for a, b in r) for r in local_ranges(global_shape, dist_attr, coord))


def local_offset(global_shape: Sequence[int], dist_attr: DistAttr,
                 coord: Sequence[int]) -> tuple[int, ...]:
    """Global index of the local piece's first element, per dim (no strided dim: a kernel
    reading its global position cannot take a strided piece, even one that is contiguous at
    this coordinate)."""
    if dist_attr.split_factors:
        raise ValueError(f"local_offset: the layout {dist_attr.to_placements()} is strided; "
                         f"its pieces have no single offset")
    return tuple(s.start for s in local_slices(global_shape, dist_attr, coord))
