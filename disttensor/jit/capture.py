"""``to_static``: capture a step once per input signature, replay it afterwards.

The first call with a new signature runs the step *eagerly* while recording every call it makes
(the seam guarantees nothing escapes), then builds a :class:`~disttensor.jit.program.Program`.
Later calls with the same signature replay the program: its forward and backward functions run
prepared instructions (no rule evaluation, no per-op dispatch), kernels write into the same
parameter and state buffers eager mode would, random kernels draw from the global generator as
eager mode does, and learning rates are read when the updates run.

Signature: each argument's kind — a Tensor's global shape, dtype, mesh and placements and whether
it requires grad; a Python float becomes a 0-d float32 tensor *input* (a value that changes every
step never causes a new capture); other values (ints, strings, the model, the optimizer) by value
or identity — plus, checked at replay, the layout of every tensor the program reads by reference
(parameters, states) and which of them start the step with a gradient.

Capture refuses what a program cannot express, before any step completes and leaving the eager
objects as they were (buffers written during the failed capture are restored, ``.grad`` and the
generator too): ``numpy()`` and what builds on it (``item()``, ``float()``, ``if tensor:``) inside
the step, and any error an op raises while capturing, reported with the op it happened at.
"""
from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from .. import dispatch
from ..generator import default_generator
from ..layout.dist_tensor import DistTensor
from ..nn.layer import Layer
from ..ops import to_tensor
from ..ops.data_checks import flush_data_checks
from ..optimizer.gradient_merge import gradient_merge_config, merged_step
from ..tape import in_backward, is_grad_enabled, no_grad
from ..tensor import Tensor
from .program import Program, build_program

__all__ = ["to_static", "StaticFunction", "CaptureError", "DistModel"]

log = logging.getLogger("disttensor.jit")


class CaptureError(RuntimeError):
    """A step that a captured program cannot express (raised on every rank)."""


def _arg_signature(a: Any) -> tuple:
    if isinstance(a, Tensor):
        v = a._value
        place = (id(v.mesh), id(v.dist_attr)) if type(v) is DistTensor else "dense"
        return ("T", v.shape, v.dtype, place, a.stop_gradient)
    if isinstance(a, float) and not isinstance(a, bool):
        return ("f",)
    if isinstance(a, (int, bool, str, type(None), bytes)):
        return ("v", type(a).__name__, a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_arg_signature(x) for x in a)
    return ("o", id(a))


def _describe_sig(sig: tuple) -> str:
    return ", ".join(str(s) for s in sig)


class _Capture(dispatch.Observer):
    """The observer of one capture: its records, the buffers and gradients to restore, the
    host-read guard and the undo log."""

    refuses_host_reads = True

    def __init__(self, name: str):
        self.name = name
        self.records: list = []
        self.phases: list[str] = []
        self.backward_seen = False
        self.made: set[int] = set()        # holders created during the capture
        self.backups: dict[int, tuple] = {}  # id(holder) -> (holder, array, copy, version)
        self.grads: dict[int, tuple] = {}    # id(tensor) -> (tensor, .grad before)
        self.gen_state = default_generator.rng.bit_generator.state
        self.undo_log: list = []             # what lazily created state says to forget

    def on_call(self, rec) -> None:
        if in_backward():
            phase, self.backward_seen = "backward", True
        else:
            phase = "update" if self.backward_seen else "forward"
        self.records.append(rec)
        self.phases.append(phase)
        for t in rec.outputs:
            if t is not None:
                self.made.add(id(t._local_dense().holder))
        for t in rec.inputs:
            if t is not None and id(t) not in self.grads:
                self.grads[id(t)] = (t, t.grad)

    def before_write(self, plan, inputs) -> None:
        for i in plan.writes:
            d = inputs[i]._local_dense()
            h = d.holder
            if id(h) not in self.made and id(h) not in self.backups:
                self.backups[id(h)] = (h, d.array, d.array.copy(), h.version)
            t = inputs[i]
            if id(t) not in self.grads:
                self.grads[id(t)] = (t, t.grad)

    def on_host_read(self, what: str) -> None:
        last = self.records[-1].op if self.records else None
        where = f" (after op #{len(self.records) - 1} {last})" if last else ""
        raise CaptureError(
            f"to_static({self.name}): {what} inside a captured step{where}: the data it copies "
            "to Python (also behind item(), float(), bool() and `if tensor:`) is not part of a "
            "program, so Python control flow on tensor values cannot be captured; return the "
            "tensor from the step and read it outside")

    def on_lasting_state(self, undo) -> None:
        self.undo_log.append(undo)

    def undo(self) -> None:
        """Put back what the failed capture changed in objects that existed before it."""
        for h, arr, copy, version in self.backups.values():
            arr[...] = copy
            h.version = version
        for t, g in self.grads.values():
            t.grad = g
        for fn in reversed(self.undo_log):
            fn()
        default_generator.rng.bit_generator.state = self.gen_state

    def __enter__(self):
        dispatch.add_observer(self)
        return self

    def __exit__(self, *exc):
        dispatch.remove_observer(self)
        return False


def _flatten_args(args: tuple, kwargs: dict):
    """(tensor arguments in order, their kinds, the call's args with floats made tensors)."""
    tensors, kinds = [], []

    def conv(a):
        if isinstance(a, Tensor):
            tensors.append(a)
            kinds.append("data")
            return a
        if isinstance(a, float) and not isinstance(a, bool):
            t = to_tensor(np.float32(a))
            tensors.append(t)
            kinds.append("float")
            return t
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a
    call_args = tuple(conv(a) for a in args)
    call_kwargs = {k: conv(v) for k, v in kwargs.items()}
    return tensors, kinds, call_args, call_kwargs


class StaticFunction:
    """A step captured once per input signature and replayed afterwards (see the module
    docstring). ``programs`` maps signatures to their :class:`Program`; ``captures`` counts
    captures; ``program`` is the latest one."""

    def __init__(self, fn: Callable, name: str | None = None,
                 plan_memory: bool | str = "kernels", recompute: bool = False):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "step")
        self.plan_memory = _memory_scope(plan_memory)
        self.recompute = bool(recompute)
        self.programs: dict[tuple, Program] = {}
        self.captures = 0
        self.program: Program | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = (tuple(_arg_signature(a) for a in args),
               tuple((k, _arg_signature(v)) for k, v in sorted(kwargs.items())),
               is_grad_enabled())
        prog = self.programs.get(sig)
        if prog is not None:
            stale = _stale(prog)
            if stale is None:
                return _replay(prog, args, kwargs)
            reason = stale
        elif self.programs:
            reason = f"new input signature ({_describe_sig(sig[0])})"
        else:
            reason = "first call"
        return self._capture(sig, args, kwargs, reason)

    def _capture(self, sig, args, kwargs, reason: str) -> Any:
        log.info("to_static(%s): capturing a program: %s", self.name, reason)
        tensors, kinds, call_args, call_kwargs = _flatten_args(args, kwargs)
        xp = np
        for t in tensors:
            arr = t._local_array()
            xp = dispatch.xp_of(arr)
            break
        with _Capture(self.name) as cap:
            try:
                result = self.fn(*call_args, **call_kwargs)
            except CaptureError:
                cap.undo()
                raise
            except Exception as e:
                cap.undo()
                last = cap.records[-1].op if cap.records else None
                where = f" after op #{len(cap.records) - 1} ({last})" if last else ""
                raise CaptureError(f"to_static({self.name}): capturing the step failed{where}: "
                                   f"{type(e).__name__}: {e}") from e
        prog = build_program(self.name, cap.records, cap.phases, tensors, kinds, xp)
        prog.plan_memory, prog.recompute = self.plan_memory, self.recompute
        _bind_results(prog, result, tensors, cap)
        made = {id(t): weakref.ref(t) for rec in cap.records for t in rec.outputs
                if not any(t is x for x in rec.inputs)}  # not the inputs an op updated
        kept = {id(t) for t in _tensor_leaves(result)} | {id(t.grad) for t, _ in
                                                           cap.grads.values() if t.grad is not None}
        del cap
        gc.collect()
        escaped = [t for k, r in made.items() if (t := r()) is not None and k not in kept]
        if escaped:  # per rank: a capture issues the collectives a replay would, so ranks
            # may differ in when they capture without waiting on each other
            # the step made tensors that outlive it (an optimizer's moments on its first step):
            # replaying would make them anew each time, so capture again once they exist
            prog.provisional = (f"the previous capture made {len(escaped)} tensor(s) that outlive "
                                f"the step (state such as optimizer moments, e.g. "
                                f"'{escaped[0]._label()}'); capturing again now that they exist")
        prog.split()
        self.programs[sig] = self.program = prog
        self.captures += 1
        return result


def _bind_results(prog: Program, result: Any, tensors: list, cap: _Capture) -> None:
    """Map the step's return structure and its ``.grad`` changes onto program values, and
    record the guards a replay checks."""
    reg_of: dict[int, int] = {}
    for k, t in enumerate(tensors):
        reg_of[id(t._local_dense())] = prog.values[prog.data[k]].reg
    for op, rec in zip(prog.ops, cap.records):
        for t, vid in zip(rec.outputs, op.outs):
            reg_of[id(t._local_dense())] = prog.values[vid].reg
    ext_of_reg = {}
    for vid, t in prog.externals:
        reg_of[id(t._local_dense())] = prog.values[vid].reg
        ext_of_reg[prog.values[vid].reg] = t

    def ref(t: Tensor):
        """How tensor ``t`` is found after a replay."""
        for k, a in enumerate(tensors):
            if a is t:
                return ("arg", k)
        reg = reg_of.get(id(t._local_dense()))
        if reg is None:  # never touched by the program (a constant made before the step)
            return ("tensor", t)
        if reg in ext_of_reg:  # a parameter or state itself (updated in place)
            return ("tensor", ext_of_reg[reg])
        return prog.reg_value[reg]

    def conv(x):
        if isinstance(x, Tensor):
            return ("value", ref(x))
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, [conv(y) for y in x])
        if isinstance(x, dict):
            return ("dict", {k: conv(y) for k, y in x.items()})
        return ("const", x)
    prog.result = conv(result)
    for t, before in cap.grads.values():
        if t.grad is not before:
            target = next((("arg", k) for k, a in enumerate(tensors) if a is t), ("ext", t))
            prog.grads.append((target, None if t.grad is None else ref(t.grad)))
    entry = {id(t): before for t, before in cap.grads.values()}  # .grad when the step began
    prog.guards = [(t, t._value, tuple(t._value.shape), np.dtype(t.dtype), _layout_key(t),
                    entry.get(id(t), t.grad) is None) for _, t in prog.externals]
    owner = {id(before): t for t, before in cap.grads.values() if before is not None}
    prog.entry_grads = [(prog.values[vid].reg, owner[id(g)]) for vid, g in prog.externals
                        if id(g) in owner]


def _layout_key(t: Tensor):
    v = t._value
    return (id(v.mesh), id(v.dist_attr)) if type(v) is DistTensor else None


def _tensor_leaves(tree) -> list:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _tensor_leaves(t)]
    if isinstance(tree, dict):
        return [x for t in tree.values() for x in _tensor_leaves(t)]
    return []


def _stale(prog: Program) -> str | None:
    """Why the program cannot be replayed now (None: it can): it made lasting state, or the
    tensors it reads by reference no longer fit it."""
    if prog.provisional:
        return prog.provisional
    for k, (t, value, shape, dtype, layout, grad_none) in enumerate(prog.guards):
        if t._value is not value:  # value objects never change: compare only a new one
            if tuple(t._value.shape) != shape or np.dtype(t.dtype) != dtype \
                    or _layout_key(t) != layout:
                return f"tensor {t._label()} changed shape, dtype or layout"
            prog.guards[k] = (t, t._value, shape, dtype, layout, grad_none)
        if (t.grad is None) != grad_none:
            return f"tensor {t._label()} {'has' if grad_none else 'lost'} a gradient at entry"
    return None


def _wrap(prog: Program, vid: int, arr) -> Tensor:
    v = prog.values[vid]
    if v.layout is None:
        return dispatch.wrap_array(arr)
    mesh, attr = v.layout
    return dispatch.wrap_array(arr, mesh, attr, v.shape)


def _replay(prog: Program, args: tuple, kwargs: dict) -> Any:
    tensors, _, _, _ = _flatten_args(args, kwargs)
    fwd, bwd = prog.split()
    regs: dict[int, Any] = {reg: t._local_array() for reg, t in zip(prog.data_regs, tensors)}
    regs.update((reg, t._local_array()) for reg, t in prog.external_regs)
    regs.update((reg, t.grad._local_array()) for reg, t in prog.entry_grads)
    for sub in (fwd, bwd):
        regs.update(zip(sub.out_regs, sub.fn(regs)))
        flush_data_checks()  # data checks agree before the backward (and update) and the results
    for t, n in prog.version_bumps:
        t._local_dense().holder.version += n

    def get(ref):
        kind = ref[0] if isinstance(ref, tuple) else "vid"
        if kind == "arg":
            return tensors[ref[1]]
        if kind == "tensor":
            return ref[1]
        arr = regs[prog.values[ref].reg]
        if prog.arena is not None and arr.base is not None and dispatch.xp_of(arr) \
                .may_share_memory(arr, prog.arena):  # an undeclared alias of a planned buffer
            arr = arr.copy()
        return _wrap(prog, ref, arr)

    def build(node):
        kind, x = node
        if kind == "value":
            return get(x)
        if kind == "const":
            return x
        if kind == "dict":
            return {k: build(y) for k, y in x.items()}
        return (tuple if kind == "tuple" else list)(build(y) for y in x)
    for target, ref in prog.grads:
        t = tensors[target[1]] if target[0] == "arg" else target[1]
        t.grad = None if ref is None else get(ref)
    return build(prog.result)


def _memory_scope(plan_memory: bool | str) -> str | None:
    scope = {True: "kernels", False: None, "kernels": "kernels", "all": "all"}.get(plan_memory, "?")
    if scope == "?":
        raise ValueError(f"to_static: argument 'plan_memory'={plan_memory!r}: expected "
                         f"'kernels', 'all' or False")
    return scope


def to_static(fn: Callable | Any = None, *args: Any, plan_memory: bool | str = "kernels",
              recompute: bool = False, **kwargs: Any):
    """Capture ``fn`` (a step function, or a Layer's forward) into a program replayed on later
    calls (:class:`StaticFunction`). With Paddle's signature ``to_static(layer, loader, loss,
    optimizer)`` it returns a :class:`DistModel`. ``plan_memory``: ``"kernels"`` (the default)
    replays with every temporary whose kernel takes ``out=`` in a planned arena; ``"all"`` places
    every temporary there (the others copied in once); False allocates per kernel call as eager mode
    does (:meth:`Program.memory_report`). ``recompute=True`` runs cheap forward ops (elementwise
    math, activations, layer_norm) again in the backward where that lets their outputs die at
    the end of the forward (:mod:`disttensor.jit.remat`): less memory, a little more work."""
    if isinstance(fn, Layer) and (args or kwargs):
        return DistModel(fn, *args, **kwargs)
    if isinstance(fn, Layer):
        return StaticFunction(fn.__call__, type(fn).__name__, plan_memory, recompute)
    if not callable(fn):
        raise TypeError(f"to_static: expected a function or a Layer, got {type(fn).__name__}")
    return StaticFunction(fn, plan_memory=plan_memory, recompute=recompute)


#: builders of a whole training step for strategy sections DistModel does not run itself:
#: ``build(layer, loss, optimizer, strategy)`` returns a ``step(inputs, labels)`` callable, or
#: None when the strategy does not ask for it (``disttensor.pipelining`` registers the
#: pipeline's, so this module needs no import of the layers above it)
STEP_BUILDERS: list[Callable] = []


class DistModel:
    """Paddle's ``dist.to_static(layer, loader, loss, optimizer)`` result: ``train()``,
    ``eval()`` and ``predict()`` modes, each captured on first use; ``model(inputs, labels)`` runs
    one step and returns the loss (train: forward, backward, optimizer step and
    ``clear_grad``; eval: forward and loss without gradients), ``model(inputs)`` in predict
    mode returns the outputs."""

    def __init__(self, layer, loader=None, loss=None, optimizer=None, strategy=None,
                 input_spec=None):
        self.layer, self.loss, self.optimizer = layer, loss, optimizer
        self._merge = gradient_merge_config(strategy)  # (k_steps, avg): micro-batches a step
        self._steps = {"train": StaticFunction(self._train_step, "train_step"),
                       "eval": StaticFunction(self._eval_step, "eval_step"),
                       "predict": StaticFunction(self._predict_step, "predict_step")}
        self._mode = "train" if loss is not None and optimizer is not None else \
            ("eval" if loss is not None else "predict")
        self._pipeline = next((step for step in (build(layer, loss, optimizer, strategy)
                                                 for build in STEP_BUILDERS) if step), None)

    def train(self) -> "DistModel":
        if self.loss is None or self.optimizer is None:
            raise ValueError("DistModel.train: needs both loss and optimizer")
        self.layer.train()
        self._mode = "train"
        return self

    def eval(self) -> "DistModel":
        if self.loss is None:
            raise ValueError("DistModel.eval: needs a loss")
        self.layer.eval()
        self._mode = "eval"
        return self

    def predict(self) -> "DistModel":
        self.layer.eval()
        self._mode = "predict"
        return self

    def _train_step(self, inputs, labels):
        return merged_step(self.layer, self.optimizer, lambda x, y: self.loss(self.layer(x), y),
                           inputs, labels, *self._merge)

    def _eval_step(self, inputs, labels):
        with no_grad():
            return self.loss(self.layer(inputs), labels)

    def _predict_step(self, inputs):
        with no_grad():
            return self.layer(inputs)

    def state_dict(self, mode: str = "all") -> dict:
        """The live tensors to checkpoint, as Paddle's ``DistModel.state_dict``: the layer's
        state dict (``mode="param"``), the optimizer's (``"opt"``) or both in one flat dict
        (``"all"``), ready for ``dt.save_state_dict(dist_model.state_dict(), path)``."""
        if mode not in ("all", "param", "opt"):
            raise ValueError(f"DistModel.state_dict: mode must be 'all', 'param' or 'opt', "
                             f"got {mode!r}")
        out = dict(self.layer.state_dict()) if mode != "opt" else {}
        if mode != "param" and self.optimizer is not None:
            opt = self.optimizer.state_dict()
            clash = sorted(set(out) & set(opt))
            if clash:
                raise ValueError(f"DistModel.state_dict: keys {clash} name both a layer "
                                 "tensor and an optimizer state")
            out.update(opt)
        return out

    def set_state_dict(self, state_dict: Mapping) -> None:
        """Load a dict shaped like :meth:`state_dict` (e.g. filled by ``dt.load_state_dict``):
        the layer's keys go to ``layer.set_state_dict``, the others to the optimizer's
        ``set_state_dict``. Without an optimizer, a key the layer lacks raises ValueError."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"DistModel.set_state_dict: expected a dict, got "
                            f"{type(state_dict).__name__}")
        own = self.layer.state_dict()
        layer_part = {k: v for k, v in state_dict.items() if k in own}
        rest = {k: v for k, v in state_dict.items() if k not in own}
        if rest and self.optimizer is None:
            raise ValueError(f"DistModel.set_state_dict: keys {sorted(rest)} are not the "
                             "layer's, and there is no optimizer to take them")
        if layer_part:
            self.layer.set_state_dict(layer_part)
        if rest:
            self.optimizer.set_state_dict(rest)

    @property
    def program(self) -> Program | None:
        """The program of the current mode (None before its first call)."""
        return self._steps[self._mode].program

    def __call__(self, inputs, labels=None):
        if self._mode == "predict":
            return self._steps["predict"](inputs)
        if labels is None:
            raise ValueError(f"DistModel ({self._mode} mode): labels are required")
        if self._mode == "train" and self._pipeline is not None:
            return self._pipeline(inputs, labels)
        return self._steps[self._mode](inputs, labels)
