"""The seam: every call that creates, moves or mutates a tensor passes here.

A call is *planned*, then *executed*:

* :func:`apply` runs a registered op. All-dense inputs use the op's cached dense plan (one
  ``kernel`` instruction whose attrs are the call's); any distributed input asks
  :func:`disttensor.layout.planner.plan_call` for a plan (reshard instructions, the kernel
  with local attrs and context, write-backs, alias edges), cached by (op, input layouts, shapes,
  dtypes, attrs) in a bounded cache.
* :func:`apply_inplace` runs an op's ``op_`` variant: the same plan with the result stored
  into the target input (or written there directly by an ``out=`` kernel).
* :func:`run` executes any plan — including those of the entry points that plan themselves
  (``reshard``, ``shard_tensor``, ``dtensor_from_local``, ... in
  :mod:`disttensor.distributed.api`) — and is the one place that creates holders, bumps version
  counters for the inputs a plan writes, records grad nodes and tells recorders
  (:func:`disttensor.jit.record`) what ran.

The eager interpreter has a fast path for plans that are a single kernel instruction; it does
exactly what interpreting that instruction does.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from spmd_rules import DistAttr

from .layout.dist_tensor import DistTensor
from .layout.planner import describe_inputs, plan_call
from .plan import CallRecord, Instr, OutSpec, Plan
from .schema import DENSE_CTX, OPS, OpDef
from .tape import _GradMode, record, set_grad_enabled
from .tensor import DenseTensor, Holder, Tensor

__all__ = ["apply", "apply_inplace", "run", "check_inplace_target", "add_recorder",
           "remove_recorder", "add_write_watcher", "remove_write_watcher", "host_read",
           "wrap_array",
           "note_undo", "plan_cache_info", "clear_plan_cache", "xp_of", "resolve_place",
           "dense_plan", "set_amp_policy"]

#: callbacks ``f(CallRecord)`` told about every executed call (see disttensor.jit.record)
_recorders: list[Callable[[CallRecord], None]] = []
#: callbacks ``f(plan, inputs)`` told before a plan writes into its inputs' buffers (capture
#: uses it to undo a failed capture)
_watchers: list[Callable] = []


#: capture installs a guard here: a host read of tensor data (``numpy()``, ``item()``, a tensor
#: in an ``if``) cannot be part of a captured program
_host_read_guard: list[Callable[[str], None]] = []


#: the autocast policy ``f(op, inputs) -> inputs`` while a ``dt.amp.auto_cast`` block runs
#: (:mod:`disttensor.amp`): the inputs the op runs on, cast by ordinary ``cast`` calls
_amp_policy: Callable | None = None


def set_amp_policy(policy: Callable | None) -> Callable | None:
    """Install the autocast policy (None: none); returns the previous one."""
    global _amp_policy
    prev, _amp_policy = _amp_policy, policy
    return prev


#: capture installs a list here: objects that create lasting state lazily (an optimizer's
#: moments) note how to forget it, so a failed capture leaves them as they were
_undo_log: list[list[Callable[[], None]]] = []


def note_undo(fn: Callable[[], None]) -> None:
    """Inside a capture, remember ``fn`` to run if the capture fails (no-op otherwise)."""
    for log in _undo_log:
        log.append(fn)


def host_read(what: str) -> None:
    """Called before tensor data is copied to Python (``Tensor.numpy()`` and what builds on
    it); raises inside a capture."""
    for guard in _host_read_guard:
        guard(what)


def add_recorder(fn: Callable[[CallRecord], None]) -> None:
    _recorders.append(fn)


def remove_recorder(fn: Callable[[CallRecord], None]) -> None:
    _recorders.remove(fn)


def add_write_watcher(fn: Callable) -> None:
    _watchers.append(fn)


def remove_write_watcher(fn: Callable) -> None:
    _watchers.remove(fn)


def xp_of(arr):
    """numpy for numpy arrays, cupy for cupy arrays."""
    if type(arr) is np.ndarray or isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def resolve_place(place: str | None):
    """(array module, device id) for a place string: "cpu" -> numpy, "gpu"/"gpu:N" -> cupy."""
    if place is None or place == "cpu":
        return np, None
    if isinstance(place, str) and (place == "gpu" or place.startswith("gpu:")):
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on machine
            raise ValueError(f"place={place!r} needs cupy, which is not installed") from e
        return cupy, int(place.split(":")[1]) if ":" in place else 0
    raise ValueError(f"place must be 'cpu', 'gpu' or 'gpu:N', got {place!r}")


# -- dense plans -----------------------------------------------------------------------------

def dense_plan(op: OpDef, n_in: int, view: bool = True, inplace: tuple | None = None) -> Plan:
    """The cached plan of a dense call: the kernel taking the call's attrs (its instructions'
    functions are ``fn(xp, attrs, *arrays)``); an inplace call stores the result into the
    target, or has an ``out=`` kernel write it there."""
    key = (n_in, view, inplace)
    plan = op.plans.get(key)
    if plan is not None:
        return plan
    n_out = op.n_out
    outs = tuple(range(n_in, n_in + max(n_out, 1)))
    mutated = dict((o, i) for i, o in op.mutates)
    writes = set(mutated.values())
    args = tuple(range(n_in))
    if inplace is not None and op.accepts_out and n_out == 1:
        ti = inplace[0]
        instrs = (Instr("kernel", _dense_kernel_out(op, ti), args, (ti,), writes=(ti,),
                        label=f"{op.name} (out=input {ti})"),)
        outs = (ti,)
        writes.add(ti)
    else:
        instrs = (Instr("kernel", _dense_kernel(op), args, outs,
                        writes=tuple(sorted(writes)), label=op.name),)
        if inplace is not None:
            ti, to = inplace
            instrs += (Instr("store", _store_checked(op, ti), (outs[to],), (), writes=(ti,),
                             label=f"write into input {ti}"),)
            writes.add(ti)
    if inplace is not None:
        mutated[inplace[1]] = inplace[0]
    specs = []
    for o, slot in enumerate(outs):
        src = op.view_source(o)
        is_input = mutated.get(o)
        specs.append(OutSpec(is_input if is_input is not None else slot, None, None,
                             view_of=src if src is not None and view and is_input is None
                             else None, is_input=is_input))
    plan = op.plans[key] = Plan(op, "dense", n_in, instrs, tuple(specs),
                                writes=tuple(sorted(writes)))
    return plan


def _dense_kernel(op: OpDef):
    kernel = op.kernel
    if op.needs_ctx:
        def fn(xp, attrs, *arrays):
            return kernel(xp, *arrays, ctx=DENSE_CTX, **attrs)
    else:
        def fn(xp, attrs, *arrays):
            return kernel(xp, *arrays, **attrs)
    return fn


def _dense_kernel_out(op: OpDef, target: int):
    kernel = op.kernel

    def fn(xp, attrs, *arrays):
        return kernel(xp, *arrays, out=arrays[target], **attrs)
    return fn


def _store_checked(op: OpDef, target: int):
    """Write a dense result into the inplace target after checking its shape."""
    def store(dst, src):
        if tuple(np.shape(src)) != tuple(dst.shape):
            raise ValueError(f"{op.name}_: the result shape {list(np.shape(src))} differs from "
                             f"the shape {list(dst.shape)} of the tensor modified inplace")
        dst[...] = src
    return store


# -- distributed plans ------------------------------------------------------------------------

_PLANS: OrderedDict = OrderedDict()  # LRU; keys hold interned meshes/layouts by identity
PLAN_CACHE_LIMIT = 8192


def plan_cache_info() -> dict:
    """Size and limit of the distributed plan cache (a debugging aid)."""
    return {"size": len(_PLANS), "limit": PLAN_CACHE_LIMIT}


def clear_plan_cache() -> None:
    _PLANS.clear()


def _freeze(v: Any):
    if isinstance(v, dict):
        return tuple((k, _freeze(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    return v


def _dist_plan(op: OpDef, inputs: tuple, attrs: dict, inplace: tuple | None) -> Plan:
    """The cached plan of a call with a distributed input; one pass over the inputs builds the
    key (interned meshes and layouts are keyed by identity)."""
    mesh = None
    parts = []
    for t in inputs:
        if t is None:
            parts.append(None)
            continue
        v = t._value
        if type(v) is DistTensor:
            if mesh is None:
                mesh = v.mesh
            elif v.mesh is not mesh:
                raise ValueError(
                    f"{op.name}: inputs live on different meshes {mesh} and {v.mesh}; reshard "
                    f"them onto one mesh first ({describe_inputs(inputs)})")
            parts.append((v.shape, id(v.dist_attr), v.dtype))
        else:
            parts.append((v.array.shape, v.array.dtype))
    strides = None
    if op.view_if is not None:
        arr = inputs[0]._local_array()
        strides = (arr.shape, arr.strides)
    key = (op, id(mesh), tuple(parts), tuple(attrs.items()) if attrs else (), inplace, strides)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # unhashable attrs (slices, lists)
        key = key[:3] + (_freeze(attrs), inplace, strides)
        plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
    else:
        plan = plan_call(op, inputs, attrs, mesh, inplace=inplace, strides=strides)
        # the key holds ids: keep the objects alive as long as the plan is cached
        plan.keep = (mesh, [t._value.dist_attr for t in inputs if t is not None and t.is_dist()])
        if len(_PLANS) >= PLAN_CACHE_LIMIT:
            _PLANS.popitem(last=False)  # evict the least recently used plan
        _PLANS[key] = plan
    return plan


# -- execution --------------------------------------------------------------------------------

def apply(op: OpDef, inputs: tuple, attrs: dict) -> Any:
    """Run ``op`` on ``inputs`` (Tensors or None) with keyword ``attrs``; returns Tensor(s)."""
    if _amp_policy is not None:
        inputs = _amp_policy(op, inputs)
    arrays = []
    first = None
    for t in inputs:
        if t is None:
            arrays.append(None)
            continue
        v = t._value
        if type(v) is not DenseTensor:
            return _apply_dist(op, inputs, attrs)
        if first is None:
            first = v.array
        arrays.append(v.array)
    if op.strict_dtypes:  # the dtype rule may refuse a mix of dtypes (one dtype never is)
        d0 = first.dtype if first is not None else None
        for a in arrays:
            if a is not None and a.dtype is not d0 and a.dtype != d0:
                op.out_dtypes([None if a is None else a.dtype for a in arrays], attrs,
                              [None if a is None else a.shape for a in arrays])
                break
    plan = op.plan0
    if plan is None or plan.n_in != len(inputs):  # variadic ops: one plan per input count
        plan = dense_plan(op, len(inputs), op.view_if(first.shape, first.strides, attrs)
                          if op.view_if is not None and first is not None else True)
        if op.view_if is None:
            op.plan0 = plan
    if not plan.fast or first is None:
        return run(plan, inputs, attrs)
    xp = np if type(first) is np.ndarray else xp_of(first)
    res = op.kernel(xp, *arrays, ctx=DENSE_CTX, **attrs) if op.needs_ctx else \
        op.kernel(xp, *arrays, **attrs)
    if type(res) is not np.ndarray and isinstance(res, np.generic):
        res = np.asarray(res)
    src = plan.view0
    if src is None:
        out = Tensor(DenseTensor(res))
    else:
        out = Tensor(DenseTensor(res, inputs[src]._value.holder))
        out._is_view = True
    return _finish(op, plan, attrs, inputs, out, xp)


def _finish(op: OpDef, plan: Plan, attrs: dict, inputs: tuple, out: Tensor, xp) -> Tensor:
    """The fast paths' epilogue: tell recorders, record the grad node."""
    if _recorders:
        _tell(plan, attrs, inputs, (out,), xp)
    if _GradMode.enabled and op.backward is not None:
        for t in inputs:
            if t is not None and not t.stop_gradient:
                record(op, attrs, inputs, (out,))
                break
    return out


def _apply_dist(op: OpDef, inputs: tuple, attrs: dict) -> Any:
    """A call with a distributed input; a plan that is one single-output kernel instruction
    writing nothing runs on the fast path (exactly what interpreting it does)."""
    plan = _dist_plan(op, inputs, attrs, None)
    if not plan.fast:
        return run(plan, inputs, attrs)
    arrays = []
    for t in inputs:
        if t is None:
            arrays.append(None)
        else:
            v = t._value
            arrays.append(v.local.array if type(v) is DistTensor else v.array)
    first = arrays[0] if arrays[0] is not None else next(a for a in arrays if a is not None)
    xp = np if type(first) is np.ndarray else xp_of(first)
    res = plan.kernel.fn(xp, *arrays)
    if type(res) is not np.ndarray and isinstance(res, np.generic):
        res = np.asarray(res)
    spec = plan.outputs[0]
    src = plan.view0
    if src is None:
        dense = DenseTensor(res)
    else:
        v = inputs[src]._value
        dense = DenseTensor(res, (v.local if type(v) is DistTensor else v).holder)
    out = Tensor(DistTensor(dense, plan.mesh, spec.dist_attr, spec.shape))
    if src is not None:
        out._is_view = True
    return _finish(op, plan, attrs, inputs, out, xp)


def check_inplace_target(op: OpDef, x: Tensor) -> None:
    """The leaf rule (a leaf that needs grad is never written in place), checked before
    anything is modified."""
    if _GradMode.enabled and x._node is None and not x.stop_gradient:
        raise ValueError(f"Leaf Var ({x._label()}) that doesn't stop gradient can't use inplace "
                         f"strategy. (op {op.name}_)")


def apply_inplace(op: OpDef, inputs: tuple, attrs: dict) -> Tensor:
    """Run the inplace variant ``op_``: the result is written into the target input, which is
    returned itself (same object, holder, mesh and placements) with its version bumped; its grad
    node becomes this op's node."""
    pair = op.inplace[0]
    ti, to = pair
    x = inputs[ti]
    check_inplace_target(op, x)
    needs_grad = _GradMode.enabled and op.backward is not None and any(
        t is not None and not t.stop_gradient for t in inputs)
    if needs_grad and x._is_view:
        raise ValueError(f"{op.name}_: inplace update of a view that needs grad is not supported "
                         "(the gradient could not reach the viewed base); apply the op to the "
                         "base tensor or use the out-of-place op")
    if any(t is not None and type(t._value) is DistTensor for t in inputs):
        plan = _dist_plan(op, inputs, attrs, pair)
    else:
        if op.accepts_out and op.rule == "elementwise":
            # an out= kernel writes x: the broadcast result must have x's shape
            shapes = [tuple(t._value.shape) for t in inputs if t is not None]
            try:
                res_shape = np.broadcast_shapes(*shapes)
            except ValueError:
                res_shape = None
            if res_shape != tuple(x._value.shape):
                raise ValueError(f"{op.name}_: the inputs' shapes {[list(s) for s in shapes]} do "
                                 f"not give the shape {x.shape} of the tensor modified inplace")
        plan = dense_plan(op, len(inputs), inplace=pair)
    out = run(plan, inputs, attrs, needs_grad=needs_grad, inplace=pair)
    return out[to] if op.n_out != 1 else out


def run(plan: Plan, inputs: tuple, attrs: dict, needs_grad: bool | None = None,
        inplace: tuple | None = None) -> Any:
    """Execute ``plan`` on ``inputs`` and return its output Tensor(s) (see the module docstring).

    ``inplace`` (an ``op_`` call): the target output is the input tensor itself and its grad
    node is re-pointed; ``needs_grad`` overrides the decision to record a grad node."""
    op = plan.op
    slots: list = [None] * plan.n_slots
    holders: dict = {}
    xp = None
    grad_in = False  # an input needs grad
    for i, t in enumerate(inputs):
        if t is not None:
            v = t._value
            d = v if type(v) is DenseTensor else v.local
            a = slots[i] = d.array
            holders[i] = d.holder
            if xp is None:
                xp = np if type(a) is np.ndarray else xp_of(a)
            if not t.stop_gradient:
                grad_in = True
    dev = None
    if xp is None:  # a creation op: its place attr picks the array module and device
        xp, dev = resolve_place(attrs.get("place"))
    if inplace is not None:
        _check_inplace_dtype(op, plan, inputs, attrs, inplace)
    node = None
    if needs_grad is None:
        needs_grad = grad_in and _GradMode.enabled and op.backward is not None
    if inplace is not None and needs_grad:
        # recorded before the write, so saved inputs carry their old version
        node = record(op, attrs, inputs, [None] * len(plan.outputs))
        if inplace[0] in op.save_inputs:
            _save_old_target(node, op, inputs, inplace[0])
    if _watchers and plan.writes:
        for fn in list(_watchers):
            fn(plan, inputs)
    if dev is None:
        _interpret(plan, slots, attrs, xp)
    else:
        with xp.cuda.Device(dev):
            _interpret(plan, slots, attrs, xp)
    for i in plan.writes:
        holders[i].version += 1
    outs = _wrap(plan, slots, holders, inputs)
    if inplace is not None:
        x = inputs[inplace[0]]
        if node is not None:
            if inplace[1] in op.save_outputs:
                node.save(x)
            x._node, x._slot, x.stop_gradient = node, inplace[1], False
    elif needs_grad:
        record(op, attrs, inputs, outs)
    if _recorders:
        _tell(plan, attrs, inputs, tuple(outs), xp, slots)
    return outs[0] if len(outs) == 1 and op.n_out == 1 else tuple(outs)


def _save_old_target(node, op: OpDef, inputs: tuple, ti: int) -> None:
    """``op_`` saves its target, whose value the write replaces: where another input needs
    grad, save a copy made by the copy op (so a recorded step has it) instead, as PyTorch
    saves the original self (multiply_ and divide_ read it only for the other operand's
    gradient; a backward that still reads the overwritten target raises the version error)."""
    if all(e is None for i, e in enumerate(node.edges) if i != ti):
        return
    with set_grad_enabled(False):
        old = apply(OPS["scale"], (inputs[ti],), {"scale": 1.0, "bias": 0.0,
                                                  "bias_after_scale": True})
    node.save(old, at=op.save_inputs.index(ti))


def _check_inplace_dtype(op: OpDef, plan: Plan, inputs: tuple, attrs: dict, pair) -> None:
    """Refuse a result dtype that cannot be cast to the target's (as PyTorch does)."""
    ti, to = pair
    target = np.dtype(inputs[ti].dtype)
    spec = plan.outputs[to]
    res = spec.dtype if spec.dtype is not None else op.out_dtypes(
        [None if t is None else t.dtype for t in inputs], attrs)[to]
    if not np.can_cast(res, target, casting="same_kind"):
        raise TypeError(f"{op.name}_: result type {np.dtype(res).name} can't be cast to the "
                        f"desired output type {target.name} of the tensor modified inplace")


def _interpret(plan: Plan, slots: list, attrs: dict, xp) -> None:
    """Run the plan's instructions over ``slots`` (dense plans' kernels take the call's
    attrs)."""
    dense = plan.kind == "dense"
    for ins in plan.instrs:
        kind = ins.kind
        if kind == "kernel":
            args = [slots[i] for i in ins.ins]
            res = ins.fn(xp, attrs, *args) if dense else ins.fn(xp, *args)
            _assign(slots, ins.outs, res)
        elif kind in ("collective", "local"):
            slots[ins.outs[0]] = ins.fn(slots[ins.ins[0]])
        elif kind == "store":
            ins.fn(slots[ins.writes[0]], slots[ins.ins[0]])
        else:  # empty
            _assign(slots, ins.outs, ins.fn(xp, *[slots[i] for i in ins.ins]))


def _assign(slots: list, outs: tuple, res) -> None:
    if len(outs) == 1 and not isinstance(res, tuple):
        slots[outs[0]] = res
        return
    if len(res) != len(outs):  # a variable output count (split)
        slots.extend([None] * (outs[0] + len(res) - len(slots)))
        outs = tuple(range(outs[0], outs[0] + len(res)))
    for s, r in zip(outs, res):
        slots[s] = r


def _wrap(plan: Plan, slots: list, holders: dict, inputs: tuple) -> list:
    """The output Tensors: fresh holders for new values, shared holders for views, the input
    tensors themselves for inplace and mutated outputs."""
    outs = []
    specs = plan.outputs
    if plan.op.n_out == -1 and plan.kind != "dist":  # dense split: as many outputs as results
        first = specs[0].slot
        specs = [OutSpec(first + k, None, None, view_of=specs[0].view_of)
                 for k in range(len(slots) - first)]
    dist = plan.kind == "dist"
    for spec in specs:
        if spec.is_input is not None:
            outs.append(inputs[spec.is_input])
            continue
        arr = slots[spec.slot]
        if type(arr) is not np.ndarray and isinstance(arr, np.generic):
            arr = np.asarray(arr)
        src = spec.view_of
        if src is not None:
            holder = holders.get(src)
            if holder is None:
                holder = holders[src] = Holder(slots[src])
            dense = DenseTensor(arr, holder)
        else:
            dense = DenseTensor(arr)
        if dist:
            shape = spec.shape if spec.shape is not None else np.shape(arr)
            attr = spec.dist_attr
            if attr is None:  # the fallback rule: replicated outputs
                attr = DistAttr.replicated(len(shape), plan.mesh.shape)
            t = Tensor(DistTensor(dense, plan.mesh, attr, shape))
        else:
            t = Tensor(dense)
        if src is not None:
            t._is_view = True
        outs.append(t)
    return outs


def wrap_array(arr, mesh=None, dist_attr=None, shape=None) -> Tensor:
    """A tensor around an array a replayed program computed (its own holder): dense, or this
    rank's piece of a tensor of global ``shape`` laid out as ``dist_attr`` on ``mesh``."""
    if type(arr) is not np.ndarray and isinstance(arr, np.generic):
        arr = np.asarray(arr)
    if mesh is None:
        return Tensor(DenseTensor(arr))
    return Tensor(DistTensor(DenseTensor(arr), mesh, dist_attr, shape))


def _tell(plan: Plan, attrs: dict, inputs: tuple, outs: tuple, xp,
          slots: list | None = None) -> None:
    metas = None if slots is None else [
        (tuple(a.shape), a.dtype) if hasattr(a, "dtype") else None for a in slots]
    rec = CallRecord(plan, attrs, inputs, outs, xp, metas)
    for fn in list(_recorders):
        fn(rec)
