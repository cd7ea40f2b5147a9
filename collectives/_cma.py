"""Single-copy transfers between the processes of one node by Linux cross-memory attach.

``process_vm_writev`` copies a list of local pieces (the strided rows a rank sends) straight
into a contiguous region of another process, in one pass. MPICH uses the same mechanism (its
CMA path) for contiguous messages only: a strided side goes through its pack pipeline, or
through our own pack, so a second pass over the data. The strided side is kept local: the
kernel pins the remote side page by page per piece (``process_vm_readv`` of 2-4 KB strided
rows from the peer ran 1.4-2.7x slower than writing them from a local strided source, 4 MB, 2
ranks). Availability is decided once per communicator, collectively: every member on this
node and one probing write between neighbours succeeds (it fails where ptrace is forbidden).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import numpy as np

#: iovecs per process_vm_writev call (Linux's UIO_MAXIOV)
IOV_MAX = 1024


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _writev():
    """libc's ``process_vm_writev``, or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_writev
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


class CrossMemory:
    """Writes into the memory of the other members of an MPI communicator (``pids`` in
    communicator-rank order)."""

    def __init__(self, pids: list, writev):
        self.pids, self._writev = pids, writev
        self._remote = _IOVec()

    @classmethod
    def probe(cls, comm) -> Optional["CrossMemory"]:
        """Collective over ``comm``: a ``CrossMemory`` on every member, or None on every
        member (not all on one node, no ``process_vm_writev``, or a probing write failed)."""
        from mpi4py import MPI

        n, me = comm.Get_size(), comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_size() == n
        node.Free()
        writev = _writev() if local else None
        box = np.zeros(1, np.int64)
        pids = comm.allgather((os.getpid(), box.ctypes.data))
        ok = writev is not None and n > 1
        if ok:
            cm = cls([p for p, _ in pids], writev)
            peer = (me + 1) % n
            word = np.array([me + 1], np.int64)
            try:
                cm.write(peer, np.array([[word.ctypes.data, 8]], np.uint64), pids[peer][1])
            except OSError:
                ok = False
        comm.Barrier()  # every probing write has landed (or failed)
        ok = ok and int(box[0]) == (me - 1) % n + 1
        if not comm.allreduce(int(ok), op=MPI.MIN):
            return None
        return cm

    def write(self, peer: int, runs: np.ndarray, remote: int) -> None:
        """Copy the local pieces ``runs`` (a C-contiguous uint64 array of (address, length)
        rows) one after another into ``peer``'s memory from address ``remote``; raises
        OSError naming the peer when the kernel refuses."""
        k, done = len(runs), 0
        base = runs.ctypes.data
        for a in range(0, k, IOV_MAX):
            m = min(IOV_MAX, k - a)
            want = int(runs[a:a + m, 1].sum())
            self._remote.base, self._remote.len = remote + done, want
            got = self._writev(self.pids[peer], base + a * 16, m, ctypes.byref(self._remote), 1, 0)
            if got != want:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_writev to rank {peer} (pid {self.pids[peer]}) "
                                   f"wrote {got} of {want} bytes: {os.strerror(err)}")
            done += want
