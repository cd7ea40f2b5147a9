"""A captured step as a :class:`Program` of SSA values.

:func:`build_program` turns the calls a capture recorded (:class:`disttensor.plan.CallRecord`)
into

* **values** — one per tensor a call produced (an inplace or mutated output is a *new* value of
  the same buffer), per plan temporary (a reshard's result), and per program input: the step's
  tensor arguments (``data``), its float arguments, and every tensor it read without creating it
  (parameters, buffers, optimizer states, constants: ``external``);
* **ops** — one per call, in order, each tagged ``forward``, ``backward`` (run by the autograd
  engine) or ``update`` (after backward: the optimizer), with its inplace and view pairs;
* **registers** — the arrays replay works on; an op that updates a value in place writes its
  register, a view is recomputed from the register it views.

**Inplace chains** are found with a union-find over the inplace/mutated and view pairs of the
whole program (:class:`InplaceChains`, iterative, no recursion), rooted at the value that already
has a name (a parameter, buffer or data input). :meth:`Program.split` cuts the program into a
forward program ``x | params -> outputs, middles`` and a backward program
``x | params | middles | outputs | out_grads -> x_grads, param_grads``; a forward output or
middle reached from a parameter through an inplace chain (batch_norm's ``mean -> mean_out``, an
optimizer update) *is* that parameter: no extra output, no second name. Replay runs the two as
generated straight-line functions over prepared instructions (kernels with their attributes and
contexts bound, collectives with their groups and sizes resolved).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np

from ..codegen import assign, define
from ..plan import CallRecord, OutSpec, as_array
from .buffers import MemoryPlan, plan_buffers, timeline
from .memory import ALIGN, OverlapError
from .plot import plot_arena
from .remat import rematerialize

__all__ = ["Value", "ProgramOp", "Program", "SubProgram", "InplaceChains", "build_program"]


@dataclass(slots=True, eq=False)
class Value:
    """One SSA value: its name, kind, global shape/dtype/placements, this rank's local shape,
    the register holding it during replay and the op that defines it (None: a program input)."""

    id: int
    name: str
    kind: str  # "data", "float", "external", "temp" (made by an op), "scratch" (plan-internal)
    shape: tuple | None
    dtype: Any
    placements: tuple | None
    local_shape: tuple
    reg: int
    producer: int | None = None
    layout: Any = None  # (mesh, DistAttr) of a distributed value

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def describe(self) -> str:
        shape = "?" if self.shape is None else list(self.shape)
        place = "" if self.placements is None else \
            " [" + ",".join(_short(p) for p in self.placements) + "]"
        return f"{self.name}: {shape} {np.dtype(self.dtype).name}{place}"


def _short(p) -> str:
    if p.is_shard():
        return f"S({p.dim})"
    if p.is_partial():
        return f"P({p.reduce_type.value})"
    return "R"


@dataclass(slots=True, eq=False)
class Step:
    """One replay instruction over registers (see :mod:`disttensor.plan` for the kinds)."""

    kind: str
    fn: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    writes: tuple[int, ...]
    scalar_out: bool = False  # a 0-d result the kernel may return as a numpy scalar
    takes_out: bool = False   # fn accepts ``out=`` (a kernel that writes into a given buffer)
    packs: tuple[int, ...] | None = None  # element offsets of ``ins`` in ``outs[0]`` (Instr.packs)
    xp: Any = np  # the array module it runs with (a creation op's place may not be the program's)


@dataclass(slots=True, eq=False)
class ProgramOp:
    """One recorded call: its value ids (None for an absent input), phase, pairs and steps."""

    index: int
    name: str
    phase: str
    ins: tuple
    outs: tuple[int, ...]
    inplace: tuple[tuple[int, int], ...]
    views: tuple[tuple[int, int], ...]
    scratch: tuple[int, ...]
    steps: tuple[Step, ...]
    collectives: tuple[str, ...]
    attrs: str = ""


class InplaceChains:
    """Union-find over value ids; a set's root is its named member (a program input), else its
    earliest value. Iterative find with path compression: chains of any length, no recursion."""

    def __init__(self, n: int, named: Callable[[int], bool]):
        self.parent = list(range(n))
        self._named = named

    def find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        na, nb = self._named(ra), self._named(rb)
        if nb and not na or (na == nb and rb < ra):
            ra, rb = rb, ra
        self.parent[rb] = ra


@dataclass(eq=False)
class SubProgram:
    """A forward or backward program: its interface (value ids) and its ops."""

    name: str
    ops: list[ProgramOp]
    inputs: dict[str, list[int]]    # section -> value ids ("x", "params", "middles", ...)
    outputs: dict[str, list[int]]
    fn: Callable | None = field(default=None, repr=False)   # the generated replay function:
    # fn(registers dict) -> the values of out_regs; it pops the middles from the dict
    source: str = field(default="", repr=False)
    arg_regs: list[int] = field(default_factory=list)   # fn's parameters (registers)
    out_regs: list[int] = field(default_factory=list)   # what fn returns (registers)


class Program:
    """A captured step (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.values: list[Value] = []
        self.ops: list[ProgramOp] = []
        self.data: list[int] = []             # value ids of the tensor/float arguments
        self.externals: list[tuple[int, Any]] = []  # (value id, the Tensor read by reference)
        self.result: Any = None               # the step's return structure over value ids
        # (("arg", k) | ("ext", tensor), value id | None | Tensor): the .grad bindings after a step
        self.grads: list[tuple[tuple, Any]] = []
        self.external_writes: dict[int, int] = {}  # external value id -> writes per replay
        self.n_regs = 0
        self.chains: InplaceChains | None = None
        self.forward: SubProgram | None = None
        self.backward: SubProgram | None = None
        self.reg_value: dict[int, int] = {}    # register -> its latest value id
        self.guards: list = []                 # what a replay checks about the externals
        # (register, tensor): an external that is the tensor's .grad when the step began (a
        # gradient it accumulates into), read from that tensor's .grad on every replay
        self.entry_grads: list[tuple[int, Any]] = []
        self.provisional: str | None = None    # why the program must be captured again
        self.plan_memory: str | None = "kernels"  # what replays in the arena (buffers.py)
        self.recompute = False                 # rematerialize cheap forward values (remat.py)
        self.recomputed: list[tuple[int, int]] = []  # (forward value, its backward copy)
        self.memory: MemoryPlan | None = None
        self.arena = None                      # the arena array while planned
        self.xp = np                           # the step inputs' array module: the arena's

    # -- analysis ---------------------------------------------------------------------------
    def root(self, vid: int) -> int:
        """The value that names ``vid``'s inplace/view chain."""
        return self.chains.find(vid)

    def is_input(self, vid: int) -> bool:
        return self.values[vid].producer is None

    def split(self) -> tuple[SubProgram, SubProgram]:
        """The forward and backward programs with their interfaces, their buffer plan and
        replay functions (computed once)."""
        if self.forward is None:
            if self.recompute:
                self.recomputed = rematerialize(self)
            self.forward, self.backward = _split(self)
            if self.plan_memory:
                self.memory = plan_buffers(self, self.escaping(), self.plan_memory)
                self.arena = _arena(self.memory.arena.size, self.xp)
            for sub in (self.forward, self.backward):
                _codegen(self, sub)
        return self.forward, self.backward

    @cached_property
    def data_regs(self) -> list[int]:
        """The registers of the step's arguments, in order (computed once, after capture)."""
        return [self.values[v].reg for v in self.data]

    @cached_property
    def external_regs(self) -> list[tuple[int, Any]]:
        """(register, tensor) of every tensor the program reads by reference."""
        return [(self.values[v].reg, t) for v, t in self.externals]

    @cached_property
    def version_bumps(self) -> list[tuple[Any, int]]:
        """(tensor, writes) of every tensor the program writes in place."""
        return [(t, self.external_writes[v]) for v, t in self.externals
                if self.external_writes.get(v)]

    def escaping(self) -> set[int]:
        """Value ids the step hands back: its results and the gradients it leaves on tensors."""
        return {v for v in _leaves(self.result) if isinstance(v, int)} | \
            {v for _, v in self.grads if isinstance(v, int)}

    def watch_writes(self) -> None:
        """Regenerate the replay functions with a check around every instruction: the arena
        blocks of values live across it, other than the ones it defines or updates, must hold
        the same bytes after it (a kernel writing outside its buffer is named with the value
        whose bytes it changed). For tests: it copies the live blocks at every instruction."""
        self.split()
        if self.memory is None:
            raise ValueError(f"program {self.name} was captured without a memory plan")
        watch = WriteWatch(self)
        for sub in (self.forward, self.backward):
            _codegen(self, sub, watch)

    def memory_report(self, eager_peak: int | None = None) -> dict:
        """The buffer plan in numbers: arena bytes, the lower bound (most bytes live at once),
        the total without reuse, the winning strategy, ``eager_peak`` (bytes, as measured by
        the caller, e.g. with :func:`disttensor.jit.peak_bytes`) and per buffer its offset,
        size and live range over the replay's instructions."""
        self.split()
        mp = self.memory
        if mp is None:
            raise ValueError(f"program {self.name} was captured without a memory plan")
        a = mp.arena
        return {"scope": self.plan_memory, "arena_bytes": a.size,
                "lower_bound_bytes": a.lower_bound,
                "no_reuse_bytes": a.no_reuse, "strategy": a.strategy, "tried": a.tried,
                "vs_lower_bound": round(a.size / a.lower_bound, 4) if a.lower_bound else 1.0,
                "eager_peak_bytes": eager_peak, "instructions": mp.n_steps,
                "inplace_reuse": [f"{o}: {i} -> {r}" for o, i, r in mp.reused],
                "buffers": [{"name": b.name, "offset": a.offsets[b.id], "bytes": b.size,
                             "live": [b.first, b.last]} for b in mp.buffers]}

    def plot_memory(self, path: str) -> None:
        """Draw the arena (x: instruction, y: offset; one rectangle per buffer) with the
        lower-bound curve (bytes live at each instruction) over it, into ``path`` (needs
        matplotlib: ``pip install disttensor[plot]``)."""
        self.split()
        if self.memory is None:
            raise ValueError(f"program {self.name} was captured without a memory plan")
        plot_arena(self.memory.buffers, self.memory.arena, path, title=f"program {self.name}")

    # -- printing ----------------------------------------------------------------------------
    def _fmt_op(self, op: ProgramOp) -> str:
        outs = ", ".join(self.values[v].describe() for v in op.outs)
        args = ["None" if v is None else self.values[v].name for v in op.ins]
        if op.attrs:
            args.append(op.attrs)
        text = f"{outs or '()'} = {op.name}({', '.join(args)})"
        if op.inplace:
            text += "  inplace " + ", ".join(
                f"{self.values[a].name}->{self.values[b].name}" for a, b in op.inplace)
        if op.collectives:
            text += "\n        { " + "; ".join(op.collectives) + " }"
        return text

    def __str__(self) -> str:
        fwd, bwd = self.split()
        lines = [f"program {self.name}: {len(self.ops)} ops, {len(self.values)} values"]
        for sub in (fwd, bwd):
            ins = "; ".join(f"{k}: " + ", ".join(self.values[v].describe() for v in vs)
                            for k, vs in sub.inputs.items() if vs)
            lines.append(f"{sub.name}({ins})")
            for op in sub.ops:
                lines.append(f"  [{op.phase[0]}{op.index:4d}] {self._fmt_op(op)}")
            outs = "; ".join(f"{k}: " + ", ".join(self.values[v].name for v in vs)
                             for k, vs in sub.outputs.items() if vs)
            lines.append(f"  -> {outs}")
        return "\n".join(lines)


# -- building ----------------------------------------------------------------------------------

class _Builder:
    """Maps each tensor the capture saw to a register and its current SSA value."""

    def __init__(self, prog: Program):
        self.p = prog
        self.reg_of: dict[int, int] = {}  # id(local DenseTensor) -> register
        self.keep: list = []              # the DenseTensors whose ids are keys

    def new_value(self, name: str | None, kind: str, shape, dtype, placements, local_shape,
                  reg: int, producer: int | None, layout=None) -> int:
        vid = len(self.p.values)
        self.p.values.append(Value(vid, name or f"%{vid}", kind, None if shape is None
                                   else tuple(shape), np.dtype(dtype), placements,
                                   tuple(local_shape), reg, producer, layout))
        self.p.reg_value[reg] = vid
        return vid

    def like(self, prev: int, producer: int) -> int:
        """A new value of ``prev``'s register (an inplace update of it)."""
        v = self.p.values[prev]
        return self.new_value(None, "temp", v.shape, v.dtype, v.placements, v.local_shape,
                              v.reg, producer, v.layout)

    def new_reg(self) -> int:
        self.p.n_regs += 1
        return self.p.n_regs - 1

    def tensor_value(self, t, kind: str, name: str | None, producer: int | None) -> int:
        """A new value (and register) for tensor ``t``'s local array."""
        dense = t._local_dense()
        reg = self.new_reg()
        self.reg_of[id(dense)] = reg
        self.keep.append(dense)
        return self.new_value(name, kind, *_meta(t), reg, producer, _layout(t))

    def input_value(self, t) -> int:
        """The current value of an input tensor (an external program input when unseen)."""
        dense = t._local_dense()
        reg = self.reg_of.get(id(dense))
        if reg is not None:
            return self.p.reg_value[reg]
        vid = self.tensor_value(t, "external", t.name or f"ext{len(self.p.externals)}", None)
        self.p.externals.append((vid, t))
        return vid


def _meta(t) -> tuple:
    """(global shape, dtype, placements, local shape) of a tensor."""
    v = t._value
    arr = t._local_array()
    placements = tuple(v.dist_attr.to_placements()) if t.is_dist() else None
    return tuple(v.shape), arr.dtype, placements, arr.shape


def _layout(t):
    return (t._value.mesh, t._value.dist_attr) if t.is_dist() else None


def _only(fn: Callable) -> Callable:
    """``fn``'s one result, from the 1-tuple it returns."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)[0]
    return call


def _with_nones(fn: Callable, positions: list[int], n_args: int) -> Callable:
    """``fn`` called with None at argument ``positions`` (of ``n_args``) and the given
    arguments, in order, at the others."""
    present = [k for k in range(n_args) if k not in positions]

    def call(*args, **kwargs):
        full = [None] * n_args
        for k, a in zip(present, args):
            full[k] = a
        return fn(*full, **kwargs)
    return call


def _out_specs(plan, n_outputs: int) -> list[OutSpec]:
    specs = list(plan.outputs)
    if plan.op.n_out == -1 and len(specs) == 1 and n_outputs != 1:  # a dense split
        specs = [OutSpec(specs[0].slot + k, None, None, view_of=specs[0].view_of)
                 for k in range(n_outputs)]
    return specs


def _fmt_attrs(attrs: dict) -> str:
    parts = []
    for k, v in attrs.items():
        if k in ("place", "src_mesh", "mesh") or callable(v):
            continue
        text = repr(v) if not hasattr(v, "to_placements") else str(v.to_placements())
        parts.append(f"{k}={text if len(text) < 40 else text[:37] + '...'}")
    return ", ".join(parts)


def build_program(name: str, records: list[CallRecord], phases: list[str], args: list,
                  arg_kinds: list[str], xp) -> Program:
    """The :class:`Program` of a capture: ``records`` with their ``phases``; ``args`` the step's
    tensor arguments (``arg_kinds``: "data" or "float")."""
    prog = Program(name)
    prog.xp = xp
    b = _Builder(prog)
    for k, (t, kind) in enumerate(zip(args, arg_kinds)):
        prog.data.append(b.tensor_value(t, kind, f"x{k}", None))
    for index, (rec, phase) in enumerate(zip(records, phases)):
        prog.ops.append(_add_op(b, index, rec, phase))
    named = {v.id for v in prog.values if v.producer is None}
    prog.chains = InplaceChains(len(prog.values), named.__contains__)
    for op in prog.ops:
        for a, c in op.inplace + op.views:
            prog.chains.union(a, c)
    externals = {vid for vid, _ in prog.externals}
    for op in prog.ops:  # writes into program inputs (through views too) bump their versions
        for a, _ in op.inplace:
            root = prog.root(a)
            if root in externals:
                prog.external_writes[root] = prog.external_writes.get(root, 0) + 1
    return prog


def _add_op(b: _Builder, index: int, rec: CallRecord, phase: str) -> ProgramOp:
    plan = rec.plan
    ins = tuple(None if t is None else b.input_value(t) for t in rec.inputs)
    slot_reg: dict[int, int] = {}
    for i, t in enumerate(rec.inputs):
        if t is not None:
            slot_reg[i] = b.p.values[ins[i]].reg
    specs = _out_specs(plan, len(rec.outputs))
    out_slot = {spec.slot: k for k, spec in enumerate(specs) if spec.is_input is None}
    scratch: list[int] = []
    scratch_of: dict[int, int] = {}  # plan slot -> the value of that temporary
    stored = {w for instr in plan.instrs if instr.kind == "store" for w in instr.writes}
    steps = []
    for instr in plan.instrs:
        out_regs = []
        outs = instr.outs
        if len(outs) == 1 and plan.op.n_out == -1 and len(specs) > 1 and instr.kind == "kernel":
            outs = tuple(spec.slot for spec in specs)  # a dense split's outputs
        if instr.kind == "kernel" and len(outs) == len(specs):
            for s, spec in zip(outs, specs):  # what a kernel returns for an input it mutates
                if spec.is_input is not None and s not in slot_reg \
                        and spec.is_input not in stored:  # is that input's array (unless the
                    slot_reg[s] = slot_reg[spec.is_input]  # plan stores it there afterwards)
        for s in outs:
            if s not in slot_reg:
                slot_reg[s] = b.new_reg()
                if s not in out_slot:  # a plan temporary (a reshard's result)
                    meta = rec.slot_metas[s] if rec.slot_metas else None
                    shape, dtype = meta if meta else ((), np.float64)
                    scratch_of[s] = b.new_value(None, "scratch", None, dtype, None, shape,
                                                slot_reg[s], index)
                    scratch.append(scratch_of[s])
            out_regs.append(slot_reg[s])
        scalar = instr.kind == "kernel" and len(outs) == 1 and outs[0] in out_slot and \
            np.ndim(rec.outputs[out_slot[outs[0]]]._local_array()) == 0
        # bound to the array module eager ran it with (a dense kernel: the call's attrs)
        fn = instr.bind(rec.xp, rec.attrs if plan.kind == "dense" else None)
        takes_out = instr.accepts_out
        if len(outs) == 1 and (instr.kind == "empty" or
                               (plan.op.n_out == -1 and instr.kind == "kernel")):
            fn = _only(fn)  # empty pieces, or a split into one piece: a 1-tuple
        absent = [k for k, i in enumerate(instr.ins) if i < plan.n_in and rec.inputs[i] is None]
        if absent:  # an optional input not given (layer_norm without weight): None, bound
            fn = _with_nones(fn, absent, len(instr.ins))
        steps.append(Step(instr.kind, fn, tuple(slot_reg[i] for k, i in enumerate(instr.ins)
                                                if k not in absent),
                          tuple(out_regs), tuple(slot_reg[w] for w in instr.writes), scalar,
                          takes_out and len(out_regs) == 1, None if absent else instr.packs,
                          rec.xp))
    for s, t in (rec.saved or {}).items():  # a resharded input saved for backward
        v = b.p.values[scratch_of[s]]
        v.shape, _, v.placements, _ = _meta(t)
        v.layout = _layout(t)
        b.reg_of[id(t._local_dense())] = slot_reg[s]
        b.keep.append(t._local_dense())
    outs, inplace, views = [], [], []
    for spec, t in zip(specs, rec.outputs):
        if spec.is_input is not None:
            prev = ins[spec.is_input]
            vid = b.like(prev, index)
            inplace.append((prev, vid))
        else:
            dense = t._local_dense()
            reg = slot_reg[spec.slot]
            b.reg_of[id(dense)] = reg
            b.keep.append(dense)
            vid = b.new_value(None, "temp", *_meta(t), reg, index, _layout(t))
            if spec.view_of is not None:  # of an input, or of a temporary (a reshard's result)
                views.append((ins[spec.view_of] if spec.view_of < plan.n_in
                              else scratch_of[spec.view_of], vid))
        outs.append(vid)
    for i in plan.writes:  # inputs written but not returned (none today): new versions too
        if all(a != ins[i] for a, _ in inplace):
            inplace.append((ins[i], b.like(ins[i], index)))
    return ProgramOp(index, plan.op.name, phase, ins, tuple(outs), tuple(inplace), tuple(views),
                     tuple(scratch), tuple(steps), tuple(rec.collectives), _fmt_attrs(rec.attrs))


# -- the forward / backward split and replay code ----------------------------------------------

def _split(prog: Program) -> tuple[SubProgram, SubProgram]:
    fwd_ops = [op for op in prog.ops if op.phase == "forward"]
    bwd_ops = [op for op in prog.ops if op.phase != "forward"]
    externals = [vid for vid, _ in prog.externals]
    result_vids = [v for v in _leaves(prog.result) if isinstance(v, int)]
    grad_vids = [v for _, v in prog.grads if isinstance(v, int)]

    def named(vid: int) -> int:
        """A value reached from a program input through an inplace chain is that input."""
        r = prog.root(vid)
        return r if prog.is_input(r) and prog.values[r].reg == prog.values[vid].reg else vid

    def used(ops) -> set[int]:
        return {v for op in ops for v in op.ins if v is not None}

    fwd_defined = {v for op in fwd_ops for v in op.outs + op.scratch}
    bwd_used = used(bwd_ops)
    middles = sorted({named(v) for v in bwd_used if v in fwd_defined} - set(externals)
                     - set(prog.data))
    outputs = sorted({named(v) for v in result_vids if v in fwd_defined} - set(externals)
                     - set(prog.data))
    fwd_ext = sorted(set(externals) & (used(fwd_ops) | {v for op in fwd_ops
                                                        for v, _ in op.inplace}))
    # named(): an external the forward updated in place is read through its register (a
    # forward op after a backward, e.g. a micro-batch's batch_norm, reads the updated stats)
    bwd_ext = sorted(set(externals) & (bwd_used | {named(v) for v in bwd_used & fwd_defined}
                                       | {v for op in bwd_ops for v, _ in op.inplace}
                                       | set(grad_vids) | set(result_vids)))
    data_grads = sorted({v for (kind, _), v in prog.grads if kind == "arg" and isinstance(v, int)})
    param_grads = sorted(set(grad_vids) - set(data_grads))
    late = sorted({v for v in result_vids if v not in fwd_defined and not prog.is_input(v)})
    fwd = SubProgram("forward", fwd_ops, {"x": list(prog.data), "params": fwd_ext},
                     {"outputs": outputs, "middles": [m for m in middles if m not in outputs]})
    bwd = SubProgram("backward", bwd_ops,
                     {"x": list(prog.data), "params": bwd_ext,
                      "middles": fwd.outputs["middles"], "outputs": outputs, "out_grads": []},
                     {"x_grads": data_grads, "param_grads": param_grads, "outputs": late})
    return fwd, bwd


def _leaves(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _leaves(t)]
    if isinstance(tree, dict):
        return [x for t in tree.values() for x in _leaves(t)]
    return [tree]


class WriteWatch:
    """The checks :meth:`Program.watch_writes` puts around each replay instruction."""

    def __init__(self, prog: Program):
        mp = prog.memory
        steps = timeline(prog)
        self.prog, self.names = prog, {b.id: b.name for b in mp.buffers}
        self.ops = [op.name for op, _ in steps]
        written: dict[int, set[int]] = {}   # step -> buffers it may write
        for k, (_, s) in enumerate(steps):
            written[k] = {mp.group[r] for r in s.outs + s.writes if r in mp.group}
        self.protect = [[(b.id, mp.arena.offsets[b.id], b.size) for b in mp.buffers
                         if b.first < k <= b.last and b.id not in written[k]]
                        for k in range(len(steps))]
        self.saved: list = []

    def before(self, k: int) -> None:
        arena = self.prog.arena
        self.saved = [(g, off, arena[off:off + size].copy()) for g, off, size in self.protect[k]]

    def after(self, k: int) -> None:
        arena = self.prog.arena
        for g, off, old in self.saved:
            if not (arena[off:off + old.size] == old).all():
                raise OverlapError(f"step {k} ({self.ops[k]}) wrote outside its buffers: the "
                                   f"bytes of {self.names[g]}, live across it, changed")


def _arena(nbytes: int, xp):
    """One byte array of ``nbytes`` whose first byte is :data:`ALIGN`-aligned."""
    raw = xp.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.data.ptr if xp is not np else -raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def _into(buf, a):
    """Copy a kernel's fresh result into its planned buffer."""
    buf[...] = a
    return buf


def _codegen(prog: Program, sub: SubProgram, watch: "WriteWatch | None" = None) -> None:
    """Give ``sub`` a straight-line Python function running its steps over registers (locals),
    each register deleted after its last use; its parameters and results are the interface.
    With a memory plan, a step that defines a planned register writes into its arena block:
    through ``out=`` when the kernel takes it, else by one copy. With ``watch``, every step is
    bracketed by its checks (:class:`WriteWatch`)."""
    arg_vids = [v for section in sub.inputs.values() for v in section]
    arg_regs = list(dict.fromkeys(prog.values[v].reg for v in arg_vids))
    out_vids = [v for section in sub.outputs.values() for v in section]
    out_regs = [prog.values[v].reg for v in out_vids]
    last: dict[int, int] = {}
    steps = [s for op in sub.ops for s in op.steps]
    for k, s in enumerate(steps):
        for r in s.ins + s.outs + s.writes:
            last[r] = k
    mp = prog.memory
    offset = 0 if sub is prog.forward or mp is None else \
        sum(len(op.steps) for op in prog.forward.ops)
    env: dict[str, Any] = {"_asarray": as_array, "_into": _into, "_watch": watch}
    # the function takes the registers in a dict and pops the middles, so that its ``del``
    # frees them (the caller keeps no reference)
    popped = {prog.values[v].reg for v in sub.inputs.get("middles", ())}
    keep = set(out_regs) | (set(arg_regs) - popped)
    lines = [f"r{r} = R.{'pop' if r in popped else '__getitem__'}({r})" for r in arg_regs]
    for k, s in enumerate(steps):
        fname = f"F{k}"
        env[fname] = s.fn
        args = ", ".join(f"r{r}" for r in s.ins)
        planned = [] if mp is None else [r for r in s.outs if (offset + k, r) in mp.define]
        for r in planned:
            off, dtype, shape = mp.reg_at[r]
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            env[f"B{r}"] = prog.arena[off:off + size].view(dtype).reshape(shape)
        if watch is not None:
            lines.append(f"_watch.before({offset + k})")
        outs = [f"r{r}" for r in s.outs]
        if s.kind == "store":
            lines.append(f"{fname}(r{s.writes[0]}, {args})")
        elif planned and s.takes_out:
            lines.append(assign(outs, f"{fname}({args}{', ' if args else ''}out=B{s.outs[0]})"))
        else:
            call = f"{fname}({args})"
            lines.append(assign(outs, f"_asarray({call})" if s.scalar_out else call))
        if planned and not s.takes_out:
            lines.extend(f"r{r} = _into(B{r}, r{r})" for r in planned)
        if watch is not None:
            lines.append(f"_watch.after({offset + k})")
        dead = [r for r in dict.fromkeys(s.ins + s.outs + s.writes)
                if last.get(r) == k and r not in keep]
        if dead:
            lines.append(f"del {', '.join(f'r{r}' for r in dead)}")
    lines.append(f"return ({''.join(f'r{r}, ' for r in out_regs)})")
    fn, source = define(sub.name, ["R"], lines, env,
                        f"<disttensor program {prog.name}.{sub.name}>")
    sub.fn, sub.source, sub.arg_regs, sub.out_regs = fn, source, arg_regs, out_regs
