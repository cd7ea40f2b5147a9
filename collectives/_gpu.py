"""cupy arrays on an MPI group: NCCL (``cupy.cuda.nccl``) or host staging through MPI.

Choice, made once per group at its first collective on a cupy array (collectively, so every rank
agrees): ``DISTTENSOR_BACKEND=mpi`` forces host staging, ``=nccl`` forces NCCL (error if it cannot
be used); otherwise NCCL is used when ``cupy.cuda.nccl`` imports on every rank and every rank of
the group sits on a different GPU, else host staging. Point-to-point calls use NCCL only once the
group's NCCL communicator exists (creating it is collective), otherwise host staging.

cupy is imported lazily: nothing here runs unless a cupy array is passed in.
"""
from __future__ import annotations

import os
import socket
from math import prod

import numpy as np

from . import _common as C


def _cupy():
    import cupy

    return cupy


def _finish(res, out):
    if out is None:
        return res
    out[...] = res
    return out


class HostStaged:
    """Copy to host, run the MPI numpy path, copy back."""

    name = "host-staged"

    def __init__(self, group):
        self.g = group

    def _up(self, arr, out):
        cp = _cupy()
        if out is not None:
            out[...] = cp.asarray(arr)
            return out
        return cp.asarray(arr)

    def all_reduce(self, x, op, out):
        return self._up(self.g.np_all_reduce(_cupy().asnumpy(x), op, None), out)

    def all_gather(self, x, axis, sizes, out):
        return self._up(self.g.np_all_gather(_cupy().asnumpy(x), axis, sizes, None), out)

    def reduce_scatter(self, x, op, axis, sizes, out):
        return self._up(self.g.np_reduce_scatter(_cupy().asnumpy(x), op, axis, sizes, None), out)

    def all_to_all(self, x, s, c, ssizes, rsizes, out):
        return self._up(self.g.np_all_to_all(_cupy().asnumpy(x), s, c, ssizes, rsizes, None), out)

    def broadcast(self, x, src, out):
        return self._up(self.g.np_broadcast(_cupy().asnumpy(x), src, None), out)

    def send(self, x, dst, tag):
        self.g.np_send(_cupy().asnumpy(x), dst, tag)

    def recv(self, shape, dtype, src, tag, out):
        return self._up(self.g.np_recv(shape, dtype, src, tag, None), out)

    def sendrecv(self, x, dst, src, shape, out):
        return self._up(self.g.np_sendrecv(_cupy().asnumpy(x), dst, src, shape, None), out)


def _nccl_dtype(nccl, dt):
    dt = np.dtype(dt)
    table = {
        "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
        "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
        "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    }
    name = table.get(dt.name)
    return None if name is None else getattr(nccl, name, None)


class NCCLBackend:
    """One NCCL communicator per group, on the current device and the current stream."""

    name = "nccl"

    def __init__(self, group, nccl, host: HostStaged):
        self.g = group
        self.nccl = nccl
        self.host = host
        uid = nccl.get_unique_id() if group.rank == 0 else None
        uid = group.comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(group.size, uid, group.rank)
        self.ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD,
                    "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    # helpers ---------------------------------------------------------------------------
    def _stream(self):
        return _cupy().cuda.get_current_stream().ptr

    def _typed(self, dt, op=None):
        """(view dtype, nccl dtype, nccl op) or None if NCCL cannot do it."""
        dt = np.dtype(dt)
        if dt.kind == "b":
            view = np.dtype(np.uint8)
            nop = None
            if op is not None:
                nop = self.nccl.NCCL_MAX if op in ("sum", "max") else self.nccl.NCCL_MIN
            return view, _nccl_dtype(self.nccl, view), nop
        if op is None and _nccl_dtype(self.nccl, dt) is None:
            return np.dtype(np.uint8), self.nccl.NCCL_UINT8, None  # move raw bytes
        nd = _nccl_dtype(self.nccl, dt)
        if nd is None:
            return None
        return dt, nd, (None if op is None else self.ops[op])

    @staticmethod
    def _flat(a, view):
        return a.reshape(-1).view(view)

    # collectives -----------------------------------------------------------------------
    def all_reduce(self, x, op, out):
        t = self._typed(x.dtype, op)
        if t is None:
            return self.host.all_reduce(x, op, out)
        cp = _cupy()
        view, nd, nop = t
        src = cp.asarray(x, order="C")
        res = out if out is not None else cp.empty_like(src)
        s, r = self._flat(src, view), self._flat(res, view)
        self.comm.allReduce(s.data.ptr, r.data.ptr, s.size, nd, nop, self._stream())
        if op == "avg":
            res /= self.g.size
        return res

    def all_gather(self, x, axis, sizes, out):
        t = self._typed(x.dtype)
        cp = _cupy()
        if sizes is None:
            sizes = self.g._exchange_ints(x.shape[axis])
        view, nd, _ = t
        xf = cp.asarray(cp.moveaxis(x, axis, 0), order="C")
        rest = xf.shape[1:]
        buf = cp.empty((sum(sizes),) + rest, dtype=x.dtype)
        inner = prod(rest) * (np.dtype(x.dtype).itemsize // view.itemsize)
        bf = self._flat(buf, view)
        sf = self._flat(xf, view)
        offs = C.offsets(sizes)
        st = self._stream()
        self.nccl.groupStart()
        for k in range(self.g.size):
            region = bf[offs[k] * inner:(offs[k] + sizes[k]) * inner]
            send = sf if k == self.g.rank else region
            self.comm.broadcast(send.data.ptr, region.data.ptr, region.size, nd, k, st)
        self.nccl.groupEnd()
        return _finish(cp.asarray(cp.moveaxis(buf, 0, axis), order="C"), out)

    def reduce_scatter(self, x, op, axis, sizes, out):
        t = self._typed(x.dtype, op)
        if t is None:
            return self.host.reduce_scatter(x, op, axis, sizes, out)
        cp = _cupy()
        view, nd, nop = t
        xf = cp.asarray(cp.moveaxis(x, axis, 0), order="C")
        rest = xf.shape[1:]
        res = cp.empty((sizes[self.g.rank],) + rest, dtype=x.dtype)
        inner = prod(rest) * (np.dtype(x.dtype).itemsize // view.itemsize)
        sf, rf = self._flat(xf, view), self._flat(res, view)
        offs = C.offsets(sizes)
        st = self._stream()
        self.nccl.groupStart()
        for k in range(self.g.size):
            piece = sf[offs[k] * inner:(offs[k] + sizes[k]) * inner]
            self.comm.reduce(piece.data.ptr, rf.data.ptr, piece.size, nd, nop, k, st)
        self.nccl.groupEnd()
        if op == "avg":
            res /= self.g.size
        return _finish(cp.asarray(cp.moveaxis(res, 0, axis), order="C"), out)

    def all_to_all(self, x, s, c, ssizes, rsizes, out):
        cp = _cupy()
        view, nd, _ = self._typed(x.dtype)
        size = self.g.size
        shape = x.shape
        send_c = [ssizes[j] if s == c else shape[c] for j in range(size)]
        if rsizes is None:
            a = np.array(send_c, dtype=np.int64)
            b = np.empty(size, dtype=np.int64)
            self.g.comm.Alltoall(a, b)
            rsizes = [int(v) for v in b]
        soff = C.offsets(ssizes)
        pieces = []
        for j in range(size):
            sl = [slice(None)] * x.ndim
            sl[s] = slice(soff[j], soff[j] + ssizes[j])
            pieces.append(cp.asarray(cp.moveaxis(x[tuple(sl)], c, 0), order="C"))
        result_shape = self.g._a2a_result_shape(shape, s, c, ssizes, rsizes)
        front = (sum(rsizes),) + tuple(d for i, d in enumerate(result_shape) if i != c)
        buf = cp.empty(front, dtype=x.dtype)
        per_row = prod(front[1:]) * (np.dtype(x.dtype).itemsize // view.itemsize)
        bf = self._flat(buf, view)
        roff = C.offsets(rsizes)
        st = self._stream()
        self.nccl.groupStart()
        for j in range(size):
            p = self._flat(pieces[j], view)
            if p.size:
                self.comm.send(p.data.ptr, p.size, nd, j, st)
            r = bf[roff[j] * per_row:(roff[j] + rsizes[j]) * per_row]
            if r.size:
                self.comm.recv(r.data.ptr, r.size, nd, j, st)
        self.nccl.groupEnd()
        return _finish(cp.asarray(cp.moveaxis(buf, 0, c), order="C"), out)

    def broadcast(self, x, src, out):
        cp = _cupy()
        view, nd, _ = self._typed(x.dtype)
        buf = out if out is not None else cp.empty(x.shape, dtype=x.dtype)
        if self.g.rank == src:
            buf[...] = x
        b = self._flat(buf, view)
        self.comm.bcast(b.data.ptr, b.size, nd, src, self._stream())
        return buf

    def send(self, x, dst, tag):
        cp = _cupy()
        view, nd, _ = self._typed(x.dtype)
        p = self._flat(cp.asarray(x, order="C"), view)
        self.comm.send(p.data.ptr, p.size, nd, dst, self._stream())

    def recv(self, shape, dtype, src, tag, out):
        cp = _cupy()
        view, nd, _ = self._typed(dtype)
        buf = out if out is not None else cp.empty(shape, dtype=dtype)
        b = self._flat(buf, view)
        self.comm.recv(b.data.ptr, b.size, nd, src, self._stream())
        return buf


class _GPUDispatch:
    """What ``MPIGroup._gpu_impl()`` returns: routes each call to NCCL or host staging."""

    def __init__(self, group, nccl_backend, host):
        self.nccl = nccl_backend
        self.host = host
        self.main = nccl_backend or host

    def __getattr__(self, name):
        return getattr(self.main, name)

    def send(self, x, dst, tag):
        return self.main.send(x, dst, tag)

    def recv(self, shape, dtype, src, tag, out):
        return self.main.recv(shape, dtype, src, tag, out)

    def sendrecv(self, x, dst, src, shape, out):  # host staging on either backend
        return self.host.sendrecv(x, dst, src, shape, out)


def _device_key():
    cp = _cupy()
    dev = cp.cuda.Device()
    try:
        bus = dev.pci_bus_id
    except Exception:
        bus = str(dev.id)
    return (socket.gethostname(), bus)


def make_gpu_backend(group, collective: bool = True):
    """Pick NCCL or host staging for ``group`` (collective over the group when ``collective``)."""
    host = HostStaged(group)
    choice = os.environ.get("DISTTENSOR_BACKEND", "").strip().lower()
    if choice == "mpi" or not collective:
        return _GPUDispatch(group, None, host)
    nccl = None
    try:
        from cupy.cuda import nccl as _nccl  # noqa: F401

        nccl = _nccl
        key = _device_key()
        ok = bool(nccl.get_version())
    except Exception:
        key, ok = None, False
    infos = group.comm.allgather((ok, key))
    usable = all(o for o, _ in infos) and len({k for _, k in infos}) == len(infos)
    if choice == "nccl" and not usable:
        raise RuntimeError(
            "DISTTENSOR_BACKEND=nccl but NCCL cannot serve this group "
            f"(per rank (nccl importable, (host, GPU)): {infos})"
        )
    if not usable:
        return _GPUDispatch(group, None, host)
    return _GPUDispatch(group, NCCLBackend(group, nccl, host), host)
