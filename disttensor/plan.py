"""Plans: what one call of an op does, as data.

Dispatch of a call produces a :class:`Plan` — a short list of :class:`Instr` over *slots*
(slot ``i < n_in`` is input ``i``'s local array; later slots are values the instructions
make) and one :class:`OutSpec` per output — and the eager runtime interprets it at once. The
same plans, recorded by :func:`disttensor.jit.record`, are the raw material of captured
programs: every instruction is a prepared callable (kernel with its local attributes and
context, collective with its group and sizes resolved), so replaying needs no rule evaluation.

Instruction kinds:

* ``kernel`` — ``op.kernel`` on the argument slots, producing the output slots (a kernel that
  mutates inputs writes into their slots, listed in ``writes``); ``collectives`` names the
  all-reduces a context kernel issues (batch_norm's statistics, parallel cross entropy, ...);
* ``collective`` — one step of a reshard that communicates (all-gather, all-reduce,
  reduce-scatter, all-to-all, send/recv);
* ``local`` — one reshard step without communication (slice, Partial rescale, R→P);
* ``store`` — a write-back: the value of ``ins[0]`` is written into the buffer of slot
  ``writes[0]`` (an inplace target or a mutated input, in its own layout);
* ``empty`` — the empty pieces of the outputs on a rank outside the mesh.

Alias edges: an output that *views* a slot shares that slot's buffer and version counter
(``OutSpec.view_of``); an output that *is* an input (``OutSpec.is_input``: inplace and
mutated pairs) is that input tensor itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Instr", "OutSpec", "Plan", "CallRecord"]


@dataclass(slots=True, eq=False)
class Instr:
    """One instruction of a plan (see the module docstring): ``fn`` reads slots ``ins``,
    produces slots ``outs`` and writes into the buffers of slots ``writes``."""

    kind: str
    fn: Callable | None
    ins: tuple[int, ...]
    outs: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    label: str = ""
    nbytes: int = 0
    collectives: tuple[str, ...] = ()
    # a kernel instruction whose fn is ``op.kernel(xp, *arrays, **kwargs)``: the bound keyword
    # arguments (local attrs and context), so a replay can call the kernel directly
    kwargs: dict | None = None
    accepts_out: bool = False  # fn writes into a given ``out=`` (not a dense plan's kernel)
    # fn concatenates its inputs, flattened, into its one (1-D) output: the element offset of
    # each input there (a memory plan may place the inputs at those parts of the output)
    packs: tuple[int, ...] | None = None

    @property
    def communicates(self) -> bool:
        return self.kind == "collective" or bool(self.collectives)

    def __repr__(self) -> str:
        args = ", ".join(f"%{i}" for i in self.ins)
        lhs = ", ".join(f"%{o}" for o in self.outs)
        text = f"{lhs + ' = ' if lhs else ''}{self.kind} {self.label}({args})"
        if self.writes:
            text += " -> writes " + ", ".join(f"%{w}" for w in self.writes)
        if self.collectives:
            text += "  [" + "; ".join(self.collectives) + "]"
        return text


@dataclass(slots=True, eq=False)
class OutSpec:
    """Output ``i`` of a plan: the slot holding its local array, its global shape, dtype and
    layout (``dist_attr`` None for a dense output; shape and dtype None when a dense plan learns
    them from the kernel) and its alias edge."""

    slot: int
    shape: tuple[int, ...] | None
    dtype: Any
    dist_attr: Any = None
    view_of: int | None = None
    is_input: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            self.dtype = np.dtype(self.dtype)

    def __repr__(self) -> str:
        alias = ""
        if self.is_input is not None:
            alias = f" is input {self.is_input}"
        elif self.view_of is not None:
            alias = f" views %{self.view_of}"
        place = "" if self.dist_attr is None else f" {self.dist_attr.to_placements()}"
        shape = "?" if self.shape is None else list(self.shape)
        return f"%{self.slot}: {shape} {self.dtype}{place}{alias}"


class Plan:
    """What one call does: ``instrs`` over slots, then ``outputs``.

    ``kind`` is ``"dense"`` (one process's arrays; the kernel takes the call's attrs) or
    ``"dist"`` (this rank's pieces on ``mesh``; attrs are bound in local terms). ``writes`` are
    the inputs whose buffers the plan writes (their version counters are bumped once each).
    ``kernel`` is the kernel instruction when the plan is that instruction alone; ``fast``
    says the eager runtime may run it on its fast path (one kernel, one new output, nothing
    written), which does exactly what interpreting the instruction does. ``consumed`` lists
    the inputs the kernel reads resharded, as ``(input, slot, layout)``: autograd saves that
    slot's value for backward, so a backward never repeats a forward reshard."""

    __slots__ = ("op", "kind", "mesh", "n_in", "n_slots", "instrs", "outputs", "writes",
                 "in_layouts", "consumed", "kernel", "fast", "view0", "keep", "__weakref__")

    def __init__(self, op, kind: str, n_in: int, instrs: tuple[Instr, ...],
                 outputs: tuple[OutSpec, ...], writes: tuple[int, ...] = (), mesh=None,
                 in_layouts: tuple = (), consumed: tuple = ()):
        self.op = op
        self.consumed = consumed
        self.kind = kind
        self.mesh = mesh
        self.n_in = n_in
        self.instrs = instrs
        self.outputs = outputs
        self.writes = writes
        self.in_layouts = in_layouts
        used = [n_in - 1] + [s for ins in instrs for s in ins.outs] + [o.slot for o in outputs]
        self.n_slots = max(used) + 1
        self.kernel = instrs[0] if len(instrs) == 1 and instrs[0].kind == "kernel" else None
        # the eager fast path: one kernel, one new output, nothing written
        self.fast = (self.kernel is not None and not writes and len(outputs) == 1
                     and op.n_out == 1 and outputs[0].is_input is None
                     and (kind == "dense" or outputs[0].shape is not None))
        self.view0 = outputs[0].view_of if outputs else None
        self.keep = None

    @property
    def num_collectives(self) -> int:
        return sum(1 for i in self.instrs if i.communicates)

    def __str__(self) -> str:
        where = f" on {self.mesh}" if self.mesh is not None else ""
        lines = [f"plan {self.op.name} ({self.kind}{where}): {self.n_in} input(s)"]
        lines += [f"  {ins!r}" for ins in self.instrs]
        lines += [f"  out {i}: {o!r}" for i, o in enumerate(self.outputs)]
        if self.writes:
            lines.append(f"  writes inputs {list(self.writes)}")
        return "\n".join(lines)


def _describe_tensor(t) -> str:
    if t is None:
        return "None"
    v = t._value
    dtype = np.dtype(t.dtype).name
    if t.is_dist():
        return f"{list(v.shape)} {dtype} {v.dist_attr.to_placements()}"
    return f"{list(v.shape)} {dtype} dense"


class CallRecord:
    """One executed call, as :func:`disttensor.jit.record` sees it: the plan, the attrs the
    call passed, the input and output Tensors, the array module its kernels ran with (numpy
    or cupy: the first input's, or for a creation op its place's), the (local shape, dtype)
    of every slot the plan filled (None on the fast path, which has no temporaries), the
    Tensors saved for backward in place of resharded inputs by their slot (``saved``, see
    ``Plan.consumed``) and the collectives it issued."""

    __slots__ = ("plan", "attrs", "inputs", "outputs", "xp", "slot_metas", "saved")

    def __init__(self, plan: Plan, attrs: dict, inputs: tuple, outputs: tuple, xp: Any,
                 slot_metas: list | None = None, saved: dict | None = None):
        self.saved = saved
        self.plan = plan
        self.attrs = attrs
        self.inputs = inputs
        self.outputs = outputs
        self.xp = xp
        self.slot_metas = slot_metas

    @property
    def op(self) -> str:
        return self.plan.op.name

    @property
    def collectives(self) -> list[str]:
        out = []
        for ins in self.plan.instrs:
            if ins.kind == "collective":
                out.append(ins.label)
            out.extend(ins.collectives)
        return out

    def __str__(self) -> str:
        ins = ", ".join(_describe_tensor(t) for t in self.inputs)
        outs = ", ".join(_describe_tensor(t) for t in self.outputs)
        text = f"{self.op}({ins}) -> {outs}"
        coll = self.collectives
        if coll:
            text += "\n    collectives: " + "; ".join(coll)
        return text

    __repr__ = __str__
