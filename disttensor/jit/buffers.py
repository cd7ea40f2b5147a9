"""The buffer plan of a captured program: which arena block every
temporary value lives in while the step replays.

:func:`plan_buffers` walks the replay timeline — the forward program's instructions, then the
backward program's — and

1. computes every SSA value's definition and last use with :func:`memory.live_ranges`;
2. groups values into *buffers*: the versions of one register (inplace updates) are one buffer,
   and a view (declared by the schema, or a reshard step that may slice its input) occupies no
   space of its own — it joins its base's buffer and keeps it alive;
3. leaves out of the arena what outlives the step or came from outside it: parameters, buffers,
   optimizer states, the step's arguments, what it returns, the gradients it leaves on tensors,
   0-d values, and the pieces a rank outside the mesh makes empty; by default (scope
   "kernels") also what a kernel without ``out=`` returns, which would cost a copy and as
   much memory again while it is made;
4. lets an op the schema marks ``reuse`` write into a dying input's buffer when that input has
   the output's size and dtype (inplace reuse);
5. places the inputs a step packs into its output (a gradient bucket) at their parts of the
   output's buffer, when they die there and that does not raise the lower bound (nor keep the
   arena from it, :data:`PACK_TIGHTNESS`): the kernels making them write there, and the
   packing copies nothing;
6. places the buffers with :func:`memory.plan_arena`.

Values the backward only needs the shape of (``no_need_buffer``) are never saved by the tape, so
the backward program does not read them: they die at their last forward use.

:func:`verify` is the verifier tests run on every planned program: it replays the timeline
symbolically and checks that every read finds its value written and its bytes not handed to
another buffer since, naming the op and both values otherwise.
"""
from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..schema import OPS
from .memory import (
    ArenaPlan,
    Block,
    Buffer,
    OverlapError,
    aligned,
    check_arena,
    live_bytes,
    live_ranges,
    plan_arena,
)

if TYPE_CHECKING:
    from .program import Program, ProgramOp, Step

__all__ = ["MemoryPlan", "plan_buffers", "verify", "timeline", "peak_bytes"]


#: a plan with inputs packed in place (:func:`_pack_in_place`) is kept only when its arena
#: comes this close to its lower bound; else the buffers are placed without packing
PACK_TIGHTNESS = 1.01


@dataclass
class MemoryPlan:
    """Where each planned register lives: ``reg_at[reg] = (offset, dtype, local shape)``;
    ``define[(step index, reg)]``: the planned registers a step defines; ``buffers`` with their
    live ranges over the timeline and ``arena`` (offsets by buffer id = base register)."""

    arena: ArenaPlan
    buffers: list[Buffer]
    reg_at: dict[int, tuple[int, np.dtype, tuple]]
    define: set[tuple[int, int]]
    group: dict[int, int]              # register -> buffer id (its base register)
    first: list[int] = field(repr=False, default_factory=list)   # per value id
    last: list[int] = field(repr=False, default_factory=list)
    reused: list[tuple[str, str, str]] = field(default_factory=list)  # (op, input, output)
    n_steps: int = 0


def timeline(prog: "Program") -> list[tuple["ProgramOp", "Step"]]:
    """The replay order: every step of the forward program, then of the backward program."""
    return [(op, s) for sub in (prog.forward, prog.backward) for op in sub.ops for s in op.steps]


def _step_values(prog: "Program", steps) -> list[tuple[list[int], list[int]]]:
    """Per step, the value ids it reads and those it defines (registers mapped to the value
    they hold at that point)."""
    cur: dict[int, int] = {v.reg: v.id for v in prog.values if v.producer is None}
    out: list[tuple[list[int], list[int]]] = []
    op_defs: dict[int, int] = {}
    last_op = None
    for op, s in steps:
        if op is not last_op:
            last_op = op
            op_defs = {prog.values[v].reg: v for v in op.outs + op.scratch}
            op_defs.update((prog.values[c].reg, c) for _, c in op.inplace)
        uses = [cur[r] for r in s.ins + s.writes if r in cur]
        defs = []
        for r in s.outs + s.writes:
            v = op_defs.get(r)
            if v is not None and cur.get(r) != v:
                cur[r] = v
                defs.append(v)
        out.append((uses, defs))
    return out


def _bitset(ids: list[int]) -> int:
    x = 0
    for v in ids:
        x |= 1 << v
    return x


def plan_buffers(prog: "Program", escaping: set[int], scope: str = "kernels") -> MemoryPlan:
    """The buffer plan of ``prog`` (see the module docstring); ``escaping``: value ids the
    step hands back (results, gradients left on tensors). ``scope`` "kernels": only values
    whose kernel or collective writes through ``out=``; "all": every
    temporary (the others are copied into their block once)."""
    steps = timeline(prog)
    vals = _step_values(prog, steps)
    first, last = live_ranges([Block([(_bitset(u), _bitset(d)) for u, d in vals])],
                              len(prog.values))
    base: dict[int, int] = {}          # register -> the register whose buffer it views

    def find(r: int) -> int:
        while r in base:
            r = base[r]
        return r
    for op in prog.ops:
        for a, c in op.views:
            ra, rc = find(prog.values[a].reg), prog.values[c].reg
            if ra != rc:
                base[rc] = ra
    def_step: dict[int, int] = {}      # register -> the step that first defines it
    unplanned: set[int] = set()        # registers (bases) kept out of the arena
    for k, ((op, s), (_, defs)) in enumerate(zip(steps, vals)):
        for v in defs:
            def_step.setdefault(prog.values[v].reg, k)
        for r in s.outs:
            if r in base or def_step.get(r, k) != k:  # a declared view lives in its base's
                continue  # buffer; a later write into a register keeps it where it was made
            if s.kind == "local" and not s.takes_out and s.ins and find(s.ins[0]) != r:
                base[r] = find(s.ins[0])  # a reshard step that may return a slice: a view
            elif s.kind == "empty" or s.scalar_out or s.xp is not prog.xp or (
                    scope == "kernels" and not s.takes_out):  # (another device: not its arena)
                unplanned.add(r)
    for v in prog.values:
        if v.producer is None or v.id in escaping or v.nbytes == 0 or not v.local_shape:
            unplanned.add(find(v.reg))
    size_of: dict[int, tuple[int, np.dtype, tuple]] = {}   # register -> its first value's
    name_of: dict[int, str] = {}
    for v in prog.values:
        if v.producer is not None and v.reg not in size_of:
            size_of[v.reg] = (v.nbytes, v.dtype, v.local_shape)
            name_of[v.reg] = v.name
    span: dict[int, list[int]] = {}    # base register -> [first, last] over its values
    for v in prog.values:
        if v.producer is None or first[v.id] < 0:
            continue
        g = find(v.reg)
        lo, hi = span.setdefault(g, [first[v.id], last[v.id]])
        span[g] = [min(lo, first[v.id]), max(hi, last[v.id])]
    unplanned |= {find(r) for r in unplanned}

    # inplace reuse: an op marked ``reuse`` writes into a dying input of its output's size,
    # and so does a local reshard step writing through ``out=`` (a copy: then nothing moves)
    merged: dict[int, int] = {}        # output register -> the buffer (base register) it reuses
    reused = []
    for k, (op, s) in enumerate(steps):
        reuse = OPS[op.name].reuse if s.kind == "kernel" else (0,) if s.kind == "local" and \
            s.takes_out else ()
        if not reuse or len(s.outs) != 1:
            continue
        r_out = s.outs[0]
        if r_out in base or r_out in unplanned or def_step.get(r_out) != k or r_out not in span:
            continue
        for i in reuse:
            if i >= len(s.ins) or i >= len(op.ins) or op.ins[i] is None:
                continue
            r_in = s.ins[i]
            g = merged.get(r_in, r_in)
            if r_in in base or g in unplanned or span[g][1] != k \
                    or size_of[g][:2] != size_of[r_out][:2]:
                continue
            merged[r_out] = g
            span[g][1] = span.pop(r_out)[1]
            out_name = next(prog.values[v].name for v in op.outs + op.scratch
                            if prog.values[v].reg == r_out)
            reused.append((op.name, prog.values[op.ins[i]].name, out_name))
            break

    def arena_of(span: dict) -> tuple[list[Buffer], ArenaPlan]:
        buffers = [Buffer(g, aligned(size_of[g][0]), lo, hi, f"buffer of {name_of[g]}")
                   for g, (lo, hi) in sorted(span.items()) if g not in unplanned]
        return buffers, plan_arena(buffers)
    packed = {g: list(r) for g, r in span.items()}
    inside = _pack_in_place(steps, base, unplanned, merged, def_step, packed, size_of)
    if inside:
        buffers, arena = arena_of(packed)
        # the planner could not place the longer-lived bucket well: plan without packing
        if arena.size > PACK_TIGHTNESS * arena.lower_bound:
            inside = {}
    if not inside:
        buffers, arena = arena_of(span)
    reg_at, define, group = {}, set(), {}

    def place(r: int) -> tuple[int, int]:
        """(buffer id, byte offset in it) of register ``r``'s block."""
        g = merged.get(find(r), find(r))
        return inside.get(g, (g, 0))
    for r, k in def_step.items():
        g, off = place(r)
        if g not in arena.offsets:
            continue
        group[r] = g
        if r not in base:
            reg_at[r] = (arena.offsets[g] + off, *size_of[r][1:])
            define.add((k, r))
    for r in base:
        g, _ = place(r)
        if g in arena.offsets:
            group[r] = g
    return MemoryPlan(arena, buffers, reg_at, define, group, first, last, reused, len(steps))


def _pack_in_place(steps, base: dict, unplanned: set, merged: dict, def_step: dict,
                   span: dict, size_of: dict) -> dict[int, tuple[int, int]]:
    """Blocks placed inside another buffer. A step that packs its inputs into its planned
    output (``Step.packs``, a gradient bucket) may get a planned input that dies there, of the
    output's dtype and not a view, written at its part of the output's buffer by the kernel
    that makes it: then the packing copies nothing, but the output's buffer lives from that
    input's definition on. Inputs are taken latest made first, each only where the most bytes
    live at once (the arena's lower bound) does not grow. Returns {input's buffer: (output's
    buffer, byte offset)} and removes those inputs from ``span``."""
    inside: dict[int, tuple[int, int]] = {}
    live: list[int] | None = None
    for k, (_, s) in enumerate(steps):
        if s.packs is None or not s.takes_out or len(s.outs) != 1:
            continue
        r_out = s.outs[0]
        if r_out in base or r_out in unplanned or def_step.get(r_out) != k or r_out not in span:
            continue
        nbytes, dtype, _ = size_of[r_out]
        ends = list(s.packs[1:]) + [nbytes // dtype.itemsize]
        cands: dict[int, int] = {}     # input's buffer -> its byte offset in the output
        for r_in, lo, hi in zip(s.ins, s.packs, ends):
            g = merged.get(r_in, r_in)
            if r_in in base or g in unplanned or g in inside or g in cands or g == r_out \
                    or g not in span or span[g][1] != k or size_of[g][1] != dtype \
                    or size_of[g][0] != (hi - lo) * dtype.itemsize:
                continue
            cands[g] = lo * dtype.itemsize
        if live is None:
            live = live_bytes([Buffer(g, aligned(size_of[g][0]), lo, hi)
                               for g, (lo, hi) in span.items() if g not in unplanned])
        peak = max(live)
        for g in sorted(cands, key=lambda g: -span[g][0]):
            (first, _), start = span[g], span[r_out][0]
            trial = live[:]
            for t in range(first, k + 1):
                trial[t] -= aligned(size_of[g][0])
            for t in range(first, start):
                trial[t] += aligned(nbytes)
            if max(trial) > peak:
                continue
            live, peak = trial, max(trial)
            inside[g] = (r_out, cands[g])
            span[r_out][0] = min(start, first)
            del span[g]
    return inside


def verify(prog: "Program", mp: MemoryPlan) -> None:
    """Check ``mp`` against the timeline: no two buffers live at once share a byte; every step
    reads only values whose buffer was written before, within the buffer's live range, and not
    handed to another buffer since. Raises :class:`OverlapError` naming the op and values."""
    buf = {b.id: b for b in mp.buffers}
    check_arena(mp.buffers, mp.arena.offsets, lambda b: b.name)
    spans = sorted((mp.arena.offsets[b.id], mp.arena.offsets[b.id] + b.size, b.id)
                   for b in mp.buffers)
    touching: dict[int, list[int]] = {b.id: [] for b in mp.buffers}
    for i, (lo, hi, a) in enumerate(spans):
        for lo2, _, c in spans[i + 1:]:
            if lo2 >= hi:
                break
            touching[a].append(c)
            touching[c].append(a)
    claimed: dict[int, int] = {}       # buffer -> the step that first wrote it
    steps = timeline(prog)
    for k, ((op, s), (uses, _)) in enumerate(zip(steps, _step_values(prog, steps))):
        for r in s.outs + s.writes:
            if (k, r) in mp.define:
                g = mp.group[r]
                claimed.setdefault(g, k)
                if not buf[g].first <= k <= buf[g].last:
                    raise OverlapError(f"step {k} ({op.name}) writes %{r} outside the live "
                                       f"range [{buf[g].first}, {buf[g].last}] of {buf[g].name}")
        for v in uses:
            g = mp.group.get(prog.values[v].reg)
            if g is None:
                continue
            name = prog.values[v].name
            if claimed.get(g, k) >= k:
                raise OverlapError(f"step {k} ({op.name}) reads {name} before {buf[g].name} "
                                   f"was written")
            if k > buf[g].last:
                raise OverlapError(f"step {k} ({op.name}) reads {name} after the live range "
                                   f"[{buf[g].first}, {buf[g].last}] of {buf[g].name} ended")
            for c in touching[g]:
                if claimed[g] < claimed.get(c, -1) <= k:
                    raise OverlapError(
                        f"step {k} ({op.name}) reads {name} from {buf[g].name}, but its bytes "
                        f"were given to {buf[c].name} at step {claimed[c]}")


def peak_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """``(fn(*args, **kwargs), peak)``: the most bytes allocated at once during the call above
    what was allocated before it, as tracemalloc sees them (numpy reports its array buffers)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn(*args, **kwargs)
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
