"""More elementwise math (rule ``elementwise``): sin, cos, erf, square, reciprocal, log1p,
floor and sign (no gradient: zero almost everywhere, as in Paddle), masked_fill, and tril /
triu, whose kernels read their piece's global row and column offsets so a sharded matrix is
masked where it lies, with no communication."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dispatch import apply, apply_inplace
from ..schema import DENSE_CTX, OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, sum_to_shape
from .elementwise import (
    _FLOAT,
    _erf,
    _floating,
    _times_g,
    _ufunc1,
    _unary,
    _unary_fn,
    cast,
    where,
    zeros_like,
)

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

_unary("sin", _floating(_ufunc1(np.sin)), _times_g(lambda xp, x: xp.cos(x)), save="x",
       dtype=_FLOAT)
_unary("cos", _floating(_ufunc1(np.cos)), _times_g(lambda xp, x: xp.negative(xp.sin(x))),
       save="x", dtype=_FLOAT)
_unary("erf", _floating(_erf), _times_g(lambda xp, x: _TWO_OVER_SQRT_PI * xp.exp(-(x * x))),
       save="x", dtype=_FLOAT)
_unary("square", _ufunc1(np.square), _times_g(lambda xp, x: 2 * x), save="x")
_unary("reciprocal", _floating(_ufunc1(np.reciprocal)),
       _times_g(lambda xp, out: xp.negative(out * out)), dtype=_FLOAT)
_unary("log1p", _floating(_ufunc1(np.log1p)),
       lambda xp, x, g, out=None: xp.divide(g, 1.0 + x, out=out), save="x", dtype=_FLOAT)
_unary("floor", _floating(_ufunc1(np.floor)), None, dtype=_FLOAT)
_unary("sign", _ufunc1(np.sign), None)

sin = _unary_fn("sin")
cos = _unary_fn("cos")
erf = _unary_fn("erf")
square = _unary_fn("square")
reciprocal = _unary_fn("reciprocal")
log1p = _unary_fn("log1p")
floor = _unary_fn("floor")
sign = _unary_fn("sign")


# -- masked_fill -------------------------------------------------------------------------------

def _masked_fill_kernel(xp, x, mask, value, out=None):
    res = xp.where(mask, value, x)
    if out is None:
        return res.astype(x.dtype, copy=False)
    out[...] = res
    return out


def _masked_fill_bwd(node, g):
    mask = node.saved_tensor(0)
    sx, _, sv = node.in_shapes
    zero = zeros_like(g)
    return (sum_to_shape(where(mask, zero, g), sx) if node.needs_grad(0) else None, None,
            sum_to_shape(where(mask, g, zero), sv) if node.needs_grad(2) else None)


register("masked_fill", _masked_fill_kernel, backward=_masked_fill_bwd, rule="elementwise",
         save_inputs=(1,), grad_inputs=(0, 2), no_need_buffer=(0, 2), inplace=((0, 0),),
         accepts_out=True, dtype=same_dtype(0))


def _masked_fill_args(x: Tensor, mask: Any, value: Any) -> tuple[Tensor, Tensor, Tensor]:
    x = as_tensor(x)
    mask = as_tensor(mask)
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(f"masked_fill: mask must be bool, got {np.dtype(mask.dtype).name} "
                        f"(x shape {x.shape}, mask shape {mask.shape})")
    value = as_tensor(value, x)
    if value.dtype != x.dtype:
        value = cast(value, x.dtype)
    return x, mask, value


@public(methods=True)
def masked_fill(x: Tensor, mask: Any, value: Any, name: str | None = None) -> Tensor:
    """``value`` where the bool ``mask`` (broadcast against x) is True, x elsewhere.

    ``value`` is a number or a 0-d/broadcastable tensor (cast to x's dtype); both x and a tensor
    value get gradients. Example: ``dt.masked_fill(scores, causal_mask, float("-inf"))``."""
    return apply(OPS["masked_fill"], _masked_fill_args(x, mask, value), {})


@public(methods=True)
def masked_fill_(x: Tensor, mask: Any, value: Any, name: str | None = None) -> Tensor:
    """Inplace :func:`masked_fill`: writes into x and returns x."""
    return apply_inplace(OPS["masked_fill"], _masked_fill_args(x, mask, value), {})


# -- tril / triu -------------------------------------------------------------------------------

def _triangle_kernel(xp, x, diagonal, lower, ctx=DENSE_CTX, out=None):
    """x with the elements above (lower) or below (upper) the ``diagonal``-th diagonal zeroed;
    rows and columns are numbered globally (the piece's offsets)."""
    r, c = x.ndim - 2, x.ndim - 1
    rows = xp.arange(x.shape[r]).reshape(-1, 1) + ctx.offset(0, r)
    cols = xp.arange(x.shape[c]).reshape(1, -1) + ctx.offset(0, c)
    keep = (cols - rows <= diagonal) if lower else (cols - rows >= diagonal)
    if out is None:
        return xp.where(keep, x, 0).astype(x.dtype, copy=False)
    xp.multiply(x, keep, out=out)
    return out


def _triangle_bwd(node, g):
    return apply(node.op, (g,), node.attrs)


register("tril", lambda xp, x, diagonal, ctx=DENSE_CTX, out=None: _triangle_kernel(
    xp, x, diagonal, True, ctx, out), backward=_triangle_bwd, rule="elementwise",
         rule_attrs={"linear": "unary"}, needs_ctx=True, accepts_out=True, dtype=same_dtype(0),
         no_need_buffer=(0,))
register("triu", lambda xp, x, diagonal, ctx=DENSE_CTX, out=None: _triangle_kernel(
    xp, x, diagonal, False, ctx, out), backward=_triangle_bwd, rule="elementwise",
         rule_attrs={"linear": "unary"}, needs_ctx=True, accepts_out=True, dtype=same_dtype(0),
         no_need_buffer=(0,))


def _triangle(name: str, x: Tensor, diagonal: int) -> Tensor:
    x = as_tensor(x)
    if x.ndim < 2:
        raise ValueError(f"{name}: x must have at least 2 dims, got shape {x.shape}")
    if isinstance(diagonal, bool) or not isinstance(diagonal, (int, np.integer)):
        raise TypeError(f"{name}: diagonal must be an int, got {type(diagonal).__name__}")
    return apply(OPS[name], (x,), {"diagonal": int(diagonal)})


@public(methods=True)
def tril(x: Tensor, diagonal: int = 0, name: str | None = None) -> Tensor:
    """The lower triangle of the last two dims: elements with ``col - row > diagonal`` are 0.
    Example: ``dt.tril(dt.ones([4, 4]))`` is the causal mask's 0/1 form."""
    return _triangle("tril", x, diagonal)


@public(methods=True)
def triu(x: Tensor, diagonal: int = 0, name: str | None = None) -> Tensor:
    """The upper triangle of the last two dims: elements with ``col - row < diagonal`` are 0."""
    return _triangle("triu", x, diagonal)
