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
from .data_checks import data_check_group, note_data_check

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
_UNSIGNED = {k: np.dtype(f"u{k}") for k in (1, 2, 4, 8)}
_max_reduce = np.maximum.reduce  # (numpy's ``ndarray.max`` adds a Python wrapper per call)


def _in_range(xp, v, n: int) -> bool:
    """Whether every value of the integer array ``v`` lies in [0, n): one unsigned max (a
    negative value reads as a huge one)."""
    if not v.size:
        return True
    if n <= 0:
        return False
    if v.dtype.kind == "i":
        v = v.view(_UNSIGNED[v.dtype.itemsize])
    return int(_max_reduce(v, axis=None) if xp is np else v.max()) < n


def _agree_now(xp, ctx: KernelCtx, v, input_index: int, ndim: int) -> tuple[int, int]:
    """The extremes (lo, hi) of ``v`` over every piece of the input: one 2-element int64 max
    all-reduce of (-min, max) over the ranks holding other pieces (none when not sharded)."""
    if v.size:
        ext = xp.stack([v.min(), v.max()]).astype(np.int64)
        ext[0] = -ext[0]
    else:
        ext = xp.full(2, _EMPTY, dtype=np.int64)
    ext = ctx.allreduce(ext, "max", input_index, tuple(range(ndim)))
    return -int(ext[0]), int(ext[1])


def check_index_range(xp, ctx: KernelCtx, op: str, what: str, values, n: int,
                      input_index: int, valid=None, note: str = "", now: bool = False):
    """Check that every value of ``values`` (this rank's piece of input ``input_index``; only
    where ``valid``) lies in [0, n); the error is ValueError ``"<op>: <what> <v> is out of range
    [0, n)<note>"`` on every rank of the op, naming the same value.

    Where the input is not sharded the ranks holding it find the same value and raise at once.
    Where it is, the verdict is noted (:func:`~disttensor.ops.data_checks.note_data_check`)
    and agreed on at the next collective (or write, ``backward``, step end): every rank raises
    there, and until then this rank computes on ``values`` with its bad entries replaced by 0,
    which this function returns (``values`` itself when they pass). ``now`` agrees at once,
    with a blocking all-reduce: for kernels that write into an existing tensor."""
    v = values if valid is None else xp.where(valid, values, 0)
    ok = _in_range(xp, v, n)
    group = data_check_group(ctx, input_index)
    if group is not None and not now and n > 0:
        if ok:
            note_data_check(group, None)
            return values
        v = values if valid is None else values[valid]
        note_data_check(group, (f"{op}: {what}", int(v.min()), int(v.max()), n, note))
        bad = (values < 0) | (values >= n)
        return xp.where(bad if valid is None else bad & valid, 0, values)
    if ok and group is None:
        return values
    lo, hi = _agree_now(xp, ctx, values if valid is None else values[valid], input_index,
                        values.ndim)
    if lo < 0 or hi >= n:
        raise ValueError(f"{op}: {what} {lo if lo < 0 else hi} is out of range [0, {n}){note}")
    return values


def grad_op_backward(grad_op: str) -> Callable:
    """A backward that runs the registered ``grad_op`` on (the first saved value, dout) with
    the forward's attrs (relu_grad, gelu_grad, clip_grad, softmax_grad, ...)."""
    def backward(node, g):
        return apply(OPS[grad_op], (node.saved_tensor(0), g), node.attrs)
    return backward
