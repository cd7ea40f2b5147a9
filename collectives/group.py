"""ProcessGroup: argument checks, counting and debug agreement, shared by every backend.

A subclass implements the underscore methods (``_all_reduce`` ...) on arrays whose metadata has
already been validated. ``LocalGroup`` is the single-process group used when the program was not
started under MPI.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict, deque
from math import prod
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import _common as C
from ._headers import SEQ_MASK, SEQ_SHIFT, SLOTS, header
from .failure import Watch

_BARRIER_HEADER, _META_HEADER = header("barrier", None, 0), header("exchange_metadata", None, 0)
_PREPARABLE = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
_monotonic = time.monotonic
_getframe = sys._getframe

#: one-shot callbacks run just before the next collective or point-to-point call this process
#: issues (``before_next_collective``)
_before_next: list[Callable[[], None]] = []


def before_next_collective(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once, just before the next collective (or send/recv) this process issues
    on any group, before that call is counted or posted; ``fn`` may issue collectives itself
    and may raise (the call is then not made). disttensor completes its deferred data checks
    there."""
    if fn not in _before_next:
        _before_next.append(fn)


def cancel_before_next_collective(fn: Callable[[], None]) -> None:
    """Forget ``fn`` registered by :func:`before_next_collective` (no-op if it is not)."""
    if fn in _before_next:
        _before_next.remove(fn)


def _run_before_next() -> None:
    fns = _before_next[:]
    _before_next.clear()
    for fn in fns:
        fn()


class ProcessGroup:
    """A set of processes that run collectives together.

    Attributes: ``rank`` (this process's rank in the group), ``size``, ``ranks`` (global ranks, in
    group-rank order: group rank i is ``ranks[i]``).
    """

    backend_name = "abstract"
    _comm_errors: tuple = ()  # the backend's communication errors (MPI.Exception)

    def __init__(self, ranks: Sequence[int], rank: int):
        self.ranks = tuple(int(r) for r in ranks)
        self.size = len(self.ranks)
        self.rank = int(rank)
        self._call_index = 0  # collective calls issued on this group (debug-mode agreement)
        self._self_queue: dict[int, deque] = defaultdict(deque)  # send/recv to oneself
        self._board = None  # the group's header table (``_headers.Board``), where there is one

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, ranks={self.ranks})"

    # ----------------------------------------------------------------------------------------
    # debug-mode agreement
    # ----------------------------------------------------------------------------------------

    def _begin(self, name: str, sig: tuple, head: int, depth: int = 2,
               counted: str | None = None) -> int:
        """Called after local checks, before communication, for every collective: tells the
        watchdog what is in flight (``sig``: the call's metadata as (name, value) pairs; the
        caller clears ``Watch.now`` once the call returns; ``depth``: frames from here to the
        user's call), waits until every member has posted the same header (``head``, from
        ``_headers.header``) for this call, runs the debug-mode agreement check and counts the
        call (as ``counted``, default ``name``). Returns the call's index on this group."""
        if _before_next:
            _run_before_next()
        index = self._call_index
        self._call_index = index + 1
        Watch.now = (self, name, sig, index, _monotonic(), _getframe(depth))
        board = self._board
        if board is not None:  # post this call's header; wait for the members' (``_headers``)
            h = head | (index & SEQ_MASK) << SEQ_SHIFT
            row = board.rows[index & (SLOTS - 1)]
            row[board.rank] = h
            if row.tolist().count(h) != board.size and board.wait(row, h) is not None:
                self._header_mismatch(row, h)
        if C.CHECK_COLLECTIVES and self.size > 1:
            try:
                self._check_agreement(name, index, sig)
            except BaseException:
                Watch.now = None
                raise
        if counted != "":  # ("": not counted, as the runtime's own metadata exchanges)
            C.count(counted or name)
        return index

    def _header_mismatch(self, row, h: int) -> None:
        """Raise, on every member that sees it, the error for members that posted other
        headers for this call (their call sites come over the failure channel)."""
        from .failure import mismatch_error
        try:
            raise mismatch_error(self, Watch.now, row, h)
        finally:
            Watch.now = None

    def _check_agreement(self, name: str, index: int, sig: tuple) -> None:
        records = self._allgather_obj((name, index, sig))
        if any(r != records[0] for r in records):
            lines = [
                f"  group rank {i} (global rank {self.ranks[i]}): {r[0]} call #{r[1]} "
                + ", ".join(f"{k}={v}" for k, v in r[2])
                for i, r in enumerate(records)
            ]
            raise C.CollectiveMismatchError(
                f"collective mismatch in group {self.ranks} (DISTTENSOR_CHECK_COLLECTIVES=1): "
                f"ranks disagree on the collective, its call index or its arguments:\n"
                + "\n".join(lines)
            )

    def _comm_failed(self, e: Exception) -> Exception:
        """The error to raise when the backend fails inside the collective in flight: ranks
        that call different collectives on one communicator (a size mismatch) end up here."""
        from .failure import call_site, describe
        cur = Watch.now
        what = "a collective" if cur is None else describe(cur[1], cur[2], cur[3], self.ranks)
        site = "?" if cur is None else call_site(cur[5])
        return C.CollectiveMismatchError(
            f"{what}, called from {site}, failed in the communication library ({e}): the ranks "
            f"of group {list(self.ranks)} most likely called different collectives here, or one "
            f"rank called a collective the others did not")

    def _allgather_obj(self, obj: Any) -> list:  # pragma: no cover - overridden
        return [obj]

    def _exchange_obj(self, obj: Any) -> list:  # pragma: no cover - overridden
        return [obj]

    # ----------------------------------------------------------------------------------------
    # public API
    # ----------------------------------------------------------------------------------------

    def all_reduce(self, x, op: Any = "sum", *, out=None):
        """Elementwise reduction over the group; every rank gets the result (a new array)."""
        if type(x) is not np.ndarray:
            x = C.as_array(x, "all_reduce", "x")
        return self._call("all_reduce", x, *self._check_all_reduce(x, op, out), out)

    def _check_all_reduce(self, x, op="sum", out=None):
        op = C.reduce_op(op, x.dtype, "all_reduce", x.shape)
        if out is not None:
            C.check_out(out, x.shape, x.dtype, "all_reduce", C.is_cupy(x))
        return (op,), (("shape", tuple(x.shape)), ("dtype", x.dtype.str), ("op", op)), x.shape, \
            header("all_reduce", op, x.nbytes)

    def iall_reduce(self, x, op: Any = "sum") -> "PendingAllReduce":
        """Start an all-reduce of ``x`` *in place* and return at once (MPI_Iallreduce): the
        handle's ``wait()`` returns ``x`` holding what :meth:`all_reduce` would return.

        ``x`` must be a C-contiguous writable array that nobody reads or writes until
        ``wait()``. Every rank issues its collectives on a group in the same order, blocking
        and nonblocking alike (a nonblocking call does not match a blocking one: ranks that mix
        them block and the watchdog reports them). Counted as an ``all_reduce``. Like every
        collective, the start waits until every member has posted the same call's header
        (``_headers``), so it returns once every member has started it; the watchdog watches
        that and the ``wait()``."""
        name = "iall_reduce"
        if type(x) is not np.ndarray:
            x = C.as_array(x, name, "x")
        op = C.reduce_op(op, x.dtype, name, x.shape)
        if not x.flags.c_contiguous or (not C.is_cupy(x) and not x.flags.writeable):
            raise ValueError(f"{name}: argument 'x' ({C.describe(x)}) must be C-contiguous and "
                             f"writable (it receives the result in place)")
        sig = (("shape", tuple(x.shape)), ("dtype", x.dtype.str), ("op", op))
        index = self._begin(name, sig, header(name, op, x.nbytes), counted="all_reduce")
        try:
            req, finish = self._iall_reduce(x, op)
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        finally:
            Watch.now = None
        return PendingAllReduce(self, sig, index, x, req, finish)

    def all_gather(self, x, axis: int = 0, sizes: Optional[Sequence[int]] = None, *, out=None):
        """Concatenate every rank's ``x`` along ``axis`` in group-rank order.

        Sizes along ``axis`` may differ per rank (0 included); other dims must agree. ``sizes``
        (every rank's size along ``axis``) skips the size exchange when the caller knows them.
        """
        if type(x) is not np.ndarray:
            x = C.as_array(x, "all_gather", "x")
        return self._call("all_gather", x, *self._check_all_gather(x, axis, sizes, out), out)

    def _check_all_gather(self, x, axis=0, sizes=None, out=None):
        name = "all_gather"
        axis = C.norm_axis(axis, x.ndim, name, "axis", x.shape)
        sizes = C.check_sizes(sizes, self.size, name, "sizes", None, x.shape)
        if sizes is not None and sizes[self.rank] != x.shape[axis]:
            raise ValueError(
                f"{name}: argument 'sizes'={sizes} says group rank {self.rank} has "
                f"{sizes[self.rank]} along axis {axis} but x has shape={tuple(x.shape)}"
            )
        shp = None
        if sizes is not None:
            shp = list(x.shape)
            shp[axis] = sum(sizes)
        if out is not None:
            if sizes is None:
                raise ValueError(f"{name}: argument 'out' needs 'sizes' to be given")
            C.check_out(out, shp, x.dtype, name, C.is_cupy(x))
        other = x.shape[:axis] + (None,) + x.shape[axis + 1:]
        return (axis, sizes), (("shape(except axis)", other), ("dtype", x.dtype.str),
                               ("axis", axis),
                               ("sizes", None if sizes is None else tuple(sizes))), \
            shp, header(name, None, x.itemsize * prod(x.shape[:axis] + x.shape[axis + 1:]))

    def reduce_scatter(self, x, op: Any = "sum", axis: int = 0,
                       sizes: Optional[Sequence[int]] = None, *, out=None):
        """Reduce equal-shaped ``x`` across ranks; rank i gets piece i of the split along ``axis``
        (``numpy.array_split`` sizes, or ``sizes``)."""
        if type(x) is not np.ndarray:
            x = C.as_array(x, "reduce_scatter", "x")
        return self._call("reduce_scatter", x,
                          *self._check_reduce_scatter(x, op, axis, sizes, out), out)

    def _check_reduce_scatter(self, x, op="sum", axis=0, sizes=None, out=None):
        name = "reduce_scatter"
        op = C.reduce_op(op, x.dtype, name, x.shape)
        axis = C.norm_axis(axis, x.ndim, name, "axis", x.shape)
        if sizes is None:
            sizes = C.split_sizes(x.shape[axis], self.size)
        else:
            sizes = C.check_sizes(sizes, self.size, name, "sizes", x.shape[axis], x.shape)
        shp = list(x.shape)
        shp[axis] = sizes[self.rank]
        if out is not None:
            C.check_out(out, shp, x.dtype, name, C.is_cupy(x))
        return (op, axis, sizes), (("shape", tuple(x.shape)), ("dtype", x.dtype.str), ("op", op),
                                   ("axis", axis), ("sizes", tuple(sizes))), shp, \
            header(name, op, x.nbytes)

    def all_to_all(self, x, split_axis: int, concat_axis: int,
                   split_sizes: Optional[Sequence[int]] = None,
                   recv_sizes: Optional[Sequence[int]] = None, *, out=None):
        """Split ``x`` along ``split_axis`` into ``size`` pieces (array_split or ``split_sizes``),
        send piece j to rank j, concatenate what arrives along ``concat_axis`` in source order.

        ``recv_sizes[s]`` is the size along ``concat_axis`` of the piece coming from source s;
        without it the sizes are exchanged with a small all-to-all of ints.
        """
        if type(x) is not np.ndarray:
            x = C.as_array(x, "all_to_all", "x")
        return self._call("all_to_all", x, *self._check_all_to_all(
            x, split_axis, concat_axis, split_sizes, recv_sizes, out), out)

    def _check_all_to_all(self, x, split_axis, concat_axis, split_sizes=None, recv_sizes=None,
                          out=None):
        name = "all_to_all"
        s = C.norm_axis(split_axis, x.ndim, name, "split_axis", x.shape)
        c = C.norm_axis(concat_axis, x.ndim, name, "concat_axis", x.shape)
        if split_sizes is None:
            ssizes = C.split_sizes(x.shape[s], self.size)
        else:
            ssizes = C.check_sizes(split_sizes, self.size, name, "split_sizes", x.shape[s], x.shape)
        rsizes = C.check_sizes(recv_sizes, self.size, name, "recv_sizes", None, x.shape)
        shp = None if rsizes is None else self._a2a_result_shape(x.shape, s, c, ssizes, rsizes)
        if out is not None:
            if rsizes is None:
                raise ValueError(f"{name}: argument 'out' needs 'recv_sizes' to be given")
            C.check_out(out, shp, x.dtype, name, C.is_cupy(x))
        other = tuple(None if i in (s, c) else d for i, d in enumerate(x.shape))
        return (s, c, ssizes, rsizes), (("shape(except split/concat)", other),
                                        ("dtype", x.dtype.str),
                                        ("split_axis", s), ("concat_axis", c)), shp, \
            header(name, None, x.itemsize * prod(d for d in other if d is not None))

    def _call(self, name: str, x, args: tuple, sig: tuple, result_shape, head: int, out):
        """Run the backend's ``_<name>`` on checked arguments, with the bookkeeping of every
        collective (watchdog, header, debug agreement, count)."""
        self._begin(name, sig, head, 3)
        try:
            return getattr(self, "_" + name)(x, *args, out)
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        finally:
            Watch.now = None

    def prepare(self, name: str, shape: Sequence[int], dtype: Any, **kwargs) -> Callable:
        """``fn(x, out=None)`` running collective ``name`` (all_reduce, all_gather,
        reduce_scatter, all_to_all or sendrecv) with ``kwargs`` on numpy arrays of ``shape`` and
        ``dtype``: arguments are checked and resolved here, once, so a call only does the
        bookkeeping of every collective (count, debug agreement, watchdog) and the
        communication. Any other ``x`` (or an ``out`` the checks cannot foresee) takes the
        general path, ``getattr(group, name)(x, **kwargs, out=out)``."""
        if name not in _PREPARABLE:
            raise ValueError(f"prepare: collective {name!r} is not one of {list(_PREPARABLE)}")
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        meta = np.broadcast_to(np.empty((), dtype), shape)  # metadata only: no data
        args, sig, result_shape, head = getattr(self, "_check_" + name)(meta, out=None, **kwargs)
        run = self._prepared(name, shape, dtype, args)
        general = getattr(self, name)

        def call(x, out=None):
            if type(x) is not np.ndarray or x.shape != shape or x.dtype != dtype or (
                    out is not None and result_shape is None):
                return general(x, **kwargs, out=out)
            if out is not None:
                C.check_out(out, result_shape, dtype, name, False)
            self._begin(name, sig, head)
            try:
                return run(x, out)
            except self._comm_errors as e:
                raise self._comm_failed(e) from e
            finally:
                Watch.now = None
        return call

    def _prepared(self, name: str, shape: tuple, dtype: np.dtype, args: tuple) -> Callable:
        """The backend's ``fn(x, out)`` for ``prepare`` (numpy ``x`` of ``shape``/``dtype``,
        ``args`` as checked); backends override it to resolve more up front."""
        impl = getattr(self, "_" + name)
        return lambda x, out: impl(x, *args, out)

    def broadcast(self, x, src: int = 0, *, out=None):
        """Return ``src``'s array on every rank. Non-src ranks pass an array of the same
        shape and dtype (its content is ignored)."""
        name = "broadcast"
        x = C.as_array(x, name, "x")
        src = C.check_peer(src, self.size, name, "src")
        C.check_out(out, x.shape, x.dtype, name, C.is_cupy(x))
        self._begin(name, (("shape", tuple(x.shape)), ("dtype", x.dtype.str), ("src", src)),
                    header(name, None, x.nbytes))
        try:
            return self._broadcast(x, src, out)
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        finally:
            Watch.now = None

    def send(self, x, dst: int, tag: int = 0) -> None:
        """Blocking send of ``x`` to group rank ``dst``."""
        name = "send"
        if _before_next:
            _run_before_next()
        x = C.as_array(x, name, "x")
        dst = C.check_peer(dst, self.size, name, "dst")
        C.count(name)
        if dst == self.rank:
            self._self_queue[int(tag)].append(x.copy())
            return None
        self._send(x, dst, int(tag))

    def recv(self, shape: Sequence[int], dtype: Any, src: int, tag: int = 0, *, like=None,
             out=None):
        """Receive an array of ``shape``/``dtype`` from group rank ``src``. ``like`` (a cupy
        array) asks for a cupy result; ``out`` is a C-contiguous writable buffer to fill."""
        name = "recv"
        if _before_next:
            _run_before_next()
        src = C.check_peer(src, self.size, name, "src")
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        want_cupy = (like is not None and C.is_cupy(like)) or (out is not None and C.is_cupy(out))
        C.check_out(out, shape, dtype, name, want_cupy)
        C.count(name)
        if src == self.rank:
            q = self._self_queue[int(tag)]
            if not q:
                raise RuntimeError(f"{name}: no message from oneself (rank {self.rank}) with tag "
                                   f"{tag} was sent")
            data = q.popleft()
            if tuple(data.shape) != shape or np.dtype(data.dtype) != dtype:
                raise ValueError(f"{name}: message from oneself has {C.describe(data)}, expected "
                                 f"shape={shape} dtype={dtype.name}")
            if out is not None:
                out[...] = data
                return out
            return data
        return self._recv(shape, dtype, src, int(tag), want_cupy, out)

    def isend(self, x, dst: int, tag: int = 0) -> "PendingSend":
        """Start a send of ``x`` to group rank ``dst`` and return at once (MPI_Isend; a cupy
        array is staged through the host); the peer receives it with :meth:`recv` and the same
        ``tag``. Messages of one (sender, tag) arrive in the order sent. Counted as a ``send``;
        the watchdog watches the handle's ``wait()``, where a rank can block."""
        name = "isend"
        if _before_next:
            _run_before_next()
        x = C.as_array(x, name, "x")
        dst = C.check_peer(dst, self.size, name, "dst")
        C.count("send")
        sig = (("shape", tuple(x.shape)), ("dtype", x.dtype.str), ("dst", dst), ("tag", int(tag)))
        if dst == self.rank:
            self._self_queue[int(tag)].append(x.copy())
            return PendingSend(self, sig, [])
        try:
            reqs = self._isend(x, dst, int(tag))
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        return PendingSend(self, sig, reqs)

    def sendrecv(self, x, dst: int, src: Optional[int] = None,
                 recv_shape: Optional[Sequence[int]] = None, *, out=None):
        """Send ``x`` to group rank ``dst`` while receiving from group rank ``src`` (default
        ``dst``) an array of ``recv_shape`` (default ``x.shape``) and x's dtype: the received
        array (new, or ``out``). A collective of the whole group whose (dst, src) pairs form a
        permutation: a pairwise exchange, a ring shift; a rank with dst == src == itself gets a
        copy of ``x``."""
        if type(x) is not np.ndarray:
            x = C.as_array(x, "sendrecv", "x")
        return self._call("sendrecv", x, *self._check_sendrecv(x, dst, src, recv_shape, out), out)

    def _check_sendrecv(self, x, dst, src=None, recv_shape=None, out=None):
        name = "sendrecv"
        dst = C.check_peer(dst, self.size, name, "dst")
        src = dst if src is None else C.check_peer(src, self.size, name, "src")
        if (dst == self.rank) != (src == self.rank):
            raise ValueError(f"{name}: group rank {self.rank} sends to {dst} but receives from "
                             f"{src}; a rank exchanges with itself on both sides or neither")
        shape = tuple(x.shape) if recv_shape is None else tuple(int(d) for d in recv_shape)
        if dst == self.rank and shape != tuple(x.shape):
            raise ValueError(f"{name}: recv_shape={list(shape)} but group rank {self.rank} "
                             f"receives its own x ({C.describe(x)})")
        C.check_out(out, shape, x.dtype, name, C.is_cupy(x))
        return (dst, src, shape), (("dtype", x.dtype.str),), shape, header(name, None, x.itemsize)

    def exchange_metadata(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in group-rank order: the runtime's metadata checks.
        Watched like any collective, but not counted in ``collective_counts()`` (like the size
        exchanges inside all_gather)."""
        self._begin("exchange_metadata", (), _META_HEADER, counted="")
        try:
            return self._exchange_obj(obj)
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        finally:
            Watch.now = None

    def barrier(self) -> None:
        self._begin("barrier", (), _BARRIER_HEADER)
        try:
            self._barrier()
        except self._comm_errors as e:
            raise self._comm_failed(e) from e
        finally:
            Watch.now = None

    # ----------------------------------------------------------------------------------------
    # helpers for subclasses
    # ----------------------------------------------------------------------------------------

    def _a2a_result_shape(self, shape, s, c, ssizes, rsizes):
        shp = list(shape)
        if s != c:
            shp[s] = ssizes[self.rank]
        shp[c] = sum(rsizes)
        return tuple(shp)


class PendingAllReduce:
    """A started :meth:`ProcessGroup.iall_reduce`: ``test()`` lets it progress without
    blocking (True once complete), ``wait()`` completes it (once; later calls return the same
    array) under the watchdog, as a blocking collective would be."""

    __slots__ = ("group", "sig", "index", "x", "_req", "_finish")

    def __init__(self, group: ProcessGroup, sig: tuple, index: int, x, req, finish):
        self.group, self.sig, self.index, self.x = group, sig, index, x
        self._req, self._finish = req, finish  # None, None: complete when started

    def test(self) -> bool:
        req = self._req
        return req is None or req.Test()

    def wait(self):
        req = self._req
        if req is not None:
            g = self.group
            Watch.now = (g, "iall_reduce", self.sig, self.index, _monotonic(), _getframe(1))
            try:
                req.Wait()
            except g._comm_errors as e:
                raise g._comm_failed(e) from e
            finally:
                Watch.now = None
            self._req = None
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self.x


class PendingSend:
    """A started :meth:`ProcessGroup.isend`: ``wait()`` completes it under the watchdog (once;
    the sent buffer is kept alive until then)."""

    __slots__ = ("group", "sig", "_reqs")

    def __init__(self, group: ProcessGroup, sig: tuple, reqs: list):
        self.group, self.sig, self._reqs = group, sig, reqs

    def wait(self) -> None:
        if not self._reqs:
            return
        g = self.group
        Watch.now = (g, "isend", self.sig, g._call_index, _monotonic(), _getframe(1))
        try:
            for req in self._reqs:
                req.Wait()
        except g._comm_errors as e:
            raise g._comm_failed(e) from e
        finally:
            Watch.now = None
        self._reqs = []


def _finish(result, out):
    if out is None:
        return result
    out[...] = result
    return out


class LocalGroup(ProcessGroup):
    """The group of one process: every collective is a local copy."""

    backend_name = "local"

    def __init__(self):
        super().__init__((0,), 0)

    def _all_reduce(self, x, op, out):
        return _finish(x.copy(), out)

    def _iall_reduce(self, x, op):
        return None, None

    def _all_gather(self, x, axis, sizes, out):
        return _finish(x.copy(), out)

    def _reduce_scatter(self, x, op, axis, sizes, out):
        return _finish(x.copy(), out)

    def _all_to_all(self, x, s, c, ssizes, rsizes, out):
        if rsizes is not None:
            expect = ssizes[0] if s == c else x.shape[c]
            if rsizes[0] != expect:
                raise ValueError(f"all_to_all: recv_sizes={rsizes} but this rank sends itself "
                                 f"{expect} along axis {c}")
        return _finish(x.copy(), out)

    def _broadcast(self, x, src, out):
        return _finish(x.copy(), out)

    def _sendrecv(self, x, dst, src, shape, out):
        return _finish(x.copy(), out)

    def _send(self, x, dst, tag):  # pragma: no cover - dst is always self here
        raise AssertionError("unreachable")

    def _recv(self, shape, dtype, src, tag, want_cupy, out):  # pragma: no cover
        raise AssertionError("unreachable")

    def _barrier(self):
        return None
