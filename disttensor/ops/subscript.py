"""``x[index]`` and ``x[index] = v`` (``Tensor.__getitem__`` / ``__setitem__``).

Basic items (ints, negative ones included, slices, None, ``...``) give views (rule ``slice``)
and inplace writes (``set_value``). One *advanced* item — a list of ints, an integer array or
Tensor of any rank, or a bool mask — turns the read into a basic view with that axis whole
followed by ``gather`` along it, and the write into ``scatter`` (rules ``gather`` and
``scatter``: the indexed axis is whole, the others keep their shards). Negative indices count
from the end. As in numpy, when int items are separated from the advanced item by a slice, the
index's dims come first.

A bool mask gives a result whose size depends on its values: it is read on the host where every
rank holds the whole mask (a dense or replicated tensor, a list, an array); a mask sharded over
ranks raises. ``x[mask] = scalar`` with a mask of x's shape is ``masked_fill_`` and works under
any placement.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_rules import Replicate

from ..schema import public
from ..tensor import Tensor
from .common import as_tensor
from .elementwise import add, less_than, where
from .indexing import gather
from .math import masked_fill_
from .scatter import scatter_at
from .shape import expand, normalize_index, reshape_to, transpose
from .shape import getitem as basic_getitem
from .shape import setitem as basic_setitem

_ADVANCED = (list, np.ndarray, Tensor)


def _is_advanced(item: Any) -> bool:
    return isinstance(item, _ADVANCED) and not (isinstance(item, (np.ndarray, Tensor))
                                                and item.ndim == 0)


def _scalar(item: Any) -> Any:
    """0-d arrays and tensors index like ints (or like a bool scalar: unsupported)."""
    if isinstance(item, (np.ndarray, Tensor)) and item.ndim == 0:
        return item.item()
    return item


def _host_mask(op: str, mask: Any) -> np.ndarray:
    """A bool mask every rank holds whole, as a numpy array."""
    if isinstance(mask, Tensor):
        if mask.is_dist() and not all(isinstance(p, Replicate) for p in mask.placements):
            raise ValueError(f"{op}: a bool mask of shape {mask.shape} placed {mask.placements} "
                             "gives a result whose shape depends on values each rank holds only "
                             "part of; replicate the mask, or use masked_fill / where, which "
                             "keep the shape")
        local = mask._local_array()
        if mask.is_dist() and list(local.shape) != list(mask.shape):
            raise ValueError(f"{op}: this rank is outside the mesh of the bool mask (shape "
                             f"{mask.shape}), whose values only its members hold")
        return np.asarray(local.get() if hasattr(local, "get") else local)
    return np.asarray(mask)


def _parse(op: str, x: Tensor, index: Any):
    """(items with the advanced one replaced by a full slice, its position among the items,
    the x the items apply to (bool masks over several axes merge them), the index: a host
    int64 array or an integer Tensor)."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [_scalar(it) for it in items]
    adv = [k for k, it in enumerate(items) if _is_advanced(it)]
    if len(adv) > 1:
        raise IndexError(f"{op}: only one list/array/tensor index is supported, got {len(adv)} "
                         f"in an index of x of shape {x.shape}")
    q = adv[0]
    item = items[q]
    if any(it is Ellipsis for it in items[:q]):
        n_after = sum(1 for it in items[q + 1:] if it is not None)
        axis = x.ndim - n_after - max(np.ndim(item) if not isinstance(item, Tensor) else
                                      item.ndim, 1)
    else:
        axis = sum(1 for it in items[:q] if it is not None)
    is_bool = (isinstance(item, Tensor) and np.dtype(item.dtype) == np.bool_) or (
        not isinstance(item, Tensor) and np.asarray(item).dtype == np.bool_)
    if is_bool:
        mask = _host_mask(op, item)
        span = x.shape[axis:axis + mask.ndim]
        if list(mask.shape) != list(span):
            raise IndexError(f"{op}: bool mask of shape {list(mask.shape)} does not match the "
                             f"axes {list(span)} it indexes in x of shape {x.shape}")
        if mask.ndim != 1:
            x = reshape_to(x, x.shape[:axis] + [int(np.prod(span))] + x.shape[axis + mask.ndim:])
        idx: Any = np.flatnonzero(mask).astype(np.int64)
    elif isinstance(item, Tensor):
        if np.dtype(item.dtype).kind not in "iu":
            raise IndexError(f"{op}: a tensor index must be integer or bool, got "
                             f"{np.dtype(item.dtype).name}")
        n = x.shape[axis]
        idx = where(less_than(item, 0), add(item, n), item)
    else:
        idx = np.asarray(item)
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"{op}: index {item!r} must hold ints or bools")
        n = x.shape[axis]
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = idx.min() if idx.min() < -n else idx.max()
            raise IndexError(f"{op}: index {int(bad)} is out of range for axis {axis} of size "
                             f"{n} (x shape {x.shape})")
        idx = np.where(idx < 0, idx + n, idx).astype(np.int64)
    items[q] = slice(None)
    return items, q, x, idx


def _layout(items: list, q: int) -> tuple[int, bool]:
    """(the advanced item's axis in the basic result, whether numpy moves it to the front:
    int items apart from it, across a slice or None)."""
    ay = sum(1 for it in items[:q] if isinstance(it, slice) or it is None)
    if any(it is Ellipsis for it in items[:q]):
        return -1, False
    ints = [k for k, it in enumerate(items) if isinstance(it, (int, np.integer))]
    run = sorted(ints + [q])
    return ay, run != list(range(run[0], run[-1] + 1))


def _axis_in_basic(items: list, q: int, basic_ndim: int) -> int:
    ay, _ = _layout(items, q)
    if ay >= 0:
        return ay
    after = sum(1 for it in items[q + 1:] if isinstance(it, slice) or it is None)
    return basic_ndim - after - 1


def _as_index_tensor(idx: Any) -> Tensor:
    return as_tensor(idx) if not isinstance(idx, Tensor) else idx


@public(methods=("__getitem__",))
def getitem(x: Tensor, index: Any) -> Tensor:
    """``x[index]``: basic items give a view; one list/array/tensor index gathers (see the
    module docstring). Example: ``logits[:, [-1], :]`` keeps the last position's axis."""
    items = [_scalar(it) for it in (index if isinstance(index, tuple) else (index,))]
    if not any(_is_advanced(it) for it in items):
        return basic_getitem(x, tuple(items))
    items, q, x, idx = _parse("__getitem__", x, index)
    y = basic_getitem(x, tuple(items))
    ay = _axis_in_basic(items, q, y.ndim)
    it = _as_index_tensor(idx)
    flat = it if it.ndim == 1 else reshape_to(it, [it.size])
    try:
        out = gather(y, flat, ay)
    except ValueError as e:
        raise IndexError(f"__getitem__: {e} (x shape {x.shape}, index shape {it.shape}, axis "
                         f"{ay})") from None
    if it.ndim != 1:
        out = reshape_to(out, y.shape[:ay] + it.shape + y.shape[ay + 1:])
    _, front = _layout(items, q)
    if front and ay > 0:
        k = it.ndim
        perm = list(range(ay, ay + k)) + list(range(ay)) + list(range(ay + k, out.ndim))
        out = transpose(out, perm)
    return out


@public(methods=("__setitem__",))
def setitem(x: Tensor, index: Any, value: Any) -> Tensor:
    """``x[index] = value`` inplace; one list/array/tensor index scatters (value broadcast to
    the indexed region), ``x[mask] = scalar`` with a mask of x's shape is masked_fill_."""
    items = [_scalar(it) for it in (index if isinstance(index, tuple) else (index,))]
    if not any(_is_advanced(it) for it in items):
        return basic_setitem(x, tuple(items), value)
    if len(items) == 1 and isinstance(items[0], Tensor) and np.dtype(items[0].dtype) == np.bool_ \
            and items[0].shape == x.shape and np.ndim(value) == 0 and (
                not isinstance(value, Tensor) or not value.is_dist()):
        return masked_fill_(x, items[0], value)
    base = x
    items, q, x, idx = _parse("__setitem__", x, index)
    if x is not base:
        raise IndexError(f"__setitem__: a bool mask over several axes needs a scalar value and "
                         f"a mask of x's shape {base.shape}")
    _, front = _layout(items, q)
    if front:
        raise IndexError("__setitem__: int items apart from the list/tensor index (numpy moves "
                         "the index's dims first) are not supported")
    basic = normalize_index("__setitem__", tuple(items), x.shape)
    region = list(np.empty(x.shape, dtype=np.bool_)[basic].shape)
    ay = _axis_in_basic(items, q, len(region))
    it = _as_index_tensor(idx)
    shape = region[:ay] + list(it.shape) + region[ay + 1:]
    value = as_tensor(value, x)
    try:
        np.broadcast_shapes(tuple(value.shape), tuple(shape))
    except ValueError:
        raise ValueError(f"__setitem__: value of shape {value.shape} cannot be broadcast to the "
                         f"indexed region of shape {shape} (x shape {x.shape})") from None
    value = expand(value, shape) if list(value.shape) != shape else value
    if it.ndim != 1:
        it = reshape_to(it, [it.size])
        value = reshape_to(value, region[:ay] + [it.size] + region[ay + 1:])
    try:
        scatter_at(x, basic, ay, it, value, overwrite=True, inplace=True)
    except ValueError as e:
        if "out of range" not in str(e):
            raise
        raise IndexError(f"__setitem__: {e} (x shape {x.shape}, index shape {it.shape})") \
            from None
    return x
