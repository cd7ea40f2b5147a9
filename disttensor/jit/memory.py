"""Memory planning: worklist liveness over bitsets, and offsets in one arena.

Pure functions over plain data, so they are tested on fixed instances:

* :func:`liveness` — live-in/live-out sets of basic blocks by a worklist (each block revisited
  only when a successor's live-in grew), and :func:`live_ranges` — every value's definition point
  and last use over the instructions in block order. Sets are Python ints used as bitsets over
  value ids. A traced step is one straight-line block; blocks and successors are there for
  programs with control flow.
* :func:`plan_arena` — offsets (multiples of :data:`ALIGN`) for buffers with inclusive live
  ranges ``[first, last]``, such that buffers live at the same time never overlap. It tries
  best-fit in program order (a free-list simulation), greedy by size (Pisarchyk & Lee 2020,
  "offset calculation"), greedy by the peak each buffer spans, greedy by conflicts, greedy by
  randomly perturbed sizes and a hill climb over placement orders (both seeded), and keeps the
  smallest arena; it stops early when one comes within 0.1% of the lower bound (no order can do
  better than the bound).
* :func:`lower_bound` — the most bytes live at one instruction (XLA's NoFragmentation heap size);
  :func:`check_arena` — the verifier: raises naming both buffers when two live at once overlap.
"""
from __future__ import annotations

import bisect
import heapq
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

__all__ = ["ALIGN", "Block", "Buffer", "ArenaPlan", "OverlapError", "liveness", "live_ranges",
           "plan_arena", "lower_bound", "live_bytes", "check_arena", "aligned"]

ALIGN = 64  # bytes: every offset and every buffer size is a multiple


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


# -- liveness ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Block:
    """A basic block: per instruction a ``(uses, defs)`` pair of bitsets over value ids, and the
    indices of the blocks control may pass to next."""

    instrs: list[tuple[int, int]]
    succs: tuple[int, ...] = ()


def liveness(blocks: Sequence[Block]) -> tuple[list[int], list[int]]:
    """``(live_in, live_out)`` bitsets per block: the least fixed point of
    ``out[b] = OR in[s] for s in succs[b]`` and ``in[b] = gen[b] | (out[b] & ~kill[b])``, found
    with a worklist (a block is revisited only when one of its successors' live-in changed)."""
    n = len(blocks)
    gen, kill = [0] * n, [0] * n
    preds: list[list[int]] = [[] for _ in range(n)]
    for b, block in enumerate(blocks):
        g = k = 0
        for uses, defs in block.instrs:
            g |= uses & ~k
            k |= defs
        gen[b], kill[b] = g, k
        for s in block.succs:
            preds[s].append(b)
    live_in, live_out = [0] * n, [0] * n
    work = list(range(n))          # a stack: later blocks first, as liveness flows backwards
    queued = [True] * n
    while work:
        b = work.pop()
        queued[b] = False
        out = 0
        for s in blocks[b].succs:
            out |= live_in[s]
        live_out[b] = out
        new_in = gen[b] | (out & ~kill[b])
        if new_in != live_in[b]:
            live_in[b] = new_in
            for p in preds[b]:
                if not queued[p]:
                    queued[p] = True
                    work.append(p)
    return live_in, live_out


def _bits(x: int):
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def live_ranges(blocks: Sequence[Block], n_values: int) -> tuple[list[int], list[int]]:
    """``(first, last)`` per value id over the instructions numbered in block order: ``first``
    the instruction defining it (-1: never defined, a program input), ``last`` its last use
    (a value live out of a block lives to that block's last instruction; a value never used dies
    where it is defined; -1: neither defined nor used)."""
    live_in, live_out = liveness(blocks)
    first, last = [-1] * n_values, [-1] * n_values
    start = 0
    for b, block in enumerate(blocks):
        end = start + len(block.instrs) - 1
        for v in _bits(live_out[b]):
            last[v] = max(last[v], end)
        live = live_out[b]
        for k in range(len(block.instrs) - 1, -1, -1):
            uses, defs = block.instrs[k]
            idx = start + k
            for v in _bits(uses & ~live):  # not live after k: k is its last use here
                if last[v] < idx:
                    last[v] = idx
            live = (live & ~defs) | uses
        for k, (_, defs) in enumerate(block.instrs):
            for v in _bits(defs):
                if first[v] == -1:
                    first[v] = start + k
                    if last[v] < start + k:
                        last[v] = start + k
        start = end + 1
    return first, last


# -- the arena --------------------------------------------------------------------------------

@dataclass(slots=True)
class Buffer:
    """One block of the arena: ``size`` bytes (aligned) live over ``[first, last]``."""

    id: int
    size: int
    first: int
    last: int
    name: str = ""


@dataclass
class ArenaPlan:
    """Offsets per buffer id, the arena size, and how it was chosen."""

    offsets: dict[int, int]
    size: int
    strategy: str
    lower_bound: int
    no_reuse: int
    tried: dict[str, int] = field(default_factory=dict)   # strategy -> arena bytes


class OverlapError(AssertionError):
    """Two buffers live at the same time share arena bytes (a planner bug)."""


def live_bytes(buffers: Sequence[Buffer]) -> list[int]:
    """The bytes live at each instruction ``0 .. max(last)``."""
    n = max((b.last for b in buffers), default=-1) + 1
    live = [0] * (n + 1)
    for b in buffers:
        live[b.first] += b.size
        live[b.last + 1] -= b.size
    for k in range(1, n):
        live[k] += live[k - 1]
    return live[:n]


def lower_bound(buffers: Sequence[Buffer]) -> int:
    """The most bytes live at one instruction: no placement can use fewer."""
    return max(live_bytes(buffers), default=0)


def _best_fit_in_order(buffers: Sequence[Buffer]) -> dict[int, int]:
    """Walk the program: free the buffers whose range ended, then give each new buffer the
    smallest free hole it fits, else the top of the arena."""
    order = sorted(buffers, key=lambda b: (b.first, -b.size, b.id))
    ending: list[tuple[int, int, int]] = []   # heap of (last, offset, size) of placed buffers
    by_size: list[tuple[int, int]] = []        # free holes as (size, offset), sorted
    hole_at: dict[int, int] = {}               # offset -> size of each free hole
    hole_end: dict[int, int] = {}              # end -> offset of each free hole
    top = 0
    offsets: dict[int, int] = {}

    def take(off: int) -> int:
        size = hole_at.pop(off)
        del hole_end[off + size]
        del by_size[bisect.bisect_left(by_size, (size, off))]
        return size

    def free(off: int, size: int) -> None:
        nonlocal top
        if off + size in hole_at:          # merge with the hole above
            size += take(off + size)
        if off in hole_end:                # and with the hole below
            below = hole_end[off]
            size += take(below)
            off = below
        if off + size == top:
            top = off
            return
        hole_at[off], hole_end[off + size] = size, off
        bisect.insort(by_size, (size, off))

    for b in order:
        while ending and ending[0][0] < b.first:
            _, off, size = heapq.heappop(ending)
            free(off, size)
        i = bisect.bisect_left(by_size, (b.size, -1))
        if i == len(by_size):
            off = top
            top += b.size
        else:
            size, off = by_size[i]
            take(off)
            if size > b.size:
                hole_at[off + b.size], hole_end[off + size] = size - b.size, off + b.size
                bisect.insort(by_size, (size - b.size, off + b.size))
        offsets[b.id] = off
        heapq.heappush(ending, (b.last, off, b.size))
    return offsets


def _greedy(buffers: Sequence[Buffer], key: Callable[[Buffer], tuple]) -> dict[int, int]:
    """Place buffers in ``key`` order, each in the smallest gap between the buffers already
    placed that overlap it in time (in offset order), else above the highest of them. The placed
    buffers are kept sorted by offset in numpy arrays, so each step is a few vector operations."""
    order = sorted(buffers, key=key)
    n = len(order)
    off_a, end_a = np.zeros(n, np.int64), np.zeros(n, np.int64)
    first_a, last_a = np.zeros(n, np.int64), np.zeros(n, np.int64)
    offsets: dict[int, int] = {}
    for k, b in enumerate(order):
        off = 0
        if k:
            live = (first_a[:k] <= b.last) & (last_a[:k] >= b.first)
            offs, ends = off_a[:k][live], end_a[:k][live]
            if offs.size:
                below = np.maximum.accumulate(ends)        # highest end at or below each
                gaps = offs - np.concatenate(([0], below[:-1]))
                fit = np.flatnonzero(gaps >= b.size)
                if fit.size:
                    j = int(fit[np.argmin(gaps[fit])])
                    off = int(below[j - 1]) if j else 0
                else:
                    off = int(below[-1])
        offsets[b.id] = off
        pos = int(np.searchsorted(off_a[:k], off))
        for arr, x in ((off_a, off), (end_a, off + b.size), (first_a, b.first), (last_a, b.last)):
            arr[pos + 1:k + 1] = arr[pos:k]
            arr[pos] = x
    return offsets


def _conflicts(buffers: Sequence[Buffer]) -> dict[int, int]:
    """How many other buffers each one is live together with (sorted endpoints, n log n)."""
    starts = sorted(b.first for b in buffers)
    ends = sorted(b.last for b in buffers)
    n = len(buffers)
    return {b.id: n - bisect.bisect_left(ends, b.first) - (n - bisect.bisect_right(starts, b.last))
            - 1 for b in buffers}


def _arena_size(buffers: Sequence[Buffer], offsets: dict[int, int]) -> int:
    return max((offsets[b.id] + b.size for b in buffers), default=0)


def _perturbed(buffers: Sequence[Buffer]) -> dict[int, int]:
    """Greedy by size with each size scaled by a seeded random factor in [1, 1.3), up to 64
    rounds (at most 40000 / buffers, so few on large programs), keeping the smallest; stops at
    the lower bound."""
    rng = random.Random(0)
    bound = lower_bound(buffers)
    best, best_size = {}, None
    for _ in range(min(64, 40000 // max(len(buffers), 1))):
        noise = {b.id: 1 + 0.3 * rng.random() for b in buffers}
        offsets = _greedy(buffers, lambda b: (-b.size * noise[b.id], b.id))
        size = _arena_size(buffers, offsets)
        if best_size is None or size < best_size:
            best, best_size = offsets, size
            if size <= bound:
                break
    return best or _greedy(buffers, lambda b: (-b.size, b.first, b.id))


def _by_pressure(buffers: Sequence[Buffer]) -> dict[int, int]:
    """Greedy placement, buffers in order of the most bytes live at any instruction of their
    range (those live at the peak first, then those at lower peaks), larger first among
    equals: a buffer that spans two peaks goes under the ones live at only one of them (the
    breadth-first idea of Pisarchyk & Lee, per buffer)."""
    live = np.asarray(live_bytes(buffers))
    pressure = {b.id: int(live[b.first:b.last + 1].max()) for b in buffers}
    return _greedy(buffers, lambda b: (-pressure[b.id], -b.size, b.first, b.id))


def _hill_climb(buffers: Sequence[Buffer]) -> dict[int, int]:
    """Greedy placement in an order improved by local moves (as TVM's USMP hill climb): move a
    buffer that reaches the top of the arena to a random earlier place in the order, keep the
    move unless the arena grows; restart from the by-size order every 32 moves (seeded). At most
    256 placements (40000 / buffers on large programs); stops at the lower bound."""
    rng = random.Random(0)
    bound = lower_bound(buffers)
    start = sorted(buffers, key=lambda b: (-b.size, b.first, b.id))

    def place(order):
        rank = {b.id: k for k, b in enumerate(order)}
        offsets = _greedy(buffers, lambda b: (rank[b.id],))
        return _arena_size(buffers, offsets), offsets
    first = best_size, best = place(start)
    rounds = min(256, 40000 // max(len(buffers), 1))
    for r in range(rounds):
        if best_size <= bound:
            break
        if r % 32 == 0:
            order = list(start)
            size, offsets = first
        pos = {b.id: k for k, b in enumerate(order)}
        j = rng.choice([pos[b.id] for b in buffers if offsets[b.id] + b.size == size])
        i = rng.randrange(j + 1)
        order.insert(i, order.pop(j))
        new_size, new = place(order)
        if new_size <= size:
            size, offsets = new_size, new
            if size < best_size:
                best_size, best = size, offsets
        else:
            order.insert(j, order.pop(i))
    return best


STRATEGIES: dict[str, Callable[[Sequence[Buffer]], dict[int, int]]] = {
    "best_fit_in_order": _best_fit_in_order,
    "greedy_by_size": lambda bs: _greedy(bs, lambda b: (-b.size, b.first, b.id)),
    "greedy_by_pressure": _by_pressure,
    "greedy_by_conflicts": lambda bs: (lambda c: _greedy(
        bs, lambda b: (-c[b.id], -b.size, b.first, b.id)))(_conflicts(bs)),
    "perturbed_greedy_by_size": _perturbed,
    "hill_climb": _hill_climb,
}


def plan_arena(buffers: Sequence[Buffer], strategies: Sequence[str] | None = None,
               tolerance: float = 0.001) -> ArenaPlan:
    """The smallest arena the strategies find, trying them in order until one is within
    ``tolerance`` of the lower bound (no order can do better than the bound; 0 insists on it).
    Sizes must be aligned (:func:`aligned`)."""
    for b in buffers:
        if b.size % ALIGN or b.size <= 0 or b.last < b.first:
            raise ValueError(f"plan_arena: buffer {b.name or b.id} has size {b.size} and range "
                             f"[{b.first}, {b.last}]: sizes must be positive multiples of "
                             f"{ALIGN} and ranges non-empty")
    bound = lower_bound(buffers)
    best: ArenaPlan | None = None
    tried: dict[str, int] = {}
    for name in strategies or STRATEGIES:
        offsets = STRATEGIES[name](buffers)
        size = _arena_size(buffers, offsets)
        tried[name] = size
        if best is None or size < best.size:
            best = ArenaPlan(offsets, size, name, bound, sum(b.size for b in buffers))
        if size <= bound * (1 + tolerance):
            break
    if best is None:
        best = ArenaPlan({}, 0, "empty", 0, 0)
    best.tried = tried
    return best


def check_arena(buffers: Sequence[Buffer], offsets: dict[int, int],
                describe: Callable[[Buffer], str] | None = None) -> None:
    """Raise :class:`OverlapError` naming both buffers if two live at the same instruction share
    a byte, or if an offset is not aligned. A sweep over time keeps the live buffers sorted by
    offset; while they are disjoint, a new one overlaps some live buffer exactly when it
    overlaps its neighbour below or above."""
    describe = describe or (lambda b: b.name or f"buffer {b.id}")
    for b in buffers:
        if offsets[b.id] % ALIGN:
            raise OverlapError(f"{describe(b)} is at offset {offsets[b.id]}, not a multiple of "
                               f"{ALIGN}")
    ending: list[tuple[int, int, int]] = []   # heap of (last, offset, id)
    live: list[tuple[int, int]] = []           # (offset, id), sorted
    by_id = {b.id: b for b in buffers}

    def clash(b: Buffer, o: Buffer) -> OverlapError:
        lo, ol = offsets[b.id], offsets[o.id]
        return OverlapError(f"{describe(b)} (bytes [{lo}, {lo + b.size}), live [{b.first}, "
                            f"{b.last}]) overlaps {describe(o)} (bytes [{ol}, {ol + o.size}), "
                            f"live [{o.first}, {o.last}]) while both are live")
    for b in sorted(buffers, key=lambda b: (b.first, b.id)):
        while ending and ending[0][0] < b.first:
            _, off, i = heapq.heappop(ending)
            del live[bisect.bisect_left(live, (off, i))]
        lo = offsets[b.id]
        j = bisect.bisect_left(live, (lo, b.id))
        if j > 0:
            o = by_id[live[j - 1][1]]
            if offsets[o.id] + o.size > lo:
                raise clash(b, o)
        if j < len(live) and live[j][0] < lo + b.size:
            raise clash(b, by_id[live[j][1]])
        live.insert(j, (lo, b.id))
        heapq.heappush(ending, (b.last, lo, b.id))
