"""The global mesh (Paddle's ``set_mesh``/``get_mesh``) and PyTorch's ``DeviceMesh`` names:
``init_device_mesh`` and ``mesh["tp"]`` for the sub-mesh of one named dim."""
from __future__ import annotations

from typing import Sequence

import numpy as np

import collectives
from spmd_rules import ProcessMesh, Replicate

from ..layout.mesh_groups import get_rank, get_world_size
from .communication import new_group

__all__ = ["set_mesh", "get_mesh", "DeviceMesh", "init_device_mesh", "mesh_coord",
           "placements_on"]

_global_mesh: ProcessMesh | None = None


def set_mesh(mesh: ProcessMesh) -> None:
    """Make ``mesh`` the global mesh that :func:`parallelize` (and ``get_mesh``) use.

    Example::

        dt.set_mesh(dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]))
        model, opt = dt.parallelize(model, opt, config=config)   # uses that mesh
    """
    global _global_mesh
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"set_mesh: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    _global_mesh = mesh


def get_mesh() -> ProcessMesh | None:
    """The mesh set by :func:`set_mesh` (None before).

    Example::

        mesh = dt.get_mesh() or dt.ProcessMesh([0, 1], dim_names=["dp"])
    """
    return _global_mesh


def mesh_coord(mesh: ProcessMesh) -> tuple[int, ...] | None:
    """This rank's coordinate in ``mesh`` (None when it is not a member)."""
    return mesh.get_coord(get_rank())


def mesh_dim_index(fn: str, mesh: ProcessMesh, dim: str | int) -> int:
    """The index of mesh dim ``dim`` (a name or an index); ValueError naming ``fn`` if absent."""
    if isinstance(dim, str):
        if dim not in mesh.dim_names:
            raise ValueError(f"{fn}: mesh {mesh} has no dim named {dim!r} (dims "
                             f"{mesh.dim_names})")
        return mesh.dim_names.index(dim)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
            or not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"{fn}: mesh dim {dim!r} is out of range for the {mesh.ndim}-d mesh "
                         f"{mesh}")
    return int(dim) % mesh.ndim


def placements_on(mesh: ProcessMesh, **by_dim) -> list:
    """Replicate on every mesh dim except those given by name (``dp=Shard(0)``)."""
    out = [Replicate()] * mesh.ndim
    for name, p in by_dim.items():
        out[mesh.dim_names.index(name)] = p
    return out


class DeviceMesh(ProcessMesh):
    """A :class:`ProcessMesh` with PyTorch's ``DeviceMesh`` interface: ``device_type``,
    ``mesh_dim_names``, ``mesh["tp"]`` (the sub-mesh along the named dim(s) that contains this
    rank), ``size()``, ``get_local_rank()``, ``get_coordinate()`` and ``get_group()``. It equals
    the ProcessMesh with the same ranks and dim names, so it works everywhere a mesh does.

    Example::

        mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]      # ranks [0, 1] on ranks 0 and 1, [2, 3] on ranks 2 and 3
    """

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: Sequence[str] | None = None):
        super().__init__(mesh, None if mesh_dim_names is None else list(mesh_dim_names))
        self.device_type = str(device_type)
        self.parent: DeviceMesh | None = None   # the mesh this one was sliced from

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(self.dim_names)

    def __getitem__(self, names: str | Sequence[str]) -> "DeviceMesh":
        keep = [names] if isinstance(names, str) else list(names)
        dims = [mesh_dim_index("DeviceMesh[...]", self, n) for n in keep]
        if len(set(dims)) != len(dims):
            raise ValueError(f"DeviceMesh[{names!r}]: a dim is named twice")
        coord = mesh_coord(self)
        if coord is None:
            raise ValueError(f"DeviceMesh[{names!r}]: rank {get_rank()} is not in {self}")
        grid = np.array(self.process_ids).reshape(self.shape)
        index = tuple(slice(None) if d in dims else coord[d] for d in range(self.ndim))
        # grid[index] keeps the named dims in mesh order; put them in the order asked for
        sub = np.transpose(grid[index], [sorted(dims).index(d) for d in dims])
        out = DeviceMesh(self.device_type, sub.tolist(),
                         mesh_dim_names=[self.dim_names[d] for d in dims])
        out.parent = self.parent or self
        return out

    def size(self, mesh_dim: str | int | None = None) -> int:
        """The number of ranks (along ``mesh_dim`` when given)."""
        if mesh_dim is None:
            return len(self.process_ids)
        return self.shape[mesh_dim_index("DeviceMesh.size", self, mesh_dim)]

    def get_local_rank(self, mesh_dim: str | int | None = None) -> int:
        """This rank's coordinate along ``mesh_dim`` (a 1-d mesh needs none)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("DeviceMesh.get_local_rank: name the mesh dim of a "
                                 f"{self.ndim}-d mesh")
            mesh_dim = 0
        coord = mesh_coord(self)
        if coord is None:
            raise ValueError(f"DeviceMesh.get_local_rank: rank {get_rank()} is not in {self}")
        return coord[mesh_dim_index("DeviceMesh.get_local_rank", self, mesh_dim)]

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate, or None when it is not in the mesh."""
        c = mesh_coord(self)
        return None if c is None else list(c)

    def get_group(self, mesh_dim: str | int | None = None):
        """The :class:`Group` of this rank's sub-mesh along ``mesh_dim`` (collective over that
        sub-mesh's ranks, which must all call it)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("DeviceMesh.get_group: name the mesh dim of a "
                                 f"{self.ndim}-d mesh")
            return new_group(self.process_ids)
        sub = self[self.dim_names[mesh_dim_index("DeviceMesh.get_group", self, mesh_dim)]]
        return new_group(sub.process_ids)

    def __repr__(self) -> str:
        return (f"DeviceMesh({self.device_type!r}, {self.mesh}, "
                f"mesh_dim_names={self.mesh_dim_names})")


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A :class:`DeviceMesh` of shape ``mesh_shape`` over all ranks in order (PyTorch's
    ``init_device_mesh``); starts the process group when needed. The shape must multiply to
    the world size. No communication beyond starting the process group.

    Example::

        mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    """
    collectives.init()
    shape = tuple(int(s) for s in mesh_shape)
    world = get_world_size()
    if not shape or any(s < 1 for s in shape) or int(np.prod(shape)) != world:
        raise ValueError(f"init_device_mesh: mesh_shape {list(shape)} must be positive sizes "
                         f"that multiply to the world size {world}")
    if mesh_dim_names is not None and len(mesh_dim_names) != len(shape):
        raise ValueError(f"init_device_mesh: {len(mesh_dim_names)} mesh_dim_names for a "
                         f"{len(shape)}-d mesh_shape {list(shape)}")
    return DeviceMesh(device_type, np.arange(world).reshape(shape).tolist(),
                      mesh_dim_names=mesh_dim_names)
