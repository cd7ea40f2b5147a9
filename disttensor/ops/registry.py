"""The op registry (one declarative entry per op, like Paddle's ops.yaml) and the dispatcher.

An :class:`OpDef` names everything the runtime needs to know about an op:

* ``kernel(xp, *arrays, **attrs)`` — written once against the array module ``xp`` (numpy or
  cupy); returns one array or a tuple of ``n_out`` arrays;
* ``backward(node, *out_grads)`` — returns one grad (or None) per input, built from registered
  ops so it dispatches like the forward; ``node.saved_tensor(i)`` gives the values listed in
  ``save_inputs`` then ``save_outputs``; ``node.attrs`` and ``node.in_shapes`` are at hand;
* ``rule`` — the name of its SPMD rule in :mod:`spmd_rules` (``"replicated"`` = the fallback);
* ``view`` — ``(input, output)`` pairs whose output shares the input's buffer and version counter
  (output ``-1``: every output, for ops with a variable output count like ``split``);
* ``inplace`` — the ``(input, output)`` pair of the ``op_`` variant: the output is written into
  the input, which is returned itself with its version bumped.

:func:`apply` runs an op. Dense inputs run the kernel directly; any distributed input sends the
call through :mod:`disttensor.distributed.dispatch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..autograd import _GradMode, record
from ..tensor import DenseTensor, Tensor

__all__ = ["OpDef", "register", "OPS", "apply", "apply_inplace", "grad_op_backward",
           "to_leaf_layout"]


@dataclass(eq=False)
class OpDef:
    name: str
    kernel: Callable
    backward: Callable | None = None
    rule: str = "replicated"
    n_out: int = 1
    save_inputs: tuple[int, ...] = ()
    save_outputs: tuple[int, ...] = ()
    view: tuple[tuple[int, int], ...] = ()
    inplace: tuple[int, int] | None = None
    nondiff_outputs: frozenset = frozenset()
    # Extra attrs for the rule: a dict, or a function of the op's attrs returning one.
    rule_attrs: dict | Callable = field(default_factory=dict)
    # Inputs that may carry gradients (None = all floating inputs); used by the grad checks.
    grad_inputs: tuple[int, ...] | None = None
    # Inputs the kernel writes into (batch_norm's running stats); their version is bumped.
    mutates: tuple[int, ...] = ()
    # The kernel takes ``ctx`` (a :class:`KernelCtx`) to learn its place in the global tensor
    # and to reduce partial statistics across ranks (batch_norm, cross_entropy, dropout, ...).
    needs_ctx: bool = False
    # Attributes given in global terms (reshape's target shape, a slice's bounds) converted to
    # this rank's local terms: ``local_attrs(attrs, in_metas, out_metas, coord) -> attrs``.
    local_attrs: Callable | None = None

    @property
    def differentiable(self) -> bool:
        return self.backward is not None


OPS: dict[str, OpDef] = {}


class KernelCtx:
    """What a ``needs_ctx`` kernel may ask about the global tensor its inputs are pieces of.

    This dense version answers for a single process (whole arrays, nothing to reduce); the
    distributed dispatcher passes one that answers for this rank's pieces.
    """

    def allreduce(self, arr, op: str, input_index: int, axes: tuple[int, ...]):
        """Reduce ``arr`` across the ranks that hold other pieces of ``axes`` of input
        ``input_index`` (identity here)."""
        return arr

    def offset(self, input_index: int, axis: int) -> int:
        """Global index of this piece's first element along ``axis`` of input ``input_index``."""
        return 0

    def global_shape(self, input_index: int, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of input ``input_index`` (given its local shape)."""
        return tuple(local_shape)


DENSE_CTX = KernelCtx()


def register(name: str, **spec: Any) -> Callable[[Callable], Callable]:
    """Decorator registering ``kernel`` as op ``name`` with the fields of :class:`OpDef`."""
    def deco(kernel: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"register: op {name!r} is already registered")
        OPS[name] = OpDef(name=name, kernel=kernel, **spec)
        return kernel
    return deco


def grad_op_backward(grad_op: str) -> Callable:
    """A backward that runs the registered ``grad_op`` on (the first saved value, dout) with
    the forward's attrs (relu_grad, gelu_grad, clip_grad, softmax_grad, ...)."""
    def backward(node, g):
        return apply(OPS[grad_op], (node.saved_tensor(0), g), node.attrs)
    return backward


def _xp(arr):
    if isinstance(arr, np.ndarray):
        return np
    import cupy

    return cupy


def _dist_apply(op: OpDef, inputs: tuple, attrs: dict) -> Any:
    """Import the distributed dispatcher once, then call it directly (it rebinds this name)."""
    global _dist_apply
    from ..distributed.dispatch import dist_apply

    _dist_apply = dist_apply
    return dist_apply(op, inputs, attrs)


def apply(op: OpDef, inputs: tuple, attrs: dict) -> Any:
    """Run ``op`` on ``inputs`` (Tensors or None) with keyword ``attrs``; returns Tensor(s)."""
    arrays = []
    first = None
    for t in inputs:
        if t is None:
            arrays.append(None)
            continue
        v = t._value
        if type(v) is not DenseTensor:
            return _dist_apply(op, inputs, attrs)
        if first is None:
            first = v.array
        arrays.append(v.array)
    if first is None:
        raise ValueError(f"{op.name}: every input is None")
    xp = np if type(first) is np.ndarray else _xp(first)
    if op.needs_ctx:
        res = op.kernel(xp, *arrays, ctx=DENSE_CTX, **attrs)
    else:
        res = op.kernel(xp, *arrays, **attrs)
    for i in op.mutates:
        inputs[i]._value.holder.version += 1
    if op.n_out == 1:
        # fast path: a new (non-view) numpy result needs no checks
        outs = (Tensor(DenseTensor(res)) if type(res) is np.ndarray and not op.view
                else _wrap(res, op, 0, inputs),)
    else:
        outs = tuple(_wrap(r, op, i, inputs) for i, r in enumerate(res))
    if _GradMode.enabled and op.backward is not None:
        for t in inputs:
            if t is not None and not t.stop_gradient:
                record(op, attrs, inputs, outs)
                break
    return outs[0] if op.n_out == 1 else outs


def _wrap(arr, op: OpDef, slot: int, inputs: tuple) -> Tensor:
    if isinstance(arr, np.generic):  # numpy reductions to 0-d give scalars
        arr = np.asarray(arr)
    for i, o in op.view:
        if o == slot or o == -1:
            src = inputs[i]._value
            if np.may_share_memory(arr, src.array) if type(arr) is np.ndarray else True:
                t = Tensor(DenseTensor(arr, src.holder))
                t._is_view = True
                return t
    return Tensor(DenseTensor(arr))


def check_inplace_target(op: OpDef, x: Tensor) -> None:
    """The leaf rule of DESIGN §2, checked before anything is modified."""
    if _GradMode.enabled and x._node is None and not x.stop_gradient:
        raise ValueError(f"Leaf Var ({x._label()}) that doesn't stop gradient can't use inplace "
                         f"strategy. (op {op.name}_)")


def apply_inplace(op: OpDef, inputs: tuple, attrs: dict) -> Tensor:
    """Run the inplace variant ``op_``: compute, write into the target input, return it.

    The target keeps its object identity (and, when distributed, its mesh and placements); its
    buffer's version counter is bumped; its grad node becomes this op's node.
    """
    ti, to = op.inplace
    x = inputs[ti]
    check_inplace_target(op, x)
    needs_grad = _GradMode.enabled and op.backward is not None and any(
        t is not None and not t.stop_gradient for t in inputs)
    if needs_grad and x._is_view:
        raise ValueError(f"{op.name}_: inplace update of a view that needs grad is not supported "
                         "(the gradient could not reach the viewed base); apply the op to the "
                         "base tensor or use the out-of-place op")
    if any(t is not None and t.is_dist() for t in inputs):
        from ..distributed.dispatch import dist_apply_inplace

        return dist_apply_inplace(op, inputs, attrs, needs_grad)
    arrays = [None if t is None else t._value.array for t in inputs]
    if op.needs_ctx:
        res = op.kernel(_xp(arrays[ti]), *arrays, ctx=DENSE_CTX, **attrs)
    else:
        res = op.kernel(_xp(arrays[ti]), *arrays, **attrs)
    out = res if op.n_out == 1 else res[to]
    target = x._value.array
    if out.shape != target.shape:
        raise ValueError(f"{op.name}_: the result shape {list(out.shape)} differs from the shape "
                         f"{list(target.shape)} of the tensor modified inplace")
    node = record(op, attrs, inputs, [None] * op.n_out) if needs_grad else None
    if out is not target:
        target[...] = out
    commit_inplace(op, x, node)
    return x


def commit_inplace(op: OpDef, x: Tensor, node) -> None:
    """After ``x``'s buffer was written: bump its version and make it the node's output.

    ``node`` was recorded before the write, so its saved inputs carry the old version (a later
    backward that needs them raises instead of using the overwritten values).
    """
    x._local_dense().holder.version += 1
    if node is not None:
        slot = op.inplace[1]
        if slot in op.save_outputs:
            node.save(x)
        x._node, x._slot, x.stop_gradient = node, slot, False


def to_leaf_layout(leaf: Tensor, g: Tensor) -> Tensor:
    """A leaf's gradient in the leaf's own layout (reshard to its mesh and placements)."""
    if leaf.is_dist() or g.is_dist():
        from ..distributed.dispatch import grad_to_leaf_layout

        return grad_to_leaf_layout(leaf, g)
    if g.dtype != leaf.dtype:
        from . import cast

        g = cast(g, leaf.dtype)
    return g
