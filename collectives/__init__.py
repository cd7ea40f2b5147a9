"""Process groups and collectives for disttensor (MPI, NCCL, or a single process).

Usage::

    import collectives as C
    g = C.init()                       # world group (MPI under mpiexec, else one process)
    y = g.all_reduce(x, "sum")         # new array
    h = g.iall_reduce(x, "sum")        # started in place; ... h.wait() returns x reduced
    row = C.new_group([0, 1])          # only members call it; cached by tuple(ranks)

Semantics fixed here (disttensor relies on them):

- Reduce ops: "sum", "avg", "max", "min", "prod" (str-Enum members with those values work).
  "avg" is sum then divide by the group size, floating/complex dtypes only: integer and bool
  inputs raise TypeError (cast first). Bool follows numpy's ufuncs in bool dtype: sum and max are
  logical or, prod and min logical and. float16 is reduced in float32 and cast back. Complex has
  no max/min (TypeError).
- all_gather / reduce_scatter / all_to_all split and concatenate like ``numpy.array_split`` /
  ``numpy.concatenate`` in group-rank order; uneven and empty pieces are fine.
- Every public call (not internal size exchanges) increments ``collective_counts()[name]``.
- ``DISTTENSOR_CHECK_COLLECTIVES=1``: each collective first all-gathers (op, call index, shape,
  dtype, arguments) over the group and raises ``CollectiveMismatchError`` on every rank if they
  disagree.
- ``DISTTENSOR_BACKEND=mpi|nccl`` chooses how cupy arrays travel (see ``_gpu``).
- Under MPI, importing this package installs the failure policy of :mod:`collectives.failure`
  (unhandled exceptions and exits end the job; a watchdog over blocked collectives,
  ``DISTTENSOR_TIMEOUT``, a stall probe after ``DISTTENSOR_STALL_TIMEOUT``); before any data
  moves the members of a group agree on each call's index, kind and byte count
  (:mod:`collectives._headers`), so ranks in different calls raise ``CollectiveMismatchError``
  on every member instead of exchanging wrong data.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional, Sequence

from . import failure
from ._common import (
    COLLECTIVE_NAMES,
    REDUCE_OPS,
    CollectiveMismatchError,
    collective_counts,
    reset_collective_counts,
)
from .group import (
    LocalGroup,
    PendingAllReduce,
    ProcessGroup,
    before_next_collective,
    cancel_before_next_collective,
)

__all__ = [
    "init",
    "world",
    "get_rank",
    "get_world_size",
    "new_group",
    "is_mpi",
    "ProcessGroup",
    "PendingAllReduce",
    "CollectiveMismatchError",
    "collective_counts",
    "reset_collective_counts",
    "REDUCE_OPS",
    "COLLECTIVE_NAMES",
    "before_next_collective",
    "cancel_before_next_collective",
]

# Environment variables set by MPI process managers (MPICH/Hydra, Open MPI, PMIx, Intel MPI,
# Slurm's PMI2). Singleton `python x.py` sets none of them.
_MPI_ENV_VARS = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_FD",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "HYDRA_CONTROL_FD",
    "MV2_COMM_WORLD_SIZE",
)

_lock = threading.RLock()
_world: Optional[ProcessGroup] = None
_groups: dict[tuple, ProcessGroup] = {}


def is_mpi() -> bool:
    """True when this process was started by an MPI launcher (or MPI is already initialised)."""
    if any(v in os.environ for v in _MPI_ENV_VARS):
        return True
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None:
        try:
            return mod.Is_initialized() and mod.COMM_WORLD.Get_size() > 1
        except Exception:  # pragma: no cover
            return False
    return False


def init() -> ProcessGroup:
    """Return the world group, creating it once (idempotent)."""
    global _world
    w = _world
    if w is not None:
        return w
    with _lock:
        if _world is not None:
            return _world
        if is_mpi():
            from mpi4py import MPI

            from ._mpi import MPIGroup

            failure.mpi_started()
            comm = MPI.COMM_WORLD.Dup()  # private context: never mixes with user traffic
            _world = MPIGroup(comm, range(comm.Get_size()))
            failure.start(MPI.COMM_WORLD)
        else:
            _world = LocalGroup()
        _groups[_world.ranks] = _world
        return _world


if is_mpi():
    failure.install()


class _Forming:
    """The group being created, as the watchdog sees it (its members' global ranks)."""

    def __init__(self, ranks: tuple):
        self.ranks = ranks


def world() -> ProcessGroup:
    return init()


def get_rank() -> int:
    return init().rank


def get_world_size() -> int:
    return init().size


def new_group(ranks: Sequence[int]) -> ProcessGroup:
    """The group of the given global ranks (group rank i is ``ranks[i]``), cached by tuple.

    Only the members call it (creation is collective over the members only). A caller that is
    not in ``ranks`` gets a ValueError.
    """
    w = init()
    try:
        key = tuple(int(r) for r in ranks)
    except Exception:
        raise TypeError(f"new_group: ranks must be a sequence of ints, got {ranks!r}")
    me = w.ranks[w.rank]
    if not key:
        raise ValueError("new_group: ranks must not be empty")
    if len(set(key)) != len(key):
        raise ValueError(f"new_group: ranks {list(key)} contain duplicates")
    bad = [r for r in key if not 0 <= r < w.size]
    if bad:
        raise ValueError(f"new_group: ranks {bad} out of range for world size {w.size} "
                         f"(ranks={list(key)})")
    if me not in key:
        raise ValueError(f"new_group: caller (global rank {me}) is not in ranks {list(key)}; only "
                         "members may call new_group")
    with _lock:
        g = _groups.get(key)
        if g is not None:
            return g
        if isinstance(w, LocalGroup):
            g = w  # the only possible group is [0]
        else:
            from ._mpi import MPIGroup

            # collective over the members: watched like one (a member elsewhere is reported)
            failure.Watch.now = (_Forming(key), "new_group", (), -1, time.monotonic(),
                                 sys._getframe(1))
            try:
                wcomm = w.comm
                grp = wcomm.Get_group().Incl(list(key))
                comm = wcomm.Create_group(grp)
                grp.Free()
                g = MPIGroup(comm, key)
            finally:
                failure.Watch.now = None
        _groups[key] = g
        return g
