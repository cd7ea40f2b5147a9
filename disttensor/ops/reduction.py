"""Reductions over axes: sum, mean, max, min, argmax, argmin. Rule: ``reduction``.

``mean`` is ``sum`` scaled by 1/count, so a sharded mean is exact on uneven shards (the local
sums become a Partial(sum) and the count is global)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply
from ..dtype import is_floating, to_np_dtype
from ..schema import DENSE_CTX, OPS, fixed_dtype, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, normalize_axes
from .elementwise import cast, divide, equal, multiply, scale
from .shape import expand, reshape_to


def _keepdim_shape(shape, axes) -> list[int]:
    return [1 if i in axes else n for i, n in enumerate(shape)]


def _expand_back(g: Tensor, node) -> Tensor:
    """``g`` (the reduced grad) broadcast back to the input's shape."""
    (shape,) = node.in_shapes
    axes = node.attrs["axis"]
    if not node.attrs["keepdim"]:
        g = reshape_to(g, _keepdim_shape(shape, axes))
    return expand(g, list(shape))


def _sum_kernel(xp, x, axis, keepdim, dtype=None):
    return x.sum(axis=axis, keepdims=keepdim, dtype=dtype)  # the method: half np.sum's cost


def _sum_bwd(node, g):
    return _expand_back(g, node)


def _extreme_kernel(xp, x, axis, keepdim, reduce_type, ctx=DENSE_CTX):
    if any(x.shape[a] == 0 for a in axis):
        gshape = ctx.global_shape(0, x.shape)
        if any(gshape[a] == 0 for a in axis):
            raise ValueError(f"{reduce_type}: reducing an empty axis of shape {list(gshape)}")
        # an empty piece of a sharded axis (the output is Partial(max/min)): the identity
        shape = [1 if d in axis else n for d, n in enumerate(x.shape) if keepdim or d not in axis]
        if is_floating(x.dtype):
            lo, hi = -np.inf, np.inf
        else:
            lo, hi = np.iinfo(x.dtype).min, np.iinfo(x.dtype).max
        return xp.full(shape, lo if reduce_type == "max" else hi, dtype=x.dtype)
    f = xp.max if reduce_type == "max" else xp.min
    return f(x, axis=axis, keepdims=keepdim)


def _extreme_bwd(node, g):
    """Gradient flows to the elements equal to the extreme, split evenly among ties."""
    x, out = node.saved_tensor(0), node.saved_tensor(1)
    out_b = _expand_back(out, node)
    mask = cast(equal(x, out_b), x.dtype)
    count = _reduce(mask, node.attrs["axis"], True, "sum")
    return multiply(_expand_back(g, node), divide(mask, expand(count, list(x.shape))))


def _sum_dtype(dtypes, attrs) -> tuple:
    return (np.dtype(attrs["dtype"]) if attrs.get("dtype") is not None else np.dtype(dtypes[0]),)


register("sum", _sum_kernel, backward=_sum_bwd, rule="reduction", dtype=_sum_dtype,
         no_need_buffer=(0,), rule_attrs={"reduce_type": "sum"})
register("max", lambda xp, x, axis, keepdim, ctx: _extreme_kernel(xp, x, axis, keepdim, "max", ctx),
         backward=_extreme_bwd, rule="reduction", save_inputs=(0,), save_outputs=(0,),
         dtype=same_dtype(0), rule_attrs={"reduce_type": "max"}, needs_ctx=True)
register("min", lambda xp, x, axis, keepdim, ctx: _extreme_kernel(xp, x, axis, keepdim, "min", ctx),
         backward=_extreme_bwd, rule="reduction", save_inputs=(0,), save_outputs=(0,),
         dtype=same_dtype(0), rule_attrs={"reduce_type": "min"}, needs_ctx=True)


def _arg_kernel(xp, x, axis, keepdim, reduce_type):
    f = xp.argmax if reduce_type == "argmax" else xp.argmin
    if len(axis) == x.ndim and x.ndim != 1:
        out = xp.asarray(f(x.reshape(-1))).astype(np.int64)
        return out.reshape([1] * x.ndim) if keepdim else out
    return f(x, axis=axis[0], keepdims=keepdim).astype(np.int64)


register("argmax", lambda xp, x, axis, keepdim: _arg_kernel(xp, x, axis, keepdim, "argmax"),
         rule="reduction", dtype=fixed_dtype(np.int64), rule_attrs={"reduce_type": "argmax"})
register("argmin", lambda xp, x, axis, keepdim: _arg_kernel(xp, x, axis, keepdim, "argmin"),
         rule="reduction", dtype=fixed_dtype(np.int64), rule_attrs={"reduce_type": "argmin"})


def _reduce(x: Tensor, axis: Any, keepdim: bool, name: str, **extra) -> Tensor:
    x = as_tensor(x)
    axes = normalize_axes(name, axis, x.ndim)
    return apply(OPS[name], (x,), {"axis": axes, "keepdim": bool(keepdim), **extra})


@public(methods=True)
def sum(x: Tensor, axis: Any = None, dtype: Any = None, keepdim: bool = False,
        name: str | None = None) -> Tensor:
    """Sum over ``axis`` (None = all). Integer and bool inputs sum to int64, as in Paddle."""
    x = as_tensor(x)
    d = None if dtype is None else to_np_dtype(dtype)
    if d is None and np.dtype(x.dtype).kind in "biu":
        d = np.dtype(np.int64)
    return _reduce(x, axis, keepdim, "sum", dtype=d)


@public(methods=True)
def mean(x: Tensor, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    """Arithmetic mean over ``axis`` (None = all); floating inputs only."""
    x = as_tensor(x)
    if not is_floating(x.dtype):
        raise TypeError(f"mean: x must be floating, got {np.dtype(x.dtype).name}")
    axes = normalize_axes("mean", axis, x.ndim)
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    if count == 0:
        raise ValueError(f"mean: reducing axes {list(axes)} of shape {x.shape} that hold no "
                         "elements")
    return scale(apply(OPS["sum"], (x,), {"axis": axes, "keepdim": bool(keepdim), "dtype": None}),
                 1.0 / count)


@public(methods=True)
def max(x: Tensor, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    """Maximum over ``axis`` (None = all); the gradient is split evenly among ties."""
    return _reduce(x, axis, keepdim, "max")


@public(methods=True)
def min(x: Tensor, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    """Minimum over ``axis`` (None = all); the gradient is split evenly among ties."""
    return _reduce(x, axis, keepdim, "min")


@public(methods=True)
def argmax(x: Tensor, axis: int | None = None, keepdim: bool = False,
           name: str | None = None) -> Tensor:
    """Index (int64) of the maximum along ``axis``; over the flattened tensor when None."""
    return _reduce(x, axis, keepdim, "argmax")


@public(methods=True)
def argmin(x: Tensor, axis: int | None = None, keepdim: bool = False,
           name: str | None = None) -> Tensor:
    """Index (int64) of the minimum along ``axis``; over the flattened tensor when None."""
    return _reduce(x, axis, keepdim, "argmin")
