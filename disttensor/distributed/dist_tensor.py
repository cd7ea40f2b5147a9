"""DistTensor: a global shape, a ProcessMesh, a layout (DistAttr) and this rank's local piece."""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_rules import DistAttr, ProcessMesh

from ..tensor import DenseTensor
from .mesh_groups import coord_of


_CANON: dict = {}        # DistAttr -> its canonical instance (kept alive here)
_CANON_IDS: set = set()  # ids of the canonical instances


def canonical(attr: DistAttr) -> DistAttr:
    """The one shared instance equal to ``attr``: equal layouts are the same object, so the
    dispatcher's decision cache can key on identity instead of hashing layouts per call."""
    if id(attr) in _CANON_IDS:
        return attr
    c = _CANON.setdefault(attr, attr)
    _CANON_IDS.add(id(c))
    return c


class DistTensor:
    """This rank's piece (``local``, a DenseTensor) of a tensor of global ``shape`` laid out on
    ``mesh`` as ``dist_attr``. A rank outside the mesh holds an empty piece."""

    __slots__ = ("local", "mesh", "dist_attr", "shape")

    def __init__(self, local: DenseTensor, mesh: ProcessMesh, dist_attr: DistAttr,
                 shape: tuple[int, ...]):
        self.local = local
        self.mesh = mesh
        self.dist_attr = dist_attr if id(dist_attr) in _CANON_IDS else canonical(dist_attr)
        self.shape = tuple(shape)

    @property
    def dtype(self):
        return self.local.array.dtype

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
    xp = np if like is None or isinstance(like, np.ndarray) else __import__("cupy")
    return xp.zeros((0,) * len(shape), dtype=dtype)
