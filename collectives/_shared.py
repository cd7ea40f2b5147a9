"""Results that the other processes of one node write into directly.

S(0) -> S(1)'s all_to_all sends each receiver strided rows that land contiguously in its
result. The bare Alltoall of contiguous pieces moves each byte once (MPICH copies it across
processes in the kernel); packing first moves it twice. Here a rank's result lives in a memfd
segment that every member of the communicator maps, and each sender copies its strided rows
straight into it: one pass, in user space. The copy streams (non-temporal stores, numba where
installed): rows of a few KB copied with ordinary stores cost about 1.25x one contiguous copy,
since each destination line is read before it is written; streaming stores skip that read.

Segments are pooled per communicator, like a caching allocator: a result's segment returns to
the pool when the last view of the result dies and is reused for the next result that fits, so
its pages are faulted in once in every process that maps it. Free segments are kept while the
segments this process owns total at most ``POOL_BYTES``; past that a segment is closed when its
result dies. A process keeps at most ``POOL_BYTES`` per peer of other processes' segments
mapped (least recently used first out); a mapping names its segment by descriptor and serial
number, so a closed segment is never mistaken for a later one. The pages are shared mappings:
a process forked while such a result lives shares them with its parent instead of copying on
write (disttensor forks nothing).

Availability is decided once per communicator, collectively: every member on this node,
``memfd_create`` present, and one probing write between neighbours through such a mapping
succeeds (opening another process's ``/proc/<pid>/fd`` needs the same user and may be forbidden).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections import OrderedDict
from math import prod
from typing import Optional

import numpy as np

#: bytes of its own segments (live and free) past which a process closes dead results'
#: segments; it maps at most this much of each peer's
POOL_BYTES = 1 << 28


class _Segment:
    __slots__ = ("fd", "serial", "nbytes", "map", "addr")

    def __init__(self, fd: int, serial: int, nbytes: int):
        self.fd, self.serial, self.nbytes = fd, serial, nbytes
        self.map = mmap.mmap(fd, nbytes)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    @property
    def token(self) -> tuple:
        return (self.fd, self.serial, self.nbytes)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class _Block:
    """The array interface of one result in a segment: the result's base, so the segment
    returns to the pool when the last view of the result dies."""

    def __init__(self, seg: _Segment, shape: tuple, dtype: np.dtype):
        self.seg = seg
        self.__array_interface__ = dict(shape=shape, typestr=dtype.str, data=(seg.addr, False),
                                        version=3)


class SharedResults:
    """The result segments of one process in an MPI communicator, and its mappings of the
    other members' (``pids`` in communicator-rank order)."""

    def __init__(self, pids: list):
        self.pids = pids
        self._free: list = []
        self._owned = 0
        self._serial = 0
        self._mapped: OrderedDict = OrderedDict()  # (rank, fd) -> (serial, uint8 array)
        self._mapped_bytes = 0

    @classmethod
    def probe(cls, comm) -> Optional["SharedResults"]:
        """Collective over ``comm``: a ``SharedResults`` on every member, or None on every
        member (not all on one node, no ``memfd_create``, or a probing write failed)."""
        from mpi4py import MPI

        n, me = comm.Get_size(), comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        ok = node.Get_size() == n and n > 1 and hasattr(os, "memfd_create")
        node.Free()
        pool = seg = None
        if ok:
            try:
                pool = cls([])
                seg = pool._segment(mmap.PAGESIZE)
            except OSError:
                ok = False
        pids = comm.allgather((os.getpid(), seg.token if seg else None))
        peer = (me + 1) % n
        if ok and pids[peer][1] is not None:
            pool.pids = [p for p, _ in pids]
            try:
                pool.peer(peer, pids[peer][1])[:8] = np.array([me + 1], np.int64).view(np.uint8)
            except OSError:
                ok = False
        comm.Barrier()  # every probing write has landed (or failed)
        ok = ok and pids[peer][1] is not None and \
            int(np.frombuffer(seg.map, np.int64, 1)[0]) == (me - 1) % n + 1
        if seg is not None:  # the probe's segment and mapping are not kept
            pool._mapped.clear()
            pool._mapped_bytes = 0
            pool._close(seg)
        if not comm.allreduce(int(ok), op=MPI.MIN):
            return None
        return pool

    def result(self, shape: tuple, dtype: np.dtype) -> tuple:
        """(a C-contiguous array of ``shape`` in a segment of this process, the segment's token
        for ``peer``); the segment is reused once every view of the array is gone."""
        want = prod(shape) * np.dtype(dtype).itemsize
        nbytes = max(1, -(-want // mmap.PAGESIZE)) * mmap.PAGESIZE
        fits = [s for s in list(self._free) if nbytes <= s.nbytes <= 2 * nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.nbytes)
            self._free.remove(seg)
        else:
            seg = self._segment(nbytes)
        block = _Block(seg, tuple(shape), np.dtype(dtype))
        weakref.finalize(block, self._release, seg).atexit = False
        return np.asarray(block), seg.token

    def peer(self, rank: int, token: tuple) -> np.ndarray:
        """Member ``rank``'s segment named by ``token`` as a writable uint8 array (mapped once
        and kept)."""
        fd, serial, nbytes = token
        key = (rank, fd)
        hit = self._mapped.get(key)
        if hit is not None and hit[0] == serial:
            self._mapped.move_to_end(key)
            return hit[1]
        if hit is not None:
            self._drop(key)
        room = POOL_BYTES * max(1, len(self.pids) - 1)  # each peer's own bound
        while self._mapped and self._mapped_bytes + nbytes > room:
            self._drop(next(iter(self._mapped)))
        path = f"/proc/{self.pids[rank]}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDWR)
        except OSError as e:
            raise OSError(e.errno, f"cannot map the result segment of group member {rank} "
                                   f"({path}): {e.strerror}") from e
        try:
            arr = np.frombuffer(mmap.mmap(f, nbytes), np.uint8)
        finally:
            os.close(f)
        self._mapped[key] = (serial, arr)
        self._mapped_bytes += nbytes
        return arr

    def _drop(self, key) -> None:
        self._mapped_bytes -= self._mapped.pop(key)[1].nbytes

    def _segment(self, nbytes: int) -> _Segment:
        while self._free and self._owned + nbytes > POOL_BYTES:
            self._close(self._free.pop(0))
        fd = os.memfd_create("disttensor-result", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self._serial += 1
            seg = _Segment(fd, self._serial, nbytes)
        except OSError:
            os.close(fd)
            raise
        self._owned += nbytes
        return seg

    def _release(self, seg: _Segment) -> None:
        if self._owned <= POOL_BYTES:
            self._free.append(seg)
        else:
            self._close(seg)

    def _close(self, seg: _Segment) -> None:
        self._owned -= seg.nbytes
        seg.close()


def copy_rows(dst: np.ndarray, dpos: int, src: np.ndarray, spos: int, rows: int, run: int,
              stride: int) -> None:
    """``rows`` runs of ``run`` bytes, ``stride`` bytes apart in the uint8 array ``src`` from
    byte ``spos``, copied one after another into the uint8 array ``dst`` (16-byte aligned, as
    segments are) from byte ``dpos``; streaming stores where numba is installed."""
    if rows and run:
        _stream_rows()(dst, dpos, src, spos, rows, run, stride)


_kernel: list = []


def _stream_rows():
    """The copy kernel: numba's streaming loop where numba imports, else numpy's copy."""
    if not _kernel:
        try:
            from ._stream import stream_rows
        except ImportError:
            stream_rows = _numpy_rows
        _kernel.append(stream_rows)
    return _kernel[0]


def _numpy_rows(dst, dpos, src, spos, rows, run, stride):
    runs = np.lib.stride_tricks.as_strided(src[spos:], (rows, run), (stride, 1))
    np.copyto(dst[dpos:dpos + rows * run].reshape(rows, run), runs)
