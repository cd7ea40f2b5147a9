"""Helpers shared by the op families: scalar promotion and gradient un-broadcasting."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..tensor import DenseTensor, Tensor


def as_tensor(x: Any, like: Any = None) -> Tensor:
    """``x`` as a Tensor; Python numbers and arrays become dense tensors of ``like``'s dtype
    (float32 by default) on ``like``'s device. A dense scalar joins a distributed op as
    Replicate."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (bool, int, float, np.number, np.ndarray, list, tuple)):
        if isinstance(like, Tensor):
            dtype = np.dtype(like.dtype)
            kind = np.asarray(x).dtype.kind
            if kind == "f" and dtype.kind in "iub":
                dtype = np.dtype(np.float32)
            elif kind in "iu" and dtype.kind == "b":  # a number never becomes a bool
                dtype = np.dtype(np.int64)
            arr = like._local_array()
            xp = np if isinstance(arr, np.ndarray) else __import__("cupy")
        else:
            xp = np
            dtype = np.asarray(x).dtype
            if dtype.kind == "f":
                dtype = np.dtype(np.float32)
            elif dtype.kind in "iu":
                dtype = np.dtype(np.int64)
        return Tensor(DenseTensor(xp.asarray(x, dtype=dtype)))
    raise TypeError(f"expected a Tensor or a number, got {type(x).__name__}")


def sum_to_shape(g: Tensor, shape: Sequence[int]) -> Tensor:
    """Sum ``g`` over the axes that numpy broadcasting added to reach ``g.shape`` from ``shape``."""
    gshape = tuple(g.shape)
    shape = tuple(shape)
    if gshape == shape:
        return g
    from .reduction import sum as _sum
    from .shape import reshape_to

    lead = len(gshape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and gshape[lead + i] != 1)
    out = _sum(g, axis=list(axes), keepdim=False) if axes else g
    return reshape_to(out, shape) if tuple(out.shape) != shape else out


def normalize_axis(op: str, axis: int, ndim: int, arg: str = "axis") -> int:
    """A non-negative axis, or a ValueError naming the op."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{op}: {arg} must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"{op}: {arg}={axis} is out of range for a tensor of rank {ndim}")
    return int(axis) % max(ndim, 1)


def normalize_axes(op: str, axis: Any, ndim: int) -> tuple[int, ...]:
    """Axes as a sorted tuple of non-negative ints; None means all axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, Tensor):
        axis = axis.tolist()
    if isinstance(axis, (int, np.integer)):
        axis = [axis]
    axes = tuple(sorted(normalize_axis(op, a, ndim) for a in axis))
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: axis {list(axis)} repeats an axis")
    return axes
