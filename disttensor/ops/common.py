"""Helpers shared by the op families: constants from Python values, axis checks, gradient
un-broadcasting and the backward of ops whose gradient is a registered ``*_grad`` op.

Backward helpers call ops by name through the registry (``apply(OPS[name], ...)``), so the
family modules import each other in one direction only."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..dispatch import apply
from ..schema import OPS, KernelCtx
from ..tensor import Tensor

__all__ = ["as_tensor", "constant", "sum_to_shape", "reduce_sum", "normalize_axis",
           "normalize_axes", "grad_op_backward", "check_index_range"]


def constant(value: Any, dtype: Any, like: Tensor | None = None) -> Tensor:
    """A dense tensor holding ``value`` (a copy) as ``dtype`` on ``like``'s device (creation op
    ``assign_value``)."""
    place = None
    if like is not None:
        arr = like._local_array()
        if not isinstance(arr, np.ndarray):
            place = f"gpu:{arr.device.id}"
    return apply(OPS["assign_value"], (), {"value": value, "dtype": np.dtype(dtype),
                                           "place": place})


def as_tensor(x: Any, like: Any = None) -> Tensor:
    """``x`` as a Tensor; Python numbers and arrays become dense tensors of ``like``'s dtype
    (float32 by default) on ``like``'s device. A dense scalar joins a distributed op as
    Replicate."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (bool, int, float, np.number, np.ndarray, list, tuple)):
        kind = np.asarray(x).dtype.kind if not isinstance(x, float) else "f"
        if isinstance(like, Tensor):
            dtype = np.dtype(like.dtype)
            if kind == "f" and dtype.kind in "iub":
                dtype = np.dtype(np.float32)
            elif kind in "iu" and dtype.kind == "b":  # a number never becomes a bool
                dtype = np.dtype(np.int64)
            return constant(x, dtype, like)
        dtype = np.asarray(x).dtype
        if dtype.kind == "f":
            dtype = np.dtype(np.float32)
        elif dtype.kind in "iu":
            dtype = np.dtype(np.int64)
        return constant(x, dtype)
    raise TypeError(f"expected a Tensor or a number, got {type(x).__name__}")


def reduce_sum(g: Tensor, axes: Sequence[int], keepdim: bool = False) -> Tensor:
    """``sum(g, axes)`` keeping g's dtype (for backward functions)."""
    return apply(OPS["sum"], (g,), {"axis": tuple(axes), "keepdim": keepdim, "dtype": None})


def sum_to_shape(g: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum ``g`` over the axes that numpy broadcasting added to reach ``g.shape`` from ``shape``."""
    gshape = tuple(g.shape)
    shape = tuple(shape)
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1)
    out = reduce_sum(g, axes) if axes else g
    if tuple(out.shape) != shape:
        out = apply(OPS["reshape"], (out,), {"shape": shape})
    return out


def normalize_axis(op: str, axis: int, ndim: int, arg: str = "axis") -> int:
    """A non-negative axis, or an error naming the op and the argument."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{op}: argument '{arg}' must be an int, got {type(axis).__name__} "
                        f"{axis!r}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"{op}: argument '{arg}'={axis} is out of range for a tensor of rank "
                         f"{ndim}")
    return int(axis) % max(ndim, 1)


def normalize_axes(op: str, axis: Any, ndim: int, arg: str = "axis") -> tuple[int, ...]:
    """Axes as a sorted tuple of non-negative ints; None means all axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, Tensor):
        axis = axis.tolist()
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axis = [axis]
    if not isinstance(axis, (list, tuple)):
        raise TypeError(f"{op}: argument '{arg}' must be an int, a list of ints or None, got "
                        f"{type(axis).__name__} {axis!r}")
    axes = tuple(sorted(normalize_axis(op, a, ndim, arg) for a in axis))
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: argument '{arg}' {list(axis)} repeats an axis")
    return axes


_EMPTY = np.iinfo(np.int64).min  # the extremes of a piece with no (valid) value


def check_index_range(xp, ctx: KernelCtx, op: str, what: str, values, n: int,
                      input_index: int, valid=None, note: str = "") -> None:
    """Raise ValueError ``"<op>: <what> <v> is out of range [0, n)<note>"`` on every rank of the op
    when a value of ``values`` (this rank's piece of input ``input_index``; only where ``valid``)
    lies outside [0, n). The piece's extremes are max-reduced as one 2-element int64 all-reduce
    over the ranks holding other pieces of that input (none when it is not sharded: the ranks
    holding the same piece find the same value), so all ranks name the same value and a rank
    that catches the error to skip a batch leaves no other rank waiting."""
    v = values if valid is None else values[valid]
    if v.size:
        ext = xp.stack([v.min(), v.max()]).astype(np.int64)
        ext[0] = -ext[0]
    else:
        ext = xp.full(2, _EMPTY, dtype=np.int64)
    ext = ctx.allreduce(ext, "max", input_index, tuple(range(values.ndim)))
    lo, hi = -int(ext[0]), int(ext[1])
    if lo < 0 or hi >= n:
        raise ValueError(f"{op}: {what} {lo if lo < 0 else hi} is out of range [0, {n}){note}")


def grad_op_backward(grad_op: str) -> Callable:
    """A backward that runs the registered ``grad_op`` on (the first saved value, dout) with
    the forward's attrs (relu_grad, gelu_grad, clip_grad, softmax_grad, ...)."""
    def backward(node, g):
        return apply(OPS[grad_op], (node.saved_tensor(0), g), node.attrs)
    return backward
