"""DistTensor: a global shape, a ProcessMesh, a layout (DistAttr) and this rank's local piece.

Meshes and layouts are *interned*: equal values share one instance (:func:`canonical`,
:func:`canonical_mesh`), so the dispatcher's plan cache keys on identity instead of hashing a
mesh or a layout per call, and a mesh rebuilt every step is still one key.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_rules import DistAttr, ProcessMesh

from ..tensor import DenseTensor, array_module
from .mesh_groups import coord_of

__all__ = ["DistTensor", "canonical", "canonical_mesh", "empty_piece"]

_CANON: dict = {}        # DistAttr -> its canonical instance (kept alive here)
_CANON_IDS: set = set()  # ids of the canonical instances
_MESHES: dict = {}       # ProcessMesh -> its canonical instance
_MESH_IDS: set = set()


def _intern(table: dict, ids: set, value):
    if id(value) in ids:
        return value
    c = table.setdefault(value, value)
    ids.add(id(c))
    return c


def canonical(attr: DistAttr) -> DistAttr:
    """The one shared instance equal to ``attr``."""
    return _intern(_CANON, _CANON_IDS, attr)


def canonical_mesh(mesh: ProcessMesh) -> ProcessMesh:
    """The one shared instance equal to ``mesh``."""
    return _intern(_MESHES, _MESH_IDS, mesh)


class DistTensor:
    """This rank's piece (``local``, a DenseTensor) of a tensor of global ``shape`` and ``dtype``
    laid out on ``mesh`` as ``dist_attr``. A rank outside the mesh holds an empty piece."""

    __slots__ = ("local", "mesh", "dist_attr", "shape", "dtype")

    def __init__(self, local: DenseTensor, mesh: ProcessMesh, dist_attr: DistAttr,
                 shape: tuple[int, ...]):
        self.local = local
        self.mesh = mesh if id(mesh) in _MESH_IDS else canonical_mesh(mesh)
        self.dist_attr = dist_attr if id(dist_attr) in _CANON_IDS else canonical(dist_attr)
        self.shape = tuple(shape)
        self.dtype = local.array.dtype

    @property
    def placements(self) -> list:
        return self.dist_attr.to_placements()

    @property
    def coord(self) -> tuple[int, ...] | None:
        return coord_of(self.mesh)

    def __repr__(self) -> str:
        return (f"DistTensor(shape={list(self.shape)}, mesh={self.mesh}, "
                f"placements={self.placements}, local_shape={list(self.local.array.shape)})")


def empty_piece(shape, dtype, like: Any = None):
    """The empty local value of a rank outside the mesh."""
    xp = np if like is None else array_module(like)
    return xp.zeros((0,) * len(shape), dtype=dtype)
