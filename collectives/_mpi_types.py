"""MPI datatypes, large counts and axis moves shared by the MPI group (``_mpi``) and its
all-to-all (``_alltoall``).

Large counts
------------
mpi4py >= 4 on an MPI >= 4 library calls the large-count (``_c``) routines by itself, so counts
above 2**31-1 work natively (``NATIVE_LARGE_COUNT``). Otherwise any message whose count or
displacement (in MPI datatype elements) exceeds ``MAX_COUNT`` goes through a chunked path
(chunked Allreduce / Bcast / Reduce / Sendrecv / Alltoall). Tests set ``NATIVE_LARGE_COUNT =
False`` and a tiny ``MAX_COUNT`` here to exercise that path.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .group import _finish

MAX_COUNT = 2**31 - 1


def _native_large_count() -> bool:
    try:
        import mpi4py

        major = int(mpi4py.__version__.split(".")[0])
        return major >= 4 and MPI.Get_version() >= (4, 0)
    except Exception:  # pragma: no cover
        return False


NATIVE_LARGE_COUNT = _native_large_count()

_type_cache: dict = {}


def mpi_type(dtype) -> "MPI.Datatype":
    """MPI datatype for a numpy dtype (a committed contiguous byte type when there is none)."""
    dt = np.dtype(dtype)
    t = _type_cache.get(dt)
    if t is None:
        t = MPI._typedict.get(dt.char) if dt.isnative else None  # predefined types
        if t is None or t == MPI.DATATYPE_NULL or t.Get_size() != dt.itemsize:
            t = MPI.BYTE.Create_contiguous(dt.itemsize).Commit()
        _type_cache[dt] = t
    return t


def _too_big(*ns: int) -> bool:
    return (not NATIVE_LARGE_COUNT) and max(ns, default=0) > MAX_COUNT


def _chunks(n: int):
    lim = max(1, int(MAX_COUNT))
    for a in range(0, n, lim):
        yield a, min(n, a + lim)


def _front(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` with ``axis`` moved to the front, C-contiguous (no copy when already so)."""
    if axis == 0:
        return np.asarray(x, order="C")
    return np.asarray(np.moveaxis(x, axis, 0), order="C")


def _back(buf: np.ndarray, axis: int, out):
    """Undo ``_front`` into a new C-contiguous array (or into ``out``)."""
    if axis == 0:
        return _finish(buf, out) if out is not buf else out
    moved = np.moveaxis(buf, 0, axis)
    if out is not None:
        np.copyto(out, moved)
        return out
    return np.asarray(moved, order="C")
