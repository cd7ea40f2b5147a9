"""MPI backend (mpi4py) for numpy buffers, plus dispatch of cupy arrays to NCCL or host staging.

Layout strategy
---------------
MPI collectives concatenate along the first axis of a flat buffer. For ``axis == 0`` on a
C-contiguous input the numpy arrays are handed to MPI directly through the buffer interface and
MPI writes into the freshly allocated result: no extra copy. For another axis the input is copied
once with that axis in front, and the result is copied back once.

Large counts
------------
mpi4py >= 4 on an MPI >= 4 library calls the large-count (``_c``) routines by itself, so counts
above 2**31-1 work natively (``NATIVE_LARGE_COUNT``). Otherwise any message whose count or
displacement (in MPI datatype elements) exceeds ``MAX_COUNT`` goes through a chunked path
(chunked Allreduce / Bcast / Reduce / Sendrecv). Tests set ``NATIVE_LARGE_COUNT = False`` and a
tiny ``MAX_COUNT`` to exercise that path.
"""
from __future__ import annotations

import os
from functools import lru_cache
from math import prod
from typing import NamedTuple


import numpy as np

from . import _common as C
from ._headers import open_board
from .group import ProcessGroup, _finish

from mpi4py import MPI  # noqa: E402  (this module is only imported under MPI)

MAX_COUNT = 2**31 - 1


def _native_large_count() -> bool:
    try:
        import mpi4py

        major = int(mpi4py.__version__.split(".")[0])
        return major >= 4 and MPI.Get_version() >= (4, 0)
    except Exception:  # pragma: no cover
        return False


NATIVE_LARGE_COUNT = _native_large_count()

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}
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


#: all_gather along a non-leading axis receives in place (vector datatypes) from this many
#: result bytes on; below, one flat Allgather plus an interleaving copy is faster
#: (benchmarks/reshard.py, S(1)->R: at 4 KB 0.60-0.67 of the bare call against 0.53 strided, at
#: 64 KB (256 KB of result) 0.54-0.71 strided against 0.13-0.60 interleaved)
STRIDED_MIN_BYTES = 1 << 16
_GATHER_TAG = 11
_vector_types: dict = {}


def _vector_type(dtype, count: int, block: int, stride: int) -> "MPI.Datatype":
    """``count`` blocks of ``block`` elements, ``stride`` elements apart (committed once and
    cached per (dtype, count, block, stride); at most 256 kept)."""
    key = (np.dtype(dtype), count, block, stride)
    t = _vector_types.get(key)
    if t is None:
        if len(_vector_types) >= 256:
            _vector_types.pop(next(iter(_vector_types))).Free()
        t = _vector_types[key] = mpi_type(dtype).Create_vector(count, block, stride).Commit()
    return t


#: all_to_all packs the pieces it sends into one buffer kept for the process (grown to the
#: largest pack) from this many bytes on: fresh memory past glibc's mmap threshold (at most
#: 32 MB) costs a page fault per 4 KB on every call (S(0)->S(1) packed at 64 MB: 0.33 of the
#: bare Alltoall with a fresh pack buffer, 0.90 with the kept one; benchmarks/reshard.py)
SCRATCH_MIN_BYTES = 1 << 20
_scratch = [np.empty(0, np.uint8)]


def _pack_buffer(count: int, dtype: np.dtype) -> np.ndarray:
    """A flat buffer of ``count`` elements for packing (the kept one from
    SCRATCH_MIN_BYTES on; collectives are blocking, so one caller uses it at a time)."""
    nbytes = count * dtype.itemsize
    if nbytes < SCRATCH_MIN_BYTES:
        return np.empty(count, dtype)
    if _scratch[0].nbytes < nbytes:
        _scratch[0] = np.empty(0, np.uint8)  # free the old one first
        _scratch[0] = np.empty(nbytes, np.uint8)
    return _scratch[0][:nbytes].view(dtype)


#: all_to_all whose pieces are strided in the sender and land contiguously (``concat_axis`` 0,
#: ``split_axis`` > 0: S(0) -> S(1)) has each sender copy its strided rows straight into the
#: receivers' results, which live in memory every rank of the node maps (``_shared``), from
#: this many bytes per rank on (the group's total over its size) when every strided run is at
#: least SHARED_MIN_RUN bytes; below, or off one node, the packing path (benchmarks/reshard.py
#: at 4 ranks: the handshake costs about 200 us, so at 256 KB per rank 0.30 of the bare
#: Alltoall against the pack's 0.38, at 1 MB 0.58 against 0.45; docs/ARCHITECTURE.md
#: "Fast paths")
SHARED_MIN_BYTES = 1 << 20
SHARED_MIN_RUN = 256
_ADDR_TAG, _DONE_TAG = 8, 9


def _wait_all(reqs: list) -> None:
    """``MPI.Request.Waitall`` that gives the processor away between tests: with more ranks
    than cores, a rank spinning in MPI's wait holds the core a peer needs to write into it
    (S(0)->S(1) at 16 MB, 4 ranks on 2 cores: 0.57-0.62 of the bare Alltoall with MPI's waits,
    0.70-0.91 yielding)."""
    while not MPI.Request.Testall(reqs):
        os.sched_yield()


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


def _p2p(call, buf: np.ndarray, peer: int, tag: int) -> None:
    """``comm.Send`` / ``comm.Recv`` of a C-contiguous ``buf``, in chunks past MAX_COUNT."""
    T = mpi_type(buf.dtype)
    if _too_big(buf.size):
        bf = buf.reshape(-1)
        for a, b in _chunks(buf.size):
            call([bf[a:b], T], peer, tag)
    else:
        call([buf, T], peer, tag)


def _reduce_setup(dtype, op):
    """(working dtype, MPI op): float16 and bfloat16 reduce in float32; bool uses logical ops;
    floating max/min use NaN-propagating ops (MPI's MAX/MIN may drop a NaN, numpy keeps it)."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return dt, _BOOL_OPS[op]
    if dt == np.float16 or dt.name == "bfloat16":
        dt = np.dtype(np.float32)
    if dt.kind == "f" and op in ("max", "min"):
        return dt, _nan_op(op, dt)
    return dt, _OPS[op]


_NAN_OPS: dict = {}


def _nan_op(op: str, dt: np.dtype) -> "MPI.Op":
    """A user-defined MPI op computing numpy's maximum/minimum (NaN wins), made once per
    (op, dtype); creating an op is local, not collective."""
    mop = _NAN_OPS.get((op, dt))
    if mop is None:
        ufunc = np.maximum if op == "max" else np.minimum

        def combine(inbuf, inoutbuf, datatype):
            b = np.frombuffer(inoutbuf, dtype=dt)
            ufunc(np.frombuffer(inbuf, dtype=dt), b, out=b)
        mop = _NAN_OPS[(op, dt)] = MPI.Op.Create(combine, commute=True)
    return mop


class _A2ALayout(NamedTuple):
    """Where every piece of an all_to_all sits (pure metadata, cached). Two layouts:

    - ``own_layout`` (``s == 0 != c``): pieces are contiguous slices of x in x's own layout;
      the receiver copies each into place (``recv_slices`` of the result).
    - otherwise every piece travels with the concat axis in front (packed per destination
      from ``send_slices``; copy-free for the sender when s == c == 0), so arrivals stack along
      the front axis (``front_shape``) and the receiver moves that axis back (copy-free when
      c == 0)."""

    own_layout: bool
    scounts: list
    rcounts: list
    sdispls: list
    rdispls: list
    scounts_others: list  # the own piece is copied locally, not sent
    rcounts_others: list
    send_slices: list
    recv_slices: list
    recv_shapes: list
    front_shapes: list
    front_axes: tuple  # a piece's axes with the concat axis in front
    front_shape: tuple
    result_shape: tuple


@lru_cache(maxsize=1024)
def _a2a_layout(size: int, me: int, shape: tuple, s: int, c: int, ssizes: tuple,
                rsizes: tuple) -> _A2ALayout:
    def piece_shape(j_split, n_c):
        shp = list(shape)
        shp[s] = j_split
        shp[c] = n_c
        return shp

    def along(axis, a, n):
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(a, a + n)
        return tuple(idx)

    send_c = [ssizes[j] if s == c else shape[c] for j in range(size)]
    recv_shapes = [piece_shape(ssizes[me] if s != c else rsizes[j], rsizes[j]) for j in range(size)]
    send_shapes = [piece_shape(ssizes[j], send_c[j]) for j in range(size)]
    scounts = [prod(p) for p in send_shapes]
    rcounts = [prod(p) for p in recv_shapes]
    result_shape = list(shape)
    if s != c:
        result_shape[s] = ssizes[me]
    result_shape[c] = sum(rsizes)
    soff, roff = C.offsets(ssizes), C.offsets(rsizes)
    others_s, others_r = list(scounts), list(rcounts)
    others_s[me] = others_r[me] = 0
    return _A2ALayout(
        own_layout=s == 0 and c != 0, scounts=scounts, rcounts=rcounts,
        sdispls=C.offsets(scounts), rdispls=C.offsets(rcounts),
        scounts_others=others_s, rcounts_others=others_r,
        send_slices=[along(s, soff[j], ssizes[j]) for j in range(size)],
        recv_slices=[along(c, roff[j], rsizes[j]) for j in range(size)],
        recv_shapes=recv_shapes,
        front_shapes=[(p[c],) + tuple(d for i, d in enumerate(p) if i != c) for p in send_shapes],
        front_axes=(c,) + tuple(i for i in range(len(shape)) if i != c),
        front_shape=(sum(rsizes),) + tuple(d for i, d in enumerate(result_shape) if i != c),
        result_shape=tuple(result_shape))


# all_reduce picks one of this many communicators by (shape, dtype): ranks whose all_reduces
# disagree in shape then most often block (and are reported by the watchdog) instead of MPI
# matching them, which aborts on a truncated message or, with equal sizes, mixes the data.
_SHAPE_LANES = 4


class MPIGroup(ProcessGroup):
    """A group backed by an MPI communicator (a private duplicate, never COMM_WORLD itself).

    Each collective kind, and each reduce op of all_reduce / reduce_scatter, runs on its own
    duplicate of ``comm`` (``comm`` itself carries send/recv and the debug check): ranks that
    call mismatched collectives (sum on one rank, max on another) then block, and the watchdog
    reports them, instead of MPI matching the calls and returning wrong values. all_reduce
    further picks one of ``_SHAPE_LANES`` duplicates by shape and dtype."""

    backend_name = "mpi"
    _comm_errors = (MPI.Exception,)

    def __init__(self, comm: "MPI.Comm", ranks):
        super().__init__(ranks, comm.Get_rank())
        comm.Set_errhandler(MPI.ERRORS_RETURN)  # errors become exceptions (and reports)
        self.comm = comm
        self._reduce_comm = {op: [comm.Dup() for _ in range(_SHAPE_LANES)] for op in C.REDUCE_OPS}
        self._rs_comm = {op: comm.Dup() for op in C.REDUCE_OPS}
        self._gather_comm = comm.Dup()
        self._a2a_comm = comm.Dup()
        self._bcast_comm = comm.Dup()
        self._sendrecv_comm = comm.Dup()
        self._barrier_comm = comm.Dup()
        self._meta_comm = comm.Dup()  # exchange_metadata
        for c in (*[c for lane in self._reduce_comm.values() for c in lane],
                  *self._rs_comm.values(), self._gather_comm,
                  self._a2a_comm, self._bcast_comm, self._sendrecv_comm, self._barrier_comm,
                  self._meta_comm):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self._board = open_board(comm)
        self._gpu = None  # lazily created GPU helper (NCCL or host staging)
        self._shared = None  # SharedResults, False where unavailable, None until first needed

    # ---------------------------------------------------------------------------------- util
    def _allgather_obj(self, obj):
        return self.comm.allgather(obj)

    def _exchange_obj(self, obj):
        return self._meta_comm.allgather(obj)

    def _exchange_ints(self, value: int) -> list[int]:
        a = np.array([value], dtype=np.int64)
        b = np.empty(self.size, dtype=np.int64)
        self._gather_comm.Allgather([a, MPI.INT64_T], [b, MPI.INT64_T])
        return [int(v) for v in b]

    def _gpu_impl(self, collective: bool = True):
        """GPU helper; created at the first cupy *collective* (its setup is collective).
        Point-to-point calls before that use host staging."""
        if self._gpu is None:
            from ._gpu import HostStaged, make_gpu_backend

            if not collective:
                return HostStaged(self)
            self._gpu = make_gpu_backend(self)
        return self._gpu

    # ------------------------------------------------------------------- prepared collectives
    def _prepared(self, name, shape, dtype, args):
        """For ``prepare`` (numpy x of ``shape``/``dtype``): the MPI call with buffers' counts,
        datatypes and communicator resolved, where the result needs no conversion; else the
        general numpy path."""
        special = {"all_reduce": self._prepared_all_reduce, "all_gather": self._prepared_all_gather,
                   "reduce_scatter": self._prepared_reduce_scatter,
                   "all_to_all": self._prepared_all_to_all, "sendrecv": self._prepared_sendrecv
                   }.get(name)
        run = special(shape, dtype, *args) if special is not None else None
        if run is None:
            impl = getattr(self, "np_" + name)
            run = lambda x, out: impl(x, *args, out)  # noqa: E731
        return run

    def _prepared_all_reduce(self, shape, dtype, op):
        work, mop = _reduce_setup(dtype, op)
        if work != dtype or op == "avg" or _too_big(prod(shape)):
            return None
        T = mpi_type(dtype)
        comm = self._reduce_comm[op][hash((shape, dtype.num)) & (_SHAPE_LANES - 1)]

        def run(x, out):
            recv = out if out is not None else np.empty(shape, dtype)
            comm.Allreduce([np.ascontiguousarray(x), T], [recv, T], op=mop)
            return recv
        return run

    def _prepared_all_gather(self, shape, dtype, axis, sizes):
        if sizes is None:
            return None
        outer, inner = prod(shape[:axis]), prod(shape[axis + 1:])
        rshape = shape[:axis] + (sum(sizes),) + shape[axis + 1:]
        if _too_big(prod(rshape)):
            return None
        T, comm = mpi_type(dtype), self._gather_comm
        if outer > 1:
            if prod(rshape) * dtype.itemsize < STRIDED_MIN_BYTES:
                return self._prepared_all_gather_interleaved(dtype, sizes, rshape, outer, inner)
            return lambda x, out: self._all_gather_strided(
                np.ascontiguousarray(x), sizes, out if out is not None else np.empty(rshape, dtype),
                outer, inner)
        counts = [outer * s * inner for s in sizes]  # outer is 0 or 1 here
        if all(c == counts[0] for c in counts):
            def run(x, out):
                buf = out if out is not None else np.empty(rshape, dtype)
                comm.Allgather([np.ascontiguousarray(x), counts[0], T], [buf, counts[0], T])
                return buf
        else:
            displs, mine = C.offsets(counts), counts[self.rank]

            def run(x, out):
                buf = out if out is not None else np.empty(rshape, dtype)
                comm.Allgatherv([np.ascontiguousarray(x), mine, T], [buf, counts, displs, T])
                return buf
        return run

    def _prepared_all_gather_interleaved(self, dtype, sizes, rshape, outer, inner):
        """Small all_gather along a non-leading axis: one flat Allgather(v), then one copy
        interleaving the pieces into place (as ``_all_gather_interleaved``)."""
        T, comm, n = mpi_type(dtype), self._gather_comm, self.size
        counts = [outer * s * inner for s in sizes]
        flat_n, total = sum(counts), sum(sizes)
        if all(c == counts[0] for c in counts):
            grid, s0 = (n, outer, sizes[0], inner), sizes[0]

            def run(x, out):
                flat = np.empty(flat_n, dtype)
                comm.Allgather([np.ascontiguousarray(x), counts[0], T], [flat, counts[0], T])
                res = out if out is not None else np.empty(rshape, dtype)
                np.copyto(res.reshape(outer, n, s0, inner),
                          flat.reshape(grid).transpose(1, 0, 2, 3))
                return res
            return run
        displs, offs, mine = C.offsets(counts), C.offsets(sizes), counts[self.rank]
        pieces = [(slice(displs[k], displs[k] + counts[k]), (outer, sizes[k], inner),
                   slice(offs[k], offs[k] + sizes[k])) for k in range(n)]

        def run_uneven(x, out):
            flat = np.empty(flat_n, dtype)
            comm.Allgatherv([np.ascontiguousarray(x), mine, T], [flat, counts, displs, T])
            res = out if out is not None else np.empty(rshape, dtype)
            res3 = res.reshape(outer, total, inner)
            for src, shp, dst in pieces:
                res3[:, dst] = flat[src].reshape(shp)
            return res
        return run_uneven

    def _prepared_all_to_all(self, shape, dtype, s, c, ssizes, rsizes):
        """Small even pieces that travel concat axis first (``_a2a_layout``'s second layout):
        packed by one copy from a view of x split along ``s``, one Alltoall straight into the
        result when ``c == 0`` (else into a buffer moved back once). Other cases (large ones
        write across processes or pack into the kept buffer): the general path."""
        n = self.size
        if (rsizes is None or s == c or (s == 0 and c != 0) or len(set(ssizes)) > 1
                or len(set(rsizes)) > 1 or prod(shape) * dtype.itemsize >= SCRATCH_MIN_BYTES
                or self._shared_sized(shape, dtype.itemsize, s, c, ssizes, rsizes)):
            return None
        L = _a2a_layout(n, self.rank, shape, s, c, tuple(ssizes), tuple(rsizes))
        split = shape[:s] + (n, ssizes[0]) + shape[s + 1:]
        at = [i if i < s else i + 1 for i in range(len(shape))]  # x's axes in ``split``
        perm = (s, at[c]) + tuple(at[i] for i in range(len(shape)) if i != c)
        packed = (n,) + L.front_shapes[0]
        T, comm, count = mpi_type(dtype), self._a2a_comm, L.scounts[0]

        def run(x, out):
            sendbuf = np.empty(packed, dtype)
            np.copyto(sendbuf, x.reshape(split).transpose(perm))
            recv = out if (c == 0 and out is not None) else np.empty(L.front_shape, dtype)
            comm.Alltoall([sendbuf, count, T], [recv, count, T])
            return _back(recv, c, out)
        return run

    def _prepared_reduce_scatter(self, shape, dtype, op, axis, sizes):
        work, mop = _reduce_setup(dtype, op)
        if work != dtype or op == "avg" or axis != 0 or _too_big(prod(shape)):
            return None
        inner = prod(shape[1:])
        counts = [s * inner for s in sizes]
        rshape = (sizes[self.rank],) + shape[1:]
        T, comm = mpi_type(dtype), self._rs_comm[op]
        even = all(c == counts[0] for c in counts)

        def run(x, out):
            recv = out if out is not None else np.empty(rshape, dtype)
            if even:
                comm.Reduce_scatter_block([np.ascontiguousarray(x), T], [recv, T], op=mop)
            else:
                comm.Reduce_scatter([np.ascontiguousarray(x), T], [recv, T], recvcounts=counts,
                                    op=mop)
            return recv
        return run

    def _prepared_sendrecv(self, shape, dtype, dst, src, rshape):
        if dst == self.rank or _too_big(prod(shape), prod(rshape)):
            return None
        T, comm = mpi_type(dtype), self._sendrecv_comm

        def run(x, out):
            buf = out if out is not None else np.empty(rshape, dtype)
            comm.Sendrecv([np.ascontiguousarray(x), T], dst, 0, [buf, T], src, 0)
            return buf
        return run

    # ---------------------------------------------------------------------------- collectives
    def _all_reduce(self, x, op, out):
        if C.is_cupy(x):
            return self._gpu_impl().all_reduce(x, op, out)
        return self.np_all_reduce(x, op, out)

    def np_all_reduce(self, x, op, out):
        work, mop = _reduce_setup(x.dtype, op)
        src = np.asarray(x, dtype=work, order="C")
        if out is not None and out.dtype == work:
            recv = out
        else:
            recv = np.empty(src.shape, dtype=work)
        T = mpi_type(work)
        n = src.size
        comm = self._reduce_comm[op][hash((x.shape, x.dtype.num)) & (_SHAPE_LANES - 1)]
        if _too_big(n):
            sf, rf = src.reshape(-1), recv.reshape(-1)
            for a, b in _chunks(n):
                comm.Allreduce([sf[a:b], T], [rf[a:b], T], op=mop)
        else:
            comm.Allreduce([src, T], [recv, T], op=mop)
        if op == "avg":
            recv /= self.size
        if recv.dtype != x.dtype:
            recv = recv.astype(x.dtype)
        return _finish(recv, out) if recv is not out else out

    def _iall_reduce(self, x, op):
        """(request, finish) of an in-place MPI_Iallreduce on ``x``'s all_reduce lane (so
        order and matching are those of the blocking call); cupy arrays and counts past
        MAX_COUNT take the blocking path (request None)."""
        if C.is_cupy(x) or _too_big(x.size):
            x[...] = self._all_reduce(x, op, None)
            return None, None
        work, mop = _reduce_setup(x.dtype, op)
        buf = x if x.dtype == work else x.astype(work)
        comm = self._reduce_comm[op][hash((x.shape, x.dtype.num)) & (_SHAPE_LANES - 1)]
        req = comm.Iallreduce(MPI.IN_PLACE, [buf, mpi_type(work)], op=mop)
        if op != "avg" and buf is x:
            return req, None
        size = self.size

        def finish():
            if op == "avg":
                np.true_divide(buf, size, out=buf)
            if buf is not x:
                x[...] = buf
        return req, finish

    def _all_gather(self, x, axis, sizes, out):
        if C.is_cupy(x):
            return self._gpu_impl().all_gather(x, axis, sizes, out)
        return self.np_all_gather(x, axis, sizes, out)

    def np_all_gather(self, x, axis, sizes, out):
        if sizes is None:
            sizes = self._exchange_ints(x.shape[axis])
        total = sum(sizes)
        T = mpi_type(x.dtype)
        outer = prod(x.shape[:axis])
        inner = prod(x.shape[axis + 1:])
        if axis > 0 and outer > 1:
            return self._all_gather_interleaved(x, axis, sizes, out, outer, inner)
        xf = _front(x, axis)
        rest = xf.shape[1:]
        inner = prod(rest)
        buf = out if (axis == 0 and out is not None) else np.empty((total,) + rest, dtype=x.dtype)
        counts = [s * inner for s in sizes]
        displs = C.offsets(counts)
        if _too_big(total * inner):
            bf = buf.reshape(-1)
            for k in range(self.size):
                region = bf[displs[k]:displs[k] + counts[k]]
                if k == self.rank:
                    region[...] = xf.reshape(-1)
                for a, b in _chunks(counts[k]):
                    self._gather_comm.Bcast([region[a:b], T], root=k)
        elif all(c == counts[0] for c in counts):  # sizes are known alike on every rank
            self._gather_comm.Allgather([xf, counts[0], T], [buf, counts[0], T])
        else:
            self._gather_comm.Allgatherv([xf, counts[self.rank], T], [buf, counts, displs, T])
        return _back(buf, axis, out)

    def _all_gather_interleaved(self, x, axis, sizes, out, outer, inner):
        """Non-zero axis. Large results: each piece is received straight into its strided place
        (point-to-point, an MPI vector datatype per source) and sent from x as it is — no copy
        besides MPI's own. Small ones: every rank's buffer travels flat through one Allgather
        and is interleaved into place on arrival (one copy, fewer calls)."""
        shape = list(x.shape)
        total = shape[axis] = sum(sizes)
        res = out if out is not None else np.empty(shape, dtype=x.dtype)
        if res.nbytes >= STRIDED_MIN_BYTES and not _too_big(res.size):
            return self._all_gather_strided(np.ascontiguousarray(x), sizes, res, outer, inner)
        flat = self.np_all_gather(np.ascontiguousarray(x).reshape(-1), 0,
                                  [outer * s * inner for s in sizes], None)
        res3 = res.reshape(outer, total, inner)
        pos = off = 0
        for s in sizes:
            res3[:, off:off + s, :] = flat[pos:pos + outer * s * inner].reshape(outer, s, inner)
            pos += outer * s * inner
            off += s
        return res

    def _all_gather_strided(self, x, sizes, res, outer, inner):
        size, me, comm = self.size, self.rank, self._gather_comm
        total = sum(sizes)
        offs = C.offsets(sizes)
        flat = res.reshape(-1)
        T = mpi_type(x.dtype)
        reqs = []
        for k in range(1, size):
            frm, to = (me - k) % size, (me + k) % size
            if sizes[frm] * inner:
                vt = _vector_type(x.dtype, outer, sizes[frm] * inner, total * inner)
                reqs.append(comm.Irecv([flat[offs[frm] * inner:], 1, vt], frm, _GATHER_TAG))
            if x.size:
                reqs.append(comm.Isend([x, T], to, _GATHER_TAG))
        res.reshape(outer, total, inner)[:, offs[me]:offs[me] + sizes[me]] = \
            x.reshape(outer, sizes[me], inner)
        MPI.Request.Waitall(reqs)
        return res

    def _reduce_scatter(self, x, op, axis, sizes, out):
        if C.is_cupy(x):
            return self._gpu_impl().reduce_scatter(x, op, axis, sizes, out)
        return self.np_reduce_scatter(x, op, axis, sizes, out)

    def np_reduce_scatter(self, x, op, axis, sizes, out):
        work, mop = _reduce_setup(x.dtype, op)
        xf = _front(x, axis)
        if xf.dtype != work:
            xf = xf.astype(work)
        rest = xf.shape[1:]
        inner = prod(rest)
        counts = [s * inner for s in sizes]
        displs = C.offsets(counts)
        recv = np.empty((sizes[self.rank],) + rest, dtype=work)
        T = mpi_type(work)
        comm = self._rs_comm[op]
        if _too_big(sum(counts)):
            sf, rf = xf.reshape(-1), recv.reshape(-1)
            for i in range(self.size):
                for a, b in _chunks(counts[i]):
                    piece = sf[displs[i] + a:displs[i] + b]
                    comm.Reduce([piece, T], [rf[a:b], T] if i == self.rank else None, op=mop, root=i)
        elif all(c == counts[0] for c in counts):
            comm.Reduce_scatter_block([xf, T], [recv, T], op=mop)
        else:
            comm.Reduce_scatter([xf, T], [recv, T], recvcounts=counts, op=mop)
        if op == "avg":
            recv /= self.size
        if recv.dtype != x.dtype:
            recv = recv.astype(x.dtype)
        return _back(recv, axis, out)

    def _all_to_all(self, x, s, c, ssizes, rsizes, out):
        if C.is_cupy(x):
            return self._gpu_impl().all_to_all(x, s, c, ssizes, rsizes, out)
        return self.np_all_to_all(x, s, c, ssizes, rsizes, out)

    def np_all_to_all(self, x, s, c, ssizes, rsizes, out):
        """Pieces travel in one of two layouts, chosen from metadata every rank shares (see
        ``_a2a_layout``); the own piece never goes through MPI unless chunked."""
        size, me = self.size, self.rank
        if rsizes is None:
            a = np.array([ssizes[j] if s == c else x.shape[c] for j in range(size)], dtype=np.int64)
            b = np.empty(size, dtype=np.int64)
            self._a2a_comm.Alltoall([a, MPI.INT64_T], [b, MPI.INT64_T])
            rsizes = [int(v) for v in b]
        L = _a2a_layout(size, me, tuple(x.shape), s, c, tuple(ssizes), tuple(rsizes))
        large = False
        if not NATIVE_LARGE_COUNT:
            # every rank must pick the same algorithm, and only this rank sees its own counts
            mine = max(sum(L.scounts), sum(L.rcounts)) > MAX_COUNT
            large = bool(self._a2a_comm.allreduce(int(mine), op=MPI.MAX))
        if not large and self._writes_across(x, s, c, ssizes, rsizes):
            return self._all_to_all_written(np.ascontiguousarray(x), L, s, ssizes, out)
        T = mpi_type(x.dtype)
        sd, rd = L.sdispls, L.rdispls
        if L.own_layout:  # pieces are contiguous slices of x; placed on arrival
            sendbuf = np.asarray(x, order="C").reshape(-1)
            recvbuf = np.empty(sum(L.rcounts), dtype=x.dtype)
        else:
            if s == c:
                sendbuf = _front(x, s).reshape(-1)
            else:
                sendbuf = _pack_buffer(x.size, x.dtype)
                for j in range(size):
                    if j != me or large:
                        np.copyto(sendbuf[sd[j]:sd[j] + L.scounts[j]].reshape(L.front_shapes[j]),
                                  x[L.send_slices[j]].transpose(L.front_axes))
            recvbuf = out if (c == 0 and out is not None) else np.empty(L.front_shape, x.dtype)
        rf = recvbuf.reshape(-1)
        if large:
            rf[rd[me]:rd[me] + L.rcounts[me]] = sendbuf[sd[me]:sd[me] + L.scounts[me]]
            for k in range(1, size):
                dst, src = (me + k) % size, (me - k) % size
                reqs = [
                    self._a2a_comm.Irecv([rf[rd[src] + a:rd[src] + b], T], source=src, tag=7)
                    for a, b in _chunks(L.rcounts[src])
                ]
                reqs += [
                    self._a2a_comm.Isend([sendbuf[sd[dst] + a:sd[dst] + b], T], dest=dst, tag=7)
                    for a, b in _chunks(L.scounts[dst])
                ]
                MPI.Request.Waitall(reqs)
        else:
            if L.own_layout:
                rf[rd[me]:rd[me] + L.rcounts[me]] = sendbuf[sd[me]:sd[me] + L.scounts[me]]
            else:
                np.copyto(rf[rd[me]:rd[me] + L.rcounts[me]].reshape(L.front_shapes[me]),
                          x[L.send_slices[me]].transpose(L.front_axes))
            self._a2a_comm.Alltoallv([sendbuf, L.scounts_others, sd, T],
                                     [recvbuf, L.rcounts_others, rd, T])
        if L.own_layout:
            res = out if out is not None else np.empty(L.result_shape, dtype=x.dtype)
            for j in range(size):
                res[L.recv_slices[j]] = rf[rd[j]:rd[j] + L.rcounts[j]].reshape(L.recv_shapes[j])
            return res
        return _back(recvbuf, c, out)

    def _shared_sized(self, shape, itemsize, s, c, ssizes, rsizes) -> bool:
        """Whether an all_to_all is of the kind and size ``_all_to_all_written`` takes (from
        sizes every rank shares, so alike on every rank)."""
        if c != 0 or s == 0 or self.size == 1:
            return False
        inner = prod(shape[s + 1:]) * itemsize
        run = min((k * inner for k in ssizes if k), default=0)
        return run >= SHARED_MIN_RUN and sum(rsizes) * prod(shape[1:]) * itemsize >= \
            SHARED_MIN_BYTES * self.size

    def _writes_across(self, x, s, c, ssizes, rsizes) -> bool:
        """Whether this all_to_all takes ``_all_to_all_written``: ``_shared_sized`` and
        shared results work in the group (probed the first time: a collective, reached by
        every rank at the same call since ``_shared_sized`` is alike on every rank)."""
        if not self._shared_sized(x.shape, x.dtype.itemsize, s, c, ssizes, rsizes):
            return False
        if self._shared is None:
            from ._shared import SharedResults

            self._shared = SharedResults.probe(self._a2a_comm) or False
        return bool(self._shared)

    def _all_to_all_written(self, x, L, s, ssizes, out):
        """all_to_all with ``concat_axis`` 0 and ``split_axis`` s > 0 (C-contiguous x): the
        result lives in a shared segment; each rank tells each sender where its piece goes
        there and the sender copies its strided rows in (one copy, no pack). With ``out`` the
        result is copied there (the segment is reused at once)."""
        from ._shared import copy_rows

        me, item = self.rank, x.dtype.itemsize
        res, token = self._shared.result(L.result_shape, x.dtype)
        outer, inner = prod(x.shape[:s]), prod(x.shape[s + 1:]) * item
        soff, row, src = C.offsets(ssizes), x.shape[s] * inner, x.reshape(-1).view(np.uint8)

        def write(j, where):
            if not (outer and ssizes[j] and inner):
                return
            dst = self._shared.peer(j, tuple(int(v) for v in where[:3]))
            copy_rows(dst, int(where[3]), src, soff[j] * inner, outer, ssizes[j] * inner, row)

        own = res.reshape(-1).view(np.uint8)
        self._cross_exchange(self._a2a_comm, [token + (d * item,) for d in L.rdispls], write,
                             lambda: copy_rows(own, L.rdispls[me] * item, src, soff[me] * inner,
                                               outer, ssizes[me] * inner, row))
        if out is None:
            return res
        np.copyto(out, res)
        return out

    def _cross_exchange(self, comm, mine: list, move, local) -> None:
        """The handshake of a collective that writes into its peers' memory: this rank sends
        ``mine[j]`` (a tuple of 4 integers saying where) to each peer j; as peer j's arrives,
        ``move(j, where)`` and then tells j it is done; ``local()`` runs while none has
        arrived (else the rank yields); returns when every peer has said it is done with this
        rank's memory."""
        size, me = self.size, self.rank
        peers = [(me + k) % size for k in range(1, size)]
        where = np.empty((size, 4), np.uint64)
        tokens = np.array(mine, np.uint64)
        got = [comm.Irecv([where[j], MPI.UINT64_T], j, _ADDR_TAG) for j in peers]
        done = [comm.Irecv([where[:0], MPI.BYTE], j, _DONE_TAG) for j in peers]
        sent = [comm.Isend([tokens[j], MPI.UINT64_T], j, _ADDR_TAG) for j in peers]
        pending, local_left = list(peers), True
        while pending:
            i = MPI.Request.Testany([got[peers.index(p)] for p in pending])[0]
            if i == MPI.UNDEFINED:
                if local_left:
                    local()
                    local_left = False
                else:
                    os.sched_yield()
                continue
            j = pending.pop(i)
            move(j, where[j])
            sent.append(comm.Isend([where[:0], MPI.BYTE], j, _DONE_TAG))
        if local_left:
            local()
        _wait_all(sent + done)

    def _broadcast(self, x, src, out):
        if C.is_cupy(x):
            return self._gpu_impl().broadcast(x, src, out)
        return self.np_broadcast(x, src, out)

    def np_broadcast(self, x, src, out):
        if out is not None:
            buf = out
            if self.rank == src:
                np.copyto(buf, x)
        elif self.rank == src:
            buf = np.array(x, order="C", copy=True)
        else:
            buf = np.empty(x.shape, dtype=x.dtype)
        T = mpi_type(x.dtype)
        if _too_big(buf.size):
            bf = buf.reshape(-1)
            for a, b in _chunks(buf.size):
                self._bcast_comm.Bcast([bf[a:b], T], root=src)
        else:
            self._bcast_comm.Bcast([buf, T], root=src)
        return buf

    def _sendrecv(self, x, dst, src, shape, out):
        if C.is_cupy(x):
            return self._gpu_impl().sendrecv(x, dst, src, shape, out)
        return self.np_sendrecv(x, dst, src, shape, out)

    def np_sendrecv(self, x, dst, src, shape, out):
        send = np.asarray(x, order="C")
        buf = out if out is not None else np.empty(shape, dtype=x.dtype)
        if dst == self.rank:
            np.copyto(buf, send)
            return buf
        T = mpi_type(x.dtype)
        comm = self._sendrecv_comm
        if _too_big(send.size, buf.size):
            sf, rf = send.reshape(-1), buf.reshape(-1)
            reqs = [comm.Irecv([rf[a:b], T], src, 0) for a, b in _chunks(buf.size)]
            reqs += [comm.Isend([sf[a:b], T], dst, 0) for a, b in _chunks(send.size)]
            MPI.Request.Waitall(reqs)
        else:
            comm.Sendrecv([send, T], dst, 0, [buf, T], src, 0)
        return buf

    def _send(self, x, dst, tag):
        if C.is_cupy(x):
            return self._gpu_impl(collective=False).send(x, dst, tag)
        return self.np_send(x, dst, tag)

    def np_send(self, x, dst, tag):
        buf = np.asarray(x, order="C")
        _p2p(self.comm.Send, buf, dst, tag)

    def _isend(self, x, dst, tag):
        """Requests of a nonblocking send of ``x`` (chunked as ``_p2p`` does; each request
        holds its buffer alive)."""
        buf = np.asarray(x.get() if C.is_cupy(x) else x, order="C")
        T = mpi_type(buf.dtype)
        if not _too_big(buf.size):
            return [self.comm.Isend([buf, T], dst, tag)]
        flat = buf.reshape(-1)
        return [self.comm.Isend([flat[a:b], T], dst, tag) for a, b in _chunks(buf.size)]

    def _recv(self, shape, dtype, src, tag, want_cupy, out):
        if want_cupy:
            return self._gpu_impl(collective=False).recv(shape, dtype, src, tag, out)
        return self.np_recv(shape, dtype, src, tag, out)

    def np_recv(self, shape, dtype, src, tag, out):
        buf = out if out is not None else np.empty(shape, dtype=dtype)
        _p2p(self.comm.Recv, buf, src, tag)
        return buf

    def _barrier(self):
        self._barrier_comm.Barrier()
