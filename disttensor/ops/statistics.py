"""Reductions that all-reduce their own statistics (rule ``axis_statistics``): logsumexp, var,
std and the 2-/Frobenius norm. A reduced axis may stay sharded: the kernel combines the pieces'
maxima and sums over the mesh dims that shard it (a few small all-reduces, never a gather of x).
Gradients are composed of registered ops."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dispatch import apply
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, normalize_axes, reduce_sum
from .elementwise import divide, equal, exp, multiply, ones_like, scale, subtract, where
from .shape import reshape_to


def _keep(xp, arr, axis, keepdim):
    """``arr`` reduced with keepdims=True, squeezed when not ``keepdim``."""
    return arr if keepdim else arr.reshape([n for d, n in enumerate(arr.shape) if d not in axis])


def _summed(xp, ctx, arr, axis):
    """Sum over ``axis`` (kept) of this piece, all-reduced over the ranks holding the others."""
    return ctx.allreduce(arr.sum(axis=axis, keepdims=True), "sum", 0, axis)


def _count(ctx, x, axis) -> int:
    gshape = ctx.global_shape(0, x.shape)
    return math.prod(gshape[a] for a in axis)


def _logsumexp_kernel(xp, x, axis, keepdim, ctx):
    if any(x.shape[a] == 0 for a in axis):  # an empty piece: the identity of max
        m = xp.full([1 if d in axis else n for d, n in enumerate(x.shape)], -np.inf, x.dtype)
    else:
        m = x.max(axis=axis, keepdims=True)
    m = ctx.allreduce(m, "max", 0, axis)
    m = xp.where(xp.isfinite(m), m, 0).astype(x.dtype, copy=False)
    out = xp.log(_summed(xp, ctx, xp.exp(x - m), axis)) + m
    return _keep(xp, out, axis, keepdim)


def _moments(xp, x, axis, unbiased, ctx):
    n = _count(ctx, x, axis)
    mean = _summed(xp, ctx, x, axis) / n
    d = x - mean
    with np.errstate(divide="ignore", invalid="ignore"):
        return (_summed(xp, ctx, d * d, axis) / (n - int(unbiased))).astype(x.dtype, copy=False)


def _var_kernel(xp, x, axis, keepdim, unbiased, ctx):
    return _keep(xp, _moments(xp, x, axis, unbiased, ctx), axis, keepdim)


def _std_kernel(xp, x, axis, keepdim, unbiased, ctx):
    return _keep(xp, xp.sqrt(_moments(xp, x, axis, unbiased, ctx)), axis, keepdim)


def _norm_kernel(xp, x, axis, keepdim, ctx):
    return _keep(xp, xp.sqrt(_summed(xp, ctx, x * x, axis)), axis, keepdim)


def _kept(t: Tensor, node) -> Tensor:
    """A reduced tensor (output or its gradient) in the keepdim shape, to broadcast against x."""
    shape = node.in_shapes[0]
    axis = node.attrs["axis"]
    return reshape_to(t, [1 if d in axis else n for d, n in enumerate(shape)])


def _logsumexp_bwd(node, g):
    x, out = node.saved_tensor(0), node.saved_tensor(1)
    return multiply(exp(subtract(x, _kept(out, node))), _kept(g, node))


def _var_grad(node, x: Tensor, g_var: Tensor) -> Tensor:
    """``g_var * 2 (x - mean) / (n - ddof)`` with g_var in the keepdim shape."""
    axis = node.attrs["axis"]
    n = math.prod(node.in_shapes[0][a] for a in axis)
    mean = scale(reduce_sum(x, axis, keepdim=True), 1.0 / n)
    return multiply(subtract(x, mean), scale(g_var, 2.0 / (n - int(node.attrs["unbiased"]))))


def _var_bwd(node, g):
    return _var_grad(node, node.saved_tensor(0), _kept(g, node))


def _std_bwd(node, g):
    std = _kept(node.saved_tensor(1), node)
    return _var_grad(node, node.saved_tensor(0), divide(_kept(g, node), scale(std, 2.0)))


def _norm_bwd(node, g):
    """``g * x / norm``; 0 where the norm is 0 (x is 0 there)."""
    x, out = node.saved_tensor(0), _kept(node.saved_tensor(1), node)
    safe = where(equal(out, as_tensor(0.0, out)), ones_like(out), out)
    return multiply(x, divide(_kept(g, node), safe))


_STATS = dict(rule="axis_statistics", needs_ctx=True, save_inputs=(0,), save_outputs=(0,),
              dtype=same_dtype(0))
register("logsumexp", _logsumexp_kernel, backward=_logsumexp_bwd, **_STATS)
register("var", _var_kernel, backward=_var_bwd, **{**_STATS, "save_outputs": ()})
register("std", _std_kernel, backward=_std_bwd, **_STATS)
register("norm", _norm_kernel, backward=_norm_bwd, **_STATS)


def _stat(name: str, x: Any, axis: Any, keepdim: bool, **extra) -> Tensor:
    x = as_tensor(x)
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"{name}: x must be floating, got {np.dtype(x.dtype).name} (shape "
                        f"{x.shape})")
    axes = normalize_axes(name, axis, x.ndim)
    if any(x.shape[a] == 0 for a in axes):
        raise ValueError(f"{name}: reducing axes {list(axes)} of shape {x.shape} that hold no "
                         "elements")
    return apply(OPS[name], (x,), {"axis": axes, "keepdim": bool(keepdim), **extra})


@public(methods=True)
def logsumexp(x: Tensor, axis: Any = None, keepdim: bool = False,
              name: str | None = None) -> Tensor:
    """``log(sum(exp(x)))`` over ``axis`` (None = all), computed stably (the maximum is taken
    out first). Example: ``dt.logsumexp(logits, axis=-1)``."""
    return _stat("logsumexp", x, axis, keepdim)


@public(methods=True)
def var(x: Tensor, axis: Any = None, unbiased: bool = True, keepdim: bool = False,
        name: str | None = None) -> Tensor:
    """Variance over ``axis`` (None = all); divides by ``n - 1`` when ``unbiased`` (Paddle's
    default), else by n."""
    return _stat("var", x, axis, keepdim, unbiased=bool(unbiased))


@public(methods=True)
def std(x: Tensor, axis: Any = None, unbiased: bool = True, keepdim: bool = False,
        name: str | None = None) -> Tensor:
    """Standard deviation: ``sqrt(var(x, axis, unbiased))``."""
    return _stat("std", x, axis, keepdim, unbiased=bool(unbiased))


@public(methods=True)
def norm(x: Tensor, p: Any = "fro", axis: Any = None, keepdim: bool = False,
         name: str | None = None) -> Tensor:
    """The 2-norm ``sqrt(sum(x * x))`` over ``axis`` (None = all elements): ``p`` is ``"fro"``
    (Frobenius, one or two axes) or 2 (a vector norm: one axis or None). Example:
    ``dt.norm(w)`` is the Frobenius norm of a matrix."""
    x = as_tensor(x)
    if p is None:
        p = "fro"
    if p not in ("fro", 2, 2.0):
        raise ValueError(f"norm: p={p!r} is not supported (p=2 and p='fro' are), x shape "
                         f"{x.shape}")
    axes = normalize_axes("norm", axis, x.ndim)
    if p != "fro" and axis is not None and len(axes) > 1:
        raise ValueError(f"norm: p=2 over axes {list(axes)} is the spectral norm, which is not "
                         f"supported; use p='fro' (x shape {x.shape})")
    return _stat("norm", x, axis, keepdim)
