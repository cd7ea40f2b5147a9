"""all_to_all over MPI: where every piece sits (``_a2a_layout``), the packing paths and, for
S(0) -> S(1) from ``SHARED_MIN_BYTES`` on, senders writing straight into their receivers' results
(``collectives/_shared.py``). ``AllToAll`` is a part of ``MPIGroup`` (``_mpi``)."""
from __future__ import annotations

import os
from functools import lru_cache
from math import prod
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from . import _common as C
from . import _mpi_types as MT
from ._mpi_types import _back, _chunks, _front, mpi_type

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


class AllToAll:
    """The all_to_all methods of ``MPIGroup`` (which gives ``size``, ``rank``, ``_a2a_comm``
    and ``_shared``)."""

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
        if not MT.NATIVE_LARGE_COUNT:
            # every rank must pick the same algorithm, and only this rank sees its own counts
            mine = max(sum(L.scounts), sum(L.rcounts)) > MT.MAX_COUNT
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
