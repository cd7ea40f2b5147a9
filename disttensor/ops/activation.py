"""Softmax and log_softmax along one axis (numerically stable). Rule: ``softmax`` (the softmax
axis is kept whole on every rank, so the kernels need no communication)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply
from ..dtype import to_np_dtype
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, grad_op_backward, normalize_axis
from .elementwise import cast


def _shifted(xp, x, axis):
    """``x - max(x, axis)`` (keepdims); an empty axis needs no shift."""
    if x.shape[axis] == 0:
        return x
    return x - xp.max(x, axis=axis, keepdims=True)


def _softmax_kernel(xp, x, axis):
    e = xp.exp(_shifted(xp, x, axis))
    return e / xp.sum(e, axis=axis, keepdims=True)


def _log_softmax_kernel(xp, x, axis):
    z = _shifted(xp, x, axis)
    return z - xp.log(xp.sum(xp.exp(z), axis=axis, keepdims=True))


def _softmax_grad_kernel(xp, out, dout, axis):
    """d softmax: ``out * (dout - sum(dout * out, axis))``."""
    return out * (dout - xp.sum(dout * out, axis=axis, keepdims=True))


def _log_softmax_grad_kernel(xp, out, dout, axis):
    """d log_softmax: ``dout - exp(out) * sum(dout, axis)``."""
    return dout - xp.exp(out) * xp.sum(dout, axis=axis, keepdims=True)


register("softmax_grad", _softmax_grad_kernel, rule="softmax", reuse=(1,))
register("log_softmax_grad", _log_softmax_grad_kernel, rule="softmax", reuse=(1,))
register("softmax", _softmax_kernel, backward=grad_op_backward("softmax_grad"), rule="softmax",
         save_outputs=(0,), reuse=(0,), dtype=same_dtype(0))
register("log_softmax", _log_softmax_kernel, backward=grad_op_backward("log_softmax_grad"),
         rule="softmax", save_outputs=(0,), reuse=(0,), dtype=same_dtype(0))


def _prepare(op: str, x: Any, axis: int, dtype: Any) -> tuple[Tensor, dict]:
    x = as_tensor(x)
    if dtype is not None:
        x = cast(x, to_np_dtype(dtype))
    if np.dtype(x.dtype).kind != "f":
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
