"""Process groups attached to a :class:`spmd_rules.ProcessMesh` (which is pure data).

For a mesh dim ``m`` the group of the current rank is the ranks that share every mesh coordinate
with it except the one along ``m``, in order of that coordinate. Groups are created once (only
by their members, as MPI requires) and cached: these caches key on the mesh's value (equal meshes
share entries) and are bounded LRUs; the process groups themselves are cached by rank tuple in
:mod:`collectives`.
"""
from __future__ import annotations

from functools import lru_cache

import collectives
from spmd_rules import ProcessMesh


def world():
    return collectives.init()


def get_rank() -> int:
    """This process's rank in the world (0 when not started under MPI)."""
    return world().rank


def get_world_size() -> int:
    return world().size


def coord_of(mesh: ProcessMesh) -> tuple[int, ...] | None:
    """The current rank's coordinate in ``mesh`` (None when it is not a member)."""
    return _coord(mesh, get_rank())


@lru_cache(maxsize=4096)
def _coord(mesh: ProcessMesh, rank: int):
    return mesh.get_coord(rank)


def check_mesh(mesh: ProcessMesh, op: str) -> None:
    """Every rank of ``mesh`` must exist in the world."""
    size = get_world_size()
    bad = [r for r in mesh.process_ids if r >= size]
    if bad:
        raise ValueError(f"{op}: process_mesh {mesh} names ranks {bad} but the world has only "
                         f"{size} rank(s)")


@lru_cache(maxsize=1024)
def group_along(mesh: ProcessMesh, mesh_dim: int):
    """This rank's process group along ``mesh_dim`` of ``mesh`` (must be a member)."""
    coord = coord_of(mesh)
    if coord is None:
        raise ValueError(f"group_along: rank {get_rank()} is not in {mesh}")
    ranks = []
    for i in range(mesh.shape[mesh_dim]):
        c = list(coord)
        c[mesh_dim] = i
        ranks.append(mesh.rank_at(c))
    if len(ranks) == 1:
        return _SelfGroup.get(ranks[0])
    return collectives.new_group(ranks)


@lru_cache(maxsize=1024)
def group_over(mesh: ProcessMesh, mesh_dims: tuple[int, ...]):
    """This rank's group spanning several mesh dims (ranks varying along all of them)."""
    if len(mesh_dims) == 1:
        return group_along(mesh, mesh_dims[0])
    coord = coord_of(mesh)
    ranks = []
    for r in mesh.process_ids:
        c = mesh.get_coord(r)
        if all(c[m] == coord[m] for m in range(mesh.ndim) if m not in mesh_dims):
            ranks.append(r)
    if len(ranks) == 1:
        return _SelfGroup.get(ranks[0])
    return collectives.new_group(ranks)


class _SelfGroup:
    """The trivial group of one rank: every collective is the identity (no communication)."""

    _cache: dict = {}

    def __init__(self, rank: int):
        self.rank, self.size, self.ranks = 0, 1, (rank,)

    @classmethod
    def get(cls, rank: int) -> "_SelfGroup":
        if rank not in cls._cache:
            cls._cache[rank] = cls(rank)
        return cls._cache[rank]

    def all_reduce(self, x, op="sum"):
        return x.copy()

    def all_gather(self, x, axis=0, sizes=None):
        return x.copy()

    def reduce_scatter(self, x, op="sum", axis=0, sizes=None):
        return x.copy()

    def all_to_all(self, x, split_axis, concat_axis, split_sizes=None, recv_sizes=None):
        return x.copy()
