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

A plan runs only as its compiled form (``Plan.fn``, :func:`disttensor.plan.compile_plan`): one
generated straight-line function per plan, the same pieces a captured program's step is
generated from.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from spmd_rules import DistAttr

from .layout.dist_tensor import DistTensor
from .layout.planner import describe_inputs, plan_call
from .plan import CallRecord, Instr, OutSpec, Plan, as_array
from .schema import DENSE_CTX, OPS, OpDef
from .tape import _GradMode, record, set_grad_enabled
from .tensor import DenseTensor, Holder, Tensor

__all__ = ["apply", "apply_inplace", "run", "check_inplace_target", "Observer", "add_observer",
           "remove_observer", "host_read", "wrap_array", "note_undo", "plan_cache_info",
           "clear_plan_cache", "xp_of", "resolve_place", "dense_plan", "set_amp_policy"]

#: the autocast policy ``f(op, inputs, attrs) -> inputs`` while a ``dt.amp.auto_cast`` block
#: runs (:mod:`disttensor.amp`): the inputs the op runs on, cast by ordinary ``cast`` calls, or
#: (not a tuple) the op's result when the policy ran the op itself
_amp_policy: Callable | None = None


def set_amp_policy(policy: Callable | None) -> Callable | None:
    """Install the autocast policy (None: none); returns the previous one."""
    global _amp_policy
    prev, _amp_policy = _amp_policy, policy
    return prev


class Observer:
    """What the seam tells an observer (:func:`add_observer`); each method does nothing
    unless overridden. :func:`disttensor.jit.record` and ``to_static``'s capture are
    observers."""

    #: whether :meth:`on_host_read` refuses every host read (a capture does): code that would
    #: read a value on the host asks :func:`host_reads_refused` and takes another path
    refuses_host_reads: bool = False

    def on_call(self, record: CallRecord) -> None:
        """A call ran (after its outputs exist)."""

    def before_write(self, plan: Plan, inputs: tuple) -> None:
        """``plan`` is about to write into the buffers of ``inputs[i]`` for i in
        ``plan.writes``."""

    def on_host_read(self, what: str) -> None:
        """Tensor data is about to be copied to Python (``numpy()``, ``item()``, ...); may
        raise to refuse it."""

    def on_lasting_state(self, undo: Callable[[], None]) -> None:
        """An object created state that outlives the call lazily (an optimizer's moments);
        ``undo`` forgets it."""


#: the observers told about every call, write, host read and lasting state
_observers: list[Observer] = []


def add_observer(obs: Observer) -> None:
    _observers.append(obs)


def remove_observer(obs: Observer) -> None:
    _observers.remove(obs)


def note_undo(fn: Callable[[], None]) -> None:
    """Tell the observers that lasting state was made, which ``fn`` forgets."""
    for obs in list(_observers):
        obs.on_lasting_state(fn)


def host_read(what: str) -> None:
    """Called before tensor data is copied to Python (``Tensor.numpy()`` and what builds on
    it); an observer may refuse it (a capture raises)."""
    for obs in list(_observers):
        obs.on_host_read(what)


def host_reads_refused() -> bool:
    """Whether an observer refuses host reads now (a capture is running)."""
    return any(obs.refuses_host_reads for obs in _observers)


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
    """The cached plan of a dense call: the kernel taking the call's attrs; an inplace call
    stores the result into the target, or has an ``out=`` kernel write it there."""
    key = (n_in, view, inplace)
    plan = op.plans.get(key)
    if plan is not None:
        return plan
    n_out = op.n_out
    outs = tuple(range(n_in, n_in + max(n_out, 1)))
    mutated = dict((o, i) for i, o in op.mutates)
    writes = set(mutated.values())
    args = tuple(range(n_in))
    ctx = DENSE_CTX if op.needs_ctx else None
    if inplace is not None and op.accepts_out and n_out == 1:
        ti = inplace[0]
        instrs = (Instr("kernel", op.kernel, args, (ti,), writes=(ti,), ctx=ctx, out_arg=ti,
                        label=f"{op.name} (out=input {ti})"),)
        outs = (ti,)
        writes.add(ti)
    else:
        instrs = (Instr("kernel", op.kernel, args, outs, writes=tuple(sorted(writes)), ctx=ctx,
                        label=op.name, accepts_out=op.accepts_out),)
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
        inputs = _amp_policy(op, inputs, attrs)
        if type(inputs) is not tuple:  # the policy ran the op itself
            return inputs
    arrays = []
    first = None
    dist = False
    for t in inputs:
        if t is None:
            arrays.append(None)
            continue
        v = t._value
        if type(v) is DenseTensor:
            a = v.array
        else:
            a, dist = v.local.array, True
        if first is None:
            first = a
        arrays.append(a)
    if dist:
        return _execute(_dist_plan(op, inputs, attrs, None), inputs, arrays, first, attrs)
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
    return _execute(plan, inputs, arrays, first, attrs)


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
    arrays = [None if t is None else t._local_dense().array for t in inputs]
    first = next((a for a in arrays if a is not None), None)
    return _execute(plan, inputs, arrays, first, attrs, needs_grad, inplace)


def _execute(plan: Plan, inputs: tuple, arrays: list, first, attrs: dict,
             needs_grad: bool | None = None, inplace: tuple | None = None) -> Any:
    """:func:`run` given the inputs' local arrays (``first``: the first present one): the
    compiled plan, version bumps, output Tensors, the grad node, the observers."""
    op = plan.op
    dev = None
    if first is not None:
        xp = np if type(first) is np.ndarray else xp_of(first)
    else:  # a creation op: its place attr picks the array module and device
        xp, dev = resolve_place(attrs.get("place"))
    if needs_grad is None:
        needs_grad = False
        if _GradMode.enabled and op.backward is not None:
            for t in inputs:
                if t is not None and not t.stop_gradient:
                    needs_grad = True
                    break
    node = None
    if inplace is not None:
        _check_inplace_dtype(op, plan, inputs, attrs, inplace)
        if needs_grad:
            # recorded before the write, so saved inputs carry their old version
            node = record(op, attrs, inputs, [None] * len(plan.outputs))
            if inplace[0] in op.save_inputs:
                _save_old_target(node, op, inputs, inplace[0])
    if _observers and plan.writes:
        for obs in list(_observers):
            obs.before_write(plan, inputs)
    if dev is None:
        slots = plan.fn(xp, attrs, *arrays)
    else:
        with xp.cuda.Device(dev):
            slots = plan.fn(xp, attrs, *arrays)
    for i in plan.writes:
        inputs[i]._local_dense().holder.version += 1
    spec = plan.single
    if spec is not None:  # one fresh output (most calls): _wrap without its loop
        arr = slots[spec.slot]
        if type(arr) is not np.ndarray:
            arr = as_array(arr)
        src = spec.view_of
        if src is None:
            dense = DenseTensor(arr)
        else:
            dense = DenseTensor(arr, _view_holder(src, slots, inputs, {}))
        out = Tensor(dense) if plan.kind == "dense" else \
            Tensor(DistTensor(dense, plan.mesh, spec.dist_attr, spec.shape))
        if src is not None:
            out._is_view = True
        outs = (out,)
    else:
        outs = _wrap(plan, slots, inputs)
    consumed = _consumed(plan, inputs, slots) if needs_grad and plan.consumed else None
    if inplace is not None:
        x = inputs[inplace[0]]
        if node is not None:
            for i, t in (consumed or {}).items():
                node.save(t, at=op.save_inputs.index(i))
            if inplace[1] in op.save_outputs:
                node.save(x)
            x._node, x._slot, x.stop_gradient = node, inplace[1], False
    elif needs_grad:
        record(op, attrs, inputs, outs, consumed)
    if _observers:
        _tell(plan, attrs, inputs, tuple(outs), xp, slots, consumed)
    return outs[0] if len(outs) == 1 and op.n_out == 1 else tuple(outs)


def _consumed(plan: Plan, inputs: tuple, slots: tuple) -> dict:
    """The resharded inputs the kernel read and the op saves for backward, as Tensors over
    their slots (sharing the input's holder: an inplace write to the input still invalidates
    them, as it would the input)."""
    saved = {}
    for i, slot, attr in plan.consumed:
        if i in plan.op.save_inputs:
            t = inputs[i]
            dense = DenseTensor(slots[slot], t._local_dense().holder)
            saved[i] = Tensor(DistTensor(dense, plan.mesh, attr, t._value.shape))
    return saved


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


def _wrap(plan: Plan, slots: tuple, inputs: tuple) -> list:
    """The output Tensors: fresh holders for new values, shared holders for views, the input
    tensors themselves for inplace and mutated outputs."""
    outs = []
    specs = plan.outputs
    if plan.op.n_out == -1 and plan.kind != "dist":  # dense split: as many outputs as results
        first = specs[0].slot
        specs = [OutSpec(first + k, None, None, view_of=specs[0].view_of)
                 for k in range(len(slots) - first)]
    made: dict = {}  # temporaries viewed: one holder each
    for spec in specs:
        if spec.is_input is not None:
            outs.append(inputs[spec.is_input])
            continue
        src = spec.view_of
        holder = None if src is None else _view_holder(src, slots, inputs, made)
        outs.append(_tensor(plan, spec, as_array(slots[spec.slot]), holder))
    return outs


def _view_holder(src: int, slots: tuple, inputs: tuple, made: dict) -> Holder:
    """The holder an output viewing slot ``src`` shares: the input's, or one made for the
    temporary (a reshard's result) that every view of it shares."""
    if src < len(inputs):
        return inputs[src]._local_dense().holder
    holder = made.get(src)
    if holder is None:
        holder = made[src] = Holder(slots[src])
    return holder


def _tensor(plan: Plan, spec: OutSpec, arr, holder: Holder | None) -> Tensor:
    dense = DenseTensor(arr, holder)
    if plan.kind == "dist":
        shape = spec.shape if spec.shape is not None else np.shape(arr)
        attr = spec.dist_attr
        if attr is None:  # the fallback rule: replicated outputs
            attr = DistAttr.replicated(len(shape), plan.mesh.shape)
        t = Tensor(DistTensor(dense, plan.mesh, attr, shape))
    else:
        t = Tensor(dense)
    if holder is not None:
        t._is_view = True
    return t


def wrap_array(arr, mesh=None, dist_attr=None, shape=None) -> Tensor:
    """A tensor around an array a replayed program computed (its own holder): dense, or this
    rank's piece of a tensor of global ``shape`` laid out as ``dist_attr`` on ``mesh``."""
    arr = as_array(arr)
    if mesh is None:
        return Tensor(DenseTensor(arr))
    return Tensor(DistTensor(DenseTensor(arr), mesh, dist_attr, shape))


def _tell(plan: Plan, attrs: dict, inputs: tuple, outs: tuple, xp,
          slots: tuple | None = None, consumed: dict | None = None) -> None:
    metas = None if slots is None else [
        (tuple(a.shape), a.dtype) if hasattr(a, "dtype") else None for a in slots]
    saved = {slot: consumed[i] for i, slot, _ in plan.consumed if i in consumed} \
        if consumed else None
    rec = CallRecord(plan, attrs, inputs, outs, xp, metas, saved)
    for obs in list(_observers):
        obs.on_call(rec)
