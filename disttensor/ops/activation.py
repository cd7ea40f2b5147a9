"""Softmax and log_softmax along one axis (numerically stable). Rule: ``softmax`` (the softmax
axis is kept whole on every rank, so the kernels need no communication)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply
from ..dtype import is_floating, to_np_dtype
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from . import fast, gpu_fused
from .common import as_tensor, grad_op_backward, normalize_axis
from .elementwise import cast


def _shifted(xp, x, axis, out=None):
    """``x - max(x, axis)`` (keepdims) in a fresh array or ``out`` (which may be x)."""
    if out is None:
        out = xp.empty_like(x)
    if x.shape[axis] == 0:
        out[...] = x
        return out
    return xp.subtract(x, xp.max(x, axis=axis, keepdims=True), out=out)


def _axis_dot(xp, a, b, axis):
    """``sum(a * b, axis)`` (keepdims) in one pass, without an [a.shape] temporary."""
    if axis == a.ndim - 1 and getattr(xp, "vecdot", None) is not None:
        return xp.vecdot(a, b)[..., None]
    letters = "abcdefghijklmnopqrstuvwxyz"[:a.ndim]
    keep = letters.replace(letters[axis], "")
    return xp.expand_dims(xp.einsum(f"{letters},{letters}->{keep}", a, b), axis)


def _axis_sum(xp, a, axis):
    """``sum(a, axis)`` (keepdims); over the last axis of a C-contiguous array as a
    matrix-vector product (BLAS: about 3x numpy's row sum)."""
    n = a.shape[axis]
    if axis == a.ndim - 1 and n and a.size and a.flags.c_contiguous:
        return (a.reshape(-1, n) @ xp.ones(n, a.dtype)).reshape(a.shape[:-1] + (1,))
    return xp.sum(a, axis=axis, keepdims=True)


def _softmax_kernel(xp, x, axis, out=None):
    """``exp(x - max) / sum(exp(x - max))``, every pass in place (``out`` may be x)."""
    e = _shifted(xp, x, axis, out)
    xp.exp(e, out=e)
    s = _axis_sum(xp, e, axis)
    e *= xp.divide(1.0, s, out=s)
    return e


def _log_softmax_kernel(xp, x, axis, out=None):
    """``z - log(sum(exp(z)))`` with z = x - max (``out`` may be x)."""
    z = _shifted(xp, x, axis, out)
    lse = _axis_sum(xp, xp.exp(z), axis)
    z -= xp.log(lse, out=lse)
    return z


def _softmax_grad_kernel(xp, y, dout, axis, out=None):
    """d softmax with y = softmax(x): ``y * (dout - sum(dout * y, axis))`` (``out`` may be
    dout)."""
    if out is None:
        out = xp.empty(y.shape, xp.result_type(y, dout))
    r = xp.subtract(dout, _axis_dot(xp, dout, y, axis), out=out)
    r *= y
    return r


def _log_softmax_grad_kernel(xp, y, dout, axis, out=None):
    """d log_softmax with y = log_softmax(x): ``dout - exp(y) * sum(dout, axis)`` (``out`` may
    be dout)."""
    e = xp.exp(y, out=xp.empty(y.shape, xp.result_type(y, dout)))
    e *= xp.sum(dout, axis=axis, keepdims=True)
    return xp.subtract(dout, e, out=e if out is None else out)


register("softmax_grad", fast.softmax_grad(gpu_fused.softmax_grad(_softmax_grad_kernel)),
         rule="softmax", reuse=(1,), accepts_out=True)
register("log_softmax_grad", _log_softmax_grad_kernel, rule="softmax", reuse=(1,),
         accepts_out=True)
register("softmax", fast.softmax(gpu_fused.softmax(_softmax_kernel)),
         backward=grad_op_backward("softmax_grad"), rule="softmax", save_outputs=(0,), reuse=(0,),
         dtype=same_dtype(0), accepts_out=True)
register("log_softmax", _log_softmax_kernel, backward=grad_op_backward("log_softmax_grad"),
         rule="softmax", save_outputs=(0,), reuse=(0,), dtype=same_dtype(0), accepts_out=True)


def _prepare(op: str, x: Any, axis: int, dtype: Any) -> tuple[Tensor, dict]:
    x = as_tensor(x)
    if dtype is not None:
        x = cast(x, to_np_dtype(dtype))
    if not is_floating(x.dtype):
        raise TypeError(f"{op}: x must be floating, got {np.dtype(x.dtype).name} "
                        f"(pass dtype= to convert)")
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have at least 1 dim, got shape {x.shape}")
    return x, {"axis": normalize_axis(op, axis, x.ndim)}


@public()
def softmax(x: Tensor, axis: int = -1, dtype: Any = None, name: str | None = None) -> Tensor:
    """``exp(x) / sum(exp(x), axis)`` computed as ``exp(x - max) / sum(exp(x - max))``;
    ``dtype`` casts x first (Paddle ``F.softmax``)."""
    x, attrs = _prepare("softmax", x, axis, dtype)
    return apply(OPS["softmax"], (x,), attrs)


@public()
def log_softmax(x: Tensor, axis: int = -1, dtype: Any = None, name: str | None = None) -> Tensor:
    """``x - log(sum(exp(x), axis))`` computed with the max shifted out (Paddle
    ``F.log_softmax``)."""
    x, attrs = _prepare("log_softmax", x, axis, dtype)
    return apply(OPS["log_softmax"], (x,), attrs)
