"""MPI backend (mpi4py) for numpy buffers, plus dispatch of cupy arrays to NCCL or host staging.

Layout strategy
---------------
MPI collectives concatenate along the first axis of a flat buffer. For ``axis == 0`` on a
C-contiguous input the numpy arrays are handed to MPI directly through the buffer interface and
MPI writes into the freshly allocated result: no extra copy. For another axis the input is copied
once with that axis in front, and the result is copied back once. Counts past ``MAX_COUNT`` go
through chunked calls (``_mpi_types``); all_to_all is ``_alltoall``'s.
"""
from __future__ import annotations

from math import prod

import numpy as np
from mpi4py import MPI  # this module is only imported under MPI

from . import _common as C
from ._alltoall import AllToAll
from ._headers import open_board
from ._mpi_types import _back, _chunks, _front, _too_big, mpi_type
from .group import ProcessGroup, _finish

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}


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



# all_reduce picks one of this many communicators by (shape, dtype): ranks whose all_reduces
# disagree in shape then most often block (and are reported by the watchdog) instead of MPI
# matching them, which aborts on a truncated message or, with equal sizes, mixes the data.
_SHAPE_LANES = 4


class MPIGroup(AllToAll, ProcessGroup):
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
                    comm.Reduce([piece, T], [rf[a:b], T] if i == self.rank else None, op=mop,
                                root=i)
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
