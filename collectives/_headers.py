"""Collective headers: ranks in different collectives never pair.

MPI matches the collectives of one communicator in the order each rank issues them. Two ranks
that issue different calls at the same point (one rank's stray ``Tensor.numpy()`` against the
others' next step) get paired by MPI when the calls use the same communicator, and exchange
wrong data. So before every collective a rank posts a 64-bit header for it, and enters MPI only
once every member of the group has posted the same header for the same call:

- ``seq``: the call's index on the group (per-group sequence number, 24 low bits);
- ``kind``: the collective and its reduce op (:data:`KINDS`);
- ``nbytes``: a byte count every member agrees on (the buffer of an all-reduce, one slice of an
  all-gather, the itemsize of a sendrecv; 0 for a barrier), 34 low bits.

Headers live in a small table that every member maps (a memfd of ``SLOTS`` rows, one 8-byte word
per member and row; row ``seq % SLOTS``): posting is one store, checking reads the row once
(about 0.3 µs on a quiet core, ``benchmarks/collectives.py``).
Since no rank passes call ``seq`` before every member has posted it, a member is at most one
call ahead, and rows are never overwritten while read. A member whose word in the row holds the
same ``seq`` with another header is in another collective: every member sees the difference
before any data moves. A member that has not posted yet is waited for (under the watchdog).

Groups whose members are not all on one node, or where mapping a peer's memfd is not allowed,
have no table (:func:`open_board` returns None): their mismatches are found by the watchdog's
probes only.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Optional

from ._common import REDUCE_OPS

SLOTS = 4  # a power of two: the row is ``seq & (SLOTS - 1)``
SEQ_BITS, KIND_BITS, BYTE_BITS = 24, 6, 34
SEQ_SHIFT = KIND_BITS + BYTE_BITS
SEQ_MASK, BYTE_MASK = (1 << SEQ_BITS) - 1, (1 << BYTE_BITS) - 1

#: header kind codes (from 1: an unwritten word, 0, is never a header)
KINDS: dict[tuple, int] = {}
for _name in ("all_reduce", "iall_reduce", "reduce_scatter"):
    for _op in REDUCE_OPS:
        KINDS[(_name, _op)] = len(KINDS) + 1
for _name in ("all_gather", "all_to_all", "broadcast", "sendrecv", "barrier", "exchange_metadata"):
    KINDS[(_name, None)] = len(KINDS) + 1
_NAMES = {code: key for key, code in KINDS.items()}


def header(name: str, op: Optional[str], nbytes: int) -> int:
    """The header of a call, without its sequence number (``| seq << SEQ_SHIFT`` adds it)."""
    return KINDS[(name, op)] << BYTE_BITS | (int(nbytes) & BYTE_MASK)


def with_seq(base: int, seq: int) -> int:
    return base | (seq & SEQ_MASK) << SEQ_SHIFT


def decode(h: int) -> str:
    """``all_reduce(sum) of 8 bytes as call #4`` (the call number modulo 2**24)."""
    name, op = _NAMES.get(h >> BYTE_BITS & ((1 << KIND_BITS) - 1), ("?", None))
    what = f"{name}({op})" if op else name
    return f"{what} of {h & BYTE_MASK} bytes as call #{h >> SEQ_SHIFT}"


class Board:
    """The header table of one group, mapped by every member (see the module docstring).

    ``rows[seq % SLOTS]`` holds every member's header word for call ``seq``. The collective's
    fast path (``ProcessGroup._begin``) posts into the row itself and counts the words equal to
    its own; only when some differ does it call :meth:`wait`."""

    __slots__ = ("rows", "size", "rank", "_map", "_words")

    def __init__(self, buf: mmap.mmap, size: int, rank: int):
        self._map = buf
        self._words = memoryview(buf).cast("Q")
        self.rows = [self._words[s * size:(s + 1) * size] for s in range(SLOTS)]
        self.size, self.rank = size, rank

    def wait(self, row: memoryview, h: int) -> Optional[list]:
        """Wait until every member has posted header ``h`` (posted already by this rank) in
        ``row``: None then, or the row's words as soon as a member posted this call's sequence
        number with another header (the caller raises)."""
        seq = h >> SEQ_SHIFT
        t0 = time.monotonic()
        while True:
            words = row.tolist()
            if words.count(h) == self.size:
                return None
            if any(w and w != h and w >> SEQ_SHIFT == seq for w in words):
                return words
            if time.monotonic() - t0 < 0.05:
                os.sched_yield()  # (GIL released: the watchdog runs meanwhile)
            else:
                time.sleep(0.001)

    def close(self) -> None:
        for r in self.rows:
            r.release()
        self._words.release()
        self._map.close()


def open_board(comm) -> Optional[Board]:
    """Collective over ``comm`` (an mpi4py communicator): the group's header table, or None
    where its members cannot share one (not all on one node, no memfd, mapping refused)."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size() == size
    node.Free()
    nbytes = SLOTS * size * 8
    fd, buf = -1, None
    if local and rank == 0 and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create("disttensor-headers", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        except OSError:
            fd = -1
    where = comm.bcast((os.getpid(), fd) if rank == 0 else None, root=0)
    if local and where[1] >= 0:
        try:
            if rank == 0:
                buf = mmap.mmap(fd, nbytes)
            else:
                peer = os.open(f"/proc/{where[0]}/fd/{where[1]}", os.O_RDWR)
                try:
                    buf = mmap.mmap(peer, nbytes)
                finally:
                    os.close(peer)
        except OSError:
            buf = None
    ok = comm.allreduce(int(buf is not None), op=MPI.MIN)  # (rank 0's fd stays open till here)
    if fd >= 0:
        os.close(fd)
    if not ok:
        if buf is not None:
            buf.close()
        return None
    return Board(buf, size, rank)
