"""ProcessMesh: an n-d grid of global ranks (pure data; process groups are attached elsewhere)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["ProcessMesh"]


def _parse_grid(mesh: Any) -> tuple[tuple[int, ...], list[int]]:
    """Return (shape, row-major ids) of a nested list grid; ValueError if ragged or bad."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if not isinstance(mesh, (list, tuple)):
        raise ValueError(f"ProcessMesh(mesh): expected a nested list of ranks, got {mesh!r}")

    def walk(node: Any, depth: int, shape: list[int], out: list[int]) -> None:
        if isinstance(node, (list, tuple)):
            if depth == len(shape) and not out:
                if not node:
                    raise ValueError(f"ProcessMesh(mesh): empty dimension in {mesh!r}")
                shape.append(len(node))
            elif depth >= len(shape) or len(node) != shape[depth]:
                raise ValueError(f"ProcessMesh(mesh): ragged grid {mesh!r}")
            for child in node:
                walk(child, depth + 1, shape, out)
        else:
            if depth != len(shape) or isinstance(node, bool) \
                    or not isinstance(node, numbers.Integral):
                raise ValueError(f"ProcessMesh(mesh): ragged grid or non-int rank {node!r} in "
                                 f"{mesh!r}")
            out.append(int(node))

    shape: list[int] = []
    ids: list[int] = []
    walk(mesh, 0, shape, ids)
    if any(r < 0 for r in ids):
        raise ValueError(f"ProcessMesh(mesh): ranks must be non-negative, got {mesh!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"ProcessMesh(mesh): duplicate ranks in {mesh!r}")
    return tuple(shape), ids


class ProcessMesh:
    """An n-d grid of distinct non-negative global ranks with named dims ("d0", "d1", ... by
    default)."""

    def __init__(self, mesh: Any, dim_names: Sequence[str] | None = None) -> None:
        self._shape, self._ids = _parse_grid(mesh)
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(len(self._shape))]
        dim_names = list(dim_names)
        if len(dim_names) != len(self._shape):
            raise ValueError(f"ProcessMesh(dim_names): {dim_names!r} has {len(dim_names)} names "
                             f"for a {len(self._shape)}-d mesh of shape {list(self._shape)}")
        if len(set(dim_names)) != len(dim_names) or not all(isinstance(n, str) for n in dim_names):
            raise ValueError("ProcessMesh(dim_names): names must be distinct strings, got "
                             f"{dim_names!r}")
        self._dim_names = dim_names
        self._index = {r: i for i, r in enumerate(self._ids)}

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def process_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def mesh(self) -> list:
        """The grid as a nested list."""
        def build(level: int, offset: int, stride: int) -> list:
            if level == len(self._shape) - 1:
                return self._ids[offset:offset + self._shape[level]]
            sub = stride // self._shape[level]
            return [build(level + 1, offset + i * sub, sub) for i in range(self._shape[level])]
        return build(0, 0, len(self._ids))

    def _dim_index(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, str):
            if name_or_index not in self._dim_names:
                raise ValueError(f"ProcessMesh: unknown dim name {name_or_index!r}; dims are "
                                 f"{self._dim_names}")
            return self._dim_names.index(name_or_index)
        i = int(name_or_index)
        if not -self.ndim <= i < self.ndim:
            raise ValueError(f"ProcessMesh: dim index {name_or_index} out of range for a "
                             f"{self.ndim}-d mesh")
        return i % self.ndim

    def get_dim_size(self, name_or_index: str | int) -> int:
        return self._shape[self._dim_index(name_or_index)]

    def get_coord(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` in the grid, or None when the rank is not in this mesh."""
        flat = self._index.get(rank)
        if flat is None:
            return None
        coord = []
        for size in reversed(self._shape):
            flat, c = divmod(flat, size)
            coord.append(c)
        return tuple(reversed(coord))

    def contains(self, rank: int) -> bool:
        return rank in self._index

    __contains__ = contains

    def rank_at(self, coord: Sequence[int]) -> int:
        """The rank at grid coordinate ``coord``."""
        coord = tuple(coord)
        if len(coord) != self.ndim or not all(0 <= c < s for c, s in zip(coord, self._shape)):
            raise ValueError(f"ProcessMesh.rank_at(coord): {coord} is outside mesh shape "
                             f"{list(self._shape)}")
        flat = 0
        for c, s in zip(coord, self._shape):
            flat = flat * s + c
        return self._ids[flat]

    def get_mesh_with_dim(self, dim_name: str | int, index: int | None = None) -> "ProcessMesh":
        """Paddle semantics: move ``dim_name`` to the front; with ``index``, the sub-mesh at that
        index (for a 1-d mesh: the 1-element mesh holding that rank, same dim name)."""
        axis = self._dim_index(dim_name)
        order = [axis] + [d for d in range(self.ndim) if d != axis]
        new_shape = [self._shape[d] for d in order]
        names = [self._dim_names[d] for d in order]
        coords = _all_coords(new_shape)
        ids = [self.rank_at(tuple(c[order.index(d)] for d in range(self.ndim))) for c in coords]
        grid = _nest(ids, new_shape)
        if index is None:
            return ProcessMesh(grid, names)
        if not -new_shape[0] <= index < new_shape[0]:
            raise ValueError(f"ProcessMesh.get_mesh_with_dim(index): {index} out of range for dim "
                             f"{names[0]!r} of size {new_shape[0]}")
        if self.ndim == 1:
            return ProcessMesh([grid[index]], names)
        return ProcessMesh(grid[index], names[1:])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessMesh):
            return NotImplemented
        return (self._shape, self._ids, self._dim_names) == (other._shape, other._ids,
                                                             other._dim_names)

    def __hash__(self) -> int:
        return hash((self._shape, tuple(self._ids), tuple(self._dim_names)))

    def __repr__(self) -> str:
        return f"ProcessMesh(mesh={self.mesh}, dim_names={self._dim_names})"


def _all_coords(shape: Sequence[int]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for s in shape:
        coords = [c + (i,) for c in coords for i in range(s)]
    return coords


def _nest(flat: list[int], shape: Sequence[int]) -> list:
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
