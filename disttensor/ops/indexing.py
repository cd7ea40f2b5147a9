"""Integer-index ops: gather / index_select (rule ``gather``, backward ``gather_grad``) and
one_hot (rule ``one_hot``, no gradient)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply
from ..schema import OPS, fixed_dtype, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, check_index_range, normalize_axis
from .data_checks import flush_data_checks
from .embedding import scatter_add


def _gather_kernel(xp, x, index, axis, ctx):
    index = check_index_range(xp, ctx, "gather", "index value", index, x.shape[axis], 1)
    return xp.take(x, index, axis=axis)


def _gather_grad_kernel(xp, index, dout, axis, input_shape):
    """dx: dout's slices scatter-added at ``index`` along ``axis`` (dx's size there is
    ``input_shape[axis]``; the other dims follow dout)."""
    shape = list(dout.shape)
    shape[axis] = input_shape[axis]
    dx = xp.zeros(shape, dtype=dout.dtype)
    scatter_add(xp, xp.moveaxis(dx, axis, 0), index, xp.moveaxis(dout, axis, 0))
    return dx


def _gather_bwd(node, g):
    attrs = {"axis": node.attrs["axis"], "input_shape": tuple(node.in_shapes[0])}
    return apply(OPS["gather_grad"], (node.saved_tensor(0), g), attrs), None


register("gather_grad", _gather_grad_kernel, rule="gather_grad", dtype=same_dtype(1))
register("gather", _gather_kernel, backward=_gather_bwd, rule="gather", save_inputs=(1,),
         grad_inputs=(0,), no_need_buffer=(0,), needs_ctx=True, dtype=same_dtype(0))


def _one_hot_kernel(xp, x, num_classes, ctx):
    x = check_index_range(xp, ctx, "one_hot", "x value", x, num_classes, 0)
    return (x[..., None] == xp.arange(num_classes)).astype(np.float32)


register("one_hot", _one_hot_kernel, rule="one_hot", needs_ctx=True,
         dtype=fixed_dtype(np.float32))


def _index(op: str, index: Any) -> Tensor:
    index = as_tensor(index)
    if np.dtype(index.dtype).kind not in "iu":
        raise TypeError(f"{op}: index must be an integer tensor, got {np.dtype(index.dtype).name}")
    if index.ndim != 1:
        raise ValueError(f"{op}: index must be 1-d, got shape {index.shape}")
    return index


@public(methods=True)
def gather(x: Tensor, index: Any, axis: int | None = None, name: str | None = None) -> Tensor:
    """Slices of ``x`` along ``axis`` (default 0) at the 1-d integer ``index`` (each in
    [0, x.shape[axis])); the output has ``len(index)`` there."""
    x = as_tensor(x)
    index = _index("gather", index)
    if x.ndim == 0:
        raise ValueError(f"gather: x must have at least 1 dim, got shape {x.shape}")
    axis = normalize_axis("gather", 0 if axis is None else axis, x.ndim)
    return apply(OPS["gather"], (x, index), {"axis": axis})


@public(methods=True)
def index_select(x: Tensor, index: Any, axis: int = 0, name: str | None = None) -> Tensor:
    """Same as :func:`gather` (Paddle ``index_select``); an index out of range raises naming
    index_select and the shapes (on every rank: the check is gather's)."""
    x, index = as_tensor(x), _index("index_select", index)
    try:
        out = gather(x, index, axis)
        if index.is_dist():  # agreed here, so that the error names index_select
            flush_data_checks()
        return out
    except ValueError as e:
        if not str(e).startswith("gather: index value"):
            raise
        raise ValueError(f"index_select: {str(e)[len('gather: '):]} (x of shape {x.shape}, "
                         f"index of shape {index.shape}, axis {axis})") from None


@public()
def one_hot(x: Tensor, num_classes: int, name: str | None = None) -> Tensor:
    """float32 one-hot vectors: shape ``x.shape + [num_classes]``; values of x must be in
    [0, num_classes). Not differentiable."""
    x = as_tensor(x)
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"one_hot: x must be an integer tensor, got {np.dtype(x.dtype).name}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
            or num_classes < 1:
        raise ValueError(f"one_hot: num_classes must be a positive int, got {num_classes!r}")
    return apply(OPS["one_hot"], (x,), {"num_classes": int(num_classes)})
