"""Plans: what one call of an op does, as data.

Dispatch of a call produces a :class:`Plan` — a short list of :class:`Instr` over *slots*
(slot ``i < n_in`` is input ``i``'s local array; later slots are values the instructions
make) and one :class:`OutSpec` per output — and the eager runtime runs its compiled form
(:func:`compile_plan`) at once. The same plans, recorded by :func:`disttensor.jit.record`, are
the raw material of captured programs: every instruction is data with what it calls prepared
(kernel with its local attributes and context, collective with its group and sizes
resolved), so replaying needs no rule evaluation.

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
from functools import partial
from types import FunctionType
from typing import Any, Callable

import numpy as np

from .codegen import CODE_CACHE_LIMIT, assign, define

__all__ = ["Instr", "OutSpec", "Plan", "CallRecord", "as_array"]


def as_array(a: Any) -> Any:
    """A kernel's result as an array (numpy reductions return numpy scalars)."""
    return a if type(a) is np.ndarray or not isinstance(a, np.generic) else np.asarray(a)


@dataclass(slots=True, eq=False)
class Instr:
    """One instruction of a plan (see the module docstring), as plain data: ``kernel`` reads
    slots ``ins``, produces slots ``outs`` and writes into the buffers of slots ``writes``.

    A ``kernel`` instruction calls ``kernel(xp, *arrays, **kwargs)`` (``kwargs`` None: a dense
    plan's kernel takes the call's attrs, another none), adding ``ctx=ctx`` for a kernel that
    needs its context and ``out=arrays[out_arg]`` for one writing into an argument. A
    ``collective`` or ``local`` step calls ``kernel(array)``, a ``store`` ``kernel(dst, src)``,
    ``empty`` ``kernel(xp, *arrays)``. :meth:`bind` makes the call a function of the arrays."""

    kind: str
    kernel: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    kwargs: dict | None = None
    ctx: Any = None
    out_arg: int | None = None
    label: str = ""
    nbytes: int = 0
    collectives: tuple[str, ...] = ()
    accepts_out: bool = False  # the bound call takes ``out=`` (a buffer for its one result)
    # it concatenates its inputs, flattened, into its one (1-D) output: the element offset of
    # each input there (a memory plan may place the inputs at those parts of the output)
    packs: tuple[int, ...] | None = None

    @property
    def communicates(self) -> bool:
        return self.kind == "collective" or bool(self.collectives)

    def bind(self, xp: Any, attrs: dict | None = None) -> Callable:
        """The instruction as a function of its argument arrays, with the array module, the
        keyword arguments (``attrs``: a dense kernel's), the context and the ``out=`` target
        bound."""
        if self.kind == "empty":
            return partial(self.kernel, xp)
        if self.kind != "kernel":
            return self.kernel
        kw = dict(self.kwargs if self.kwargs is not None else attrs or {})
        if self.ctx is not None:
            kw["ctx"] = self.ctx
        if self.out_arg is None:
            return partial(self.kernel, xp, **kw)
        kernel, at = self.kernel, self.out_arg

        def into_arg(*arrays):
            return kernel(xp, *arrays, out=arrays[at], **kw)
        return into_arg

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
    ``fn`` is the compiled plan (:func:`compile_plan`), the one way its instructions run.
    ``single`` is the output's spec when the plan makes one fresh output and writes nothing
    (the common case, wrapped without a loop). ``consumed`` lists the inputs the kernel reads
    resharded, as ``(input, slot, layout)``: autograd saves that slot's value for backward, so
    a backward never repeats a forward reshard."""

    __slots__ = ("op", "kind", "mesh", "n_in", "n_slots", "instrs", "outputs", "writes",
                 "in_layouts", "consumed", "fn", "single", "keep", "__weakref__")

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
        self.single = outputs[0] if (
            not writes and len(outputs) == 1 and op.n_out == 1 and outputs[0].is_input is None
            and (kind == "dense" or outputs[0].shape is not None)) else None
        self.keep = None
        self.fn = compile_plan(self)

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


#: the code of compiled plans by structure (op name, slots, per instruction what the source
#: depends on): a plan of a known structure only binds its callables (a cache miss compiles
#: nothing new)
_PLAN_CODE: dict[tuple, Any] = {}


def compile_plan(plan: Plan) -> Callable:
    """``plan`` as one straight-line function ``fn(xp, attrs, *input_arrays) -> slots``: every
    instruction in order, over locals named after the slots; it returns the tuple of all slots'
    arrays (None where nothing was assigned; a dense variadic kernel's results spread at its
    slot). ``attrs`` reaches a dense plan's kernels only (a dist plan bound its own)."""
    dense = plan.kind == "dense"
    env: dict[str, Any] = {}
    structure: list = [plan.op.name, plan.op.n_out, dense, plan.n_in, plan.n_slots]
    for k, ins in enumerate(plan.instrs):
        env[f"K{k}"] = ins.kernel
        if ins.ctx is not None:
            env[f"C{k}"] = ins.ctx
        if ins.kwargs and not dense:
            env[f"W{k}"] = ins.kwargs
        structure.append((ins.kind, ins.ins, ins.outs, ins.writes, ins.ctx is not None,
                          ins.out_arg, bool(ins.kwargs)))
    key = tuple(structure)
    code = _PLAN_CODE.get(key)
    if code is None:
        if len(_PLAN_CODE) >= CODE_CACHE_LIMIT:
            _PLAN_CODE.pop(next(iter(_PLAN_CODE)))
        code = _PLAN_CODE[key] = _plan_source(plan, dict(env)).__code__
    return FunctionType(code, env)


def _plan_source(plan: Plan, env: dict) -> Callable:
    """Generate and compile the function :func:`compile_plan` describes."""
    dense = plan.kind == "dense"
    n_out = plan.op.n_out
    assigned = set(range(plan.n_in))
    body = []
    spread = None  # a dense variadic kernel's output slot (a tuple of arrays)
    for k, ins in enumerate(plan.instrs):
        args = [f"s{i}" for i in ins.ins]
        outs = [f"s{o}" for o in ins.outs]
        assigned.update(ins.outs)
        if ins.kind == "kernel":
            if ins.ctx is not None:
                args.append(f"ctx=C{k}")
            if ins.out_arg is not None:
                args.append(f"out=s{ins.ins[ins.out_arg]}")
            if dense:
                args.append("**attrs")
            elif ins.kwargs:
                args.append(f"**W{k}")
            if dense and n_out == -1:
                spread = ins.outs[0]
            body.append(assign(outs, f"K{k}(xp, {', '.join(args)})",
                               unpack=len(outs) > 1 or n_out > 1 or (n_out == -1 and not dense)))
        elif ins.kind == "store":
            body.append(f"K{k}(s{ins.writes[0]}, {args[0]})")
        elif ins.kind == "empty":
            body.append(assign(outs, f"K{k}(xp{''.join(', ' + a for a in args)})", unpack=True))
        else:  # collective, local
            body.append(assign(outs, f"K{k}({args[0]})"))
    slots = [(f"*s{i}" if i == spread else f"s{i}") if i in assigned else "None"
             for i in range(plan.n_slots)]
    body.append(f"return ({''.join(slot + ', ' for slot in slots)})")
    params = ["xp", "attrs"] + [f"s{i}" for i in range(plan.n_in)]
    fn, _ = define(f"plan_{plan.op.name}", params, body, env, "<disttensor plan>")
    return fn


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
    of every slot the plan filled, the
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
