"""Gathers and scatters along an axis: take_along_axis (rule ``take_along_axis``, gradient
``take_along_axis_grad``), put_along_axis and scatter (rules of the same names; scatter also
serves ``x[..., int_list, ...] = v``).

Index values are checked in the kernel (:func:`~disttensor.ops.common.check_index_range`):
indices the rule keeps replicated cost no collective; sharded ones are agreed on at the next
collective, as embedding ids are (scatter, which writes into ``x``, agrees at once), so every
rank raises the same error and nothing is written."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply, apply_inplace
from ..schema import DENSE_CTX, OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, check_index_range, normalize_axis
from .elementwise import cast, zeros_like
from .embedding import scatter_add
from .indexing import gather
from .shape import _slice_local, expand, getitem_normalized, normalize_index


def _along(xp, index, axis: int) -> tuple:
    """The fancy index addressing ``a[..., index[...], ...]`` along ``axis`` for an ``a`` of
    index's shape off the axis (numpy's take_along_axis indexing)."""
    out = []
    for d, n in enumerate(index.shape):
        if d == axis:
            out.append(index)
        else:
            out.append(xp.arange(n).reshape([-1 if k == d else 1 for k in range(index.ndim)]))
    return tuple(out)


def _shapes(ctx, x, index, axis: int, names=("arr", "indices")) -> str:
    """The global shapes of an op's data and index inputs, for its index-range error."""
    return (f" ({names[0]} of shape {list(ctx.global_shape(0, x.shape))}, {names[1]} of shape "
            f"{list(ctx.global_shape(1, index.shape))}, axis {axis})")


def _take_kernel(xp, x, index, axis, ctx):
    index = check_index_range(xp, ctx, "take_along_axis", "index value", index, x.shape[axis],
                              1, note=_shapes(ctx, x, index, axis))
    return x[_along(xp, index, axis)]


def _take_grad_kernel(xp, index, dout, axis, input_shape):
    """dx: dout scatter-added at index along ``axis`` (dx's size there: ``input_shape[axis]``,
    a replicated axis; the others follow dout)."""
    shape = list(dout.shape)
    shape[axis] = input_shape[axis]
    dx = xp.zeros(shape, dtype=dout.dtype)
    if xp is np:
        np.add.at(dx, _along(xp, index, axis), dout)
    else:
        import cupyx

        cupyx.scatter_add(dx, _along(xp, index, axis), dout)
    return dx


def take_along_axis_grad(index: Tensor, g: Tensor, axis: int, input_shape) -> Tensor:
    """The gradient of ``take_along_axis(x, index, axis)`` for x of ``input_shape``."""
    return apply(OPS["take_along_axis_grad"], (index, g),
                 {"axis": axis, "input_shape": tuple(input_shape)})


def _take_bwd(node, g):
    return take_along_axis_grad(node.saved_tensor(0), g, node.attrs["axis"],
                                node.in_shapes[0]), None


register("take_along_axis_grad", _take_grad_kernel, rule="take_along_axis_grad",
         dtype=same_dtype(1))
register("take_along_axis", _take_kernel, backward=_take_bwd, rule="take_along_axis",
         save_inputs=(1,), grad_inputs=(0,), no_need_buffer=(0,), needs_ctx=True,
         dtype=same_dtype(0))


def _put_kernel(xp, x, index, values, axis, reduce, ctx):
    index = check_index_range(xp, ctx, "put_along_axis", "index value", index, x.shape[axis],
                              1, note=_shapes(ctx, x, index, axis))
    out = x.copy()
    where = _along(xp, index, axis)
    if reduce == "assign":
        out[where] = values
    elif xp is np:
        np.add.at(out, where, values)
    else:
        import cupyx

        cupyx.scatter_add(out, where, values)
    return out


def _put_bwd(node, g):
    index = node.saved_tensor(0)
    axis = node.attrs["axis"]
    gv = apply(OPS["take_along_axis"], (g, index), {"axis": axis}) if node.needs_grad(2) else None
    gx = None
    if node.needs_grad(0):
        gx = g if node.attrs["reduce"] == "add" else apply(
            OPS["put_along_axis"], (g, index, zeros_like(index, g.dtype)), node.attrs)
    return gx, None, gv


register("put_along_axis", _put_kernel, backward=_put_bwd, rule="put_along_axis",
         save_inputs=(1,), grad_inputs=(0, 2), needs_ctx=True, no_need_buffer=(0, 2),
         dtype=same_dtype(0))


def _index_arg(op: str, index: Any, x: Tensor, axis: int, arg: str = "indices") -> Tensor:
    index = as_tensor(index)
    if np.dtype(index.dtype).kind not in "iu":
        raise TypeError(f"{op}: {arg} must be an integer tensor, got "
                        f"{np.dtype(index.dtype).name}")
    if index.ndim != x.ndim:
        raise ValueError(f"{op}: {arg} of shape {index.shape} must have the rank of arr "
                         f"{x.shape}")
    return index


def _broadcast_off_axis(op: str, t: Tensor, x: Tensor, axis: int, n: int, arg: str) -> Tensor:
    """``t`` broadcast to x's shape with ``n`` on ``axis`` (Paddle's ``broadcast=True``)."""
    shape = list(x.shape)
    shape[axis] = n
    if list(t.shape) == shape:
        return t
    try:
        np.broadcast_shapes(tuple(t.shape), tuple(shape))
    except ValueError:
        raise ValueError(f"{op}: {arg} of shape {t.shape} cannot be broadcast to {shape} (arr "
                         f"shape {x.shape}, axis {axis})") from None
    return expand(t, shape)


@public(methods=True)
def take_along_axis(arr: Tensor, indices: Any, axis: int, broadcast: bool = True) -> Tensor:
    """``out[..., j, ...] = arr[..., indices[..., j, ...], ...]`` along ``axis`` (numpy's
    take_along_axis); indices lie in [0, arr.shape[axis]) and broadcast against arr off the
    axis. Example: ``dt.take_along_axis(logits, labels.unsqueeze(-1), axis=-1)``."""
    arr = as_tensor(arr)
    axis = normalize_axis("take_along_axis", axis, arr.ndim)
    index = _index_arg("take_along_axis", indices, arr, axis)
    if broadcast:
        index = _broadcast_off_axis("take_along_axis", index, arr, axis, index.shape[axis],
                                    "indices")
    return apply(OPS["take_along_axis"], (arr, index), {"axis": axis})


@public(methods=True)
def put_along_axis(arr: Tensor, indices: Any, values: Any, axis: int, reduce: str = "assign",
                   include_self: bool = True, broadcast: bool = True) -> Tensor:
    """arr with ``values`` written (``reduce="assign"``) or added (``"add"``) at ``indices``
    along ``axis``; values broadcast to the indices' shape. Where indices repeat, "assign"
    keeps the last value (numpy's order) and "add" sums them all. Example:
    ``dt.put_along_axis(x, idx, 0.0, axis=1)``."""
    arr = as_tensor(arr)
    axis = normalize_axis("put_along_axis", axis, arr.ndim)
    if reduce not in ("assign", "add"):
        raise ValueError(f"put_along_axis: reduce must be 'assign' or 'add', got {reduce!r}")
    if not include_self:
        raise ValueError("put_along_axis: include_self=False is not supported")
    index = _index_arg("put_along_axis", indices, arr, axis)
    if broadcast:
        index = _broadcast_off_axis("put_along_axis", index, arr, axis, index.shape[axis],
                                    "indices")
    values = as_tensor(values, arr)
    if values.dtype != arr.dtype:
        values = cast(values, arr.dtype)
    values = _broadcast_off_axis("put_along_axis", values, index, axis, index.shape[axis],
                                 "values")
    return apply(OPS["put_along_axis"], (arr, index, values), {"axis": axis, "reduce": reduce})


# -- scatter (also x[..., ints, ...] = v) ------------------------------------------------------

def _scatter_kernel(xp, x, ids, value, index, axis, overwrite, ctx=DENSE_CTX, out=None):
    """x with the slices of ``x[index]`` at ``ids`` along ``axis`` replaced by value's slices
    (``overwrite``), or zeroed and then summed from them."""
    check_index_range(xp, ctx, "scatter", "index value", ids, x[index].shape[axis], 1,
                      note=_shapes(ctx, x, ids, axis, ("x", "index")), now=True)
    if out is None:
        out = x.copy()
    elif out is not x:
        out[...] = x
    region = out[index]  # a view: basic indexing
    at = (slice(None),) * axis + (ids,)
    if overwrite:
        region[at] = value
    else:
        region[at] = 0
        scatter_add(xp, xp.moveaxis(region, axis, 0), ids, xp.moveaxis(value, axis, 0))
    return out


def _scatter_bwd(node, g):
    ids = node.saved_tensor(0)
    index, axis = node.attrs["index"], node.attrs["axis"]
    gv = gather(getitem_normalized(g, index), ids, axis)
    gx = apply(OPS["scatter"], (g, ids, zeros_like(gv)), {**node.attrs, "overwrite": True}) \
        if node.needs_grad(0) else None
    return gx, None, gv if node.needs_grad(2) else None


register("scatter", _scatter_kernel, backward=_scatter_bwd, rule="scatter", save_inputs=(1,),
         grad_inputs=(0, 2), no_need_buffer=(0, 2), inplace=((0, 0),), accepts_out=True,
         needs_ctx=True, dtype=same_dtype(0),
         local_attrs=lambda attrs, i, o, c: {**attrs, **_slice_local(attrs, i, o, c)})


def scatter_at(x: Tensor, index: tuple, axis: int, ids: Tensor, value: Tensor,
               overwrite: bool = True, inplace: bool = False) -> Tensor:
    """Run the scatter op: ``x[index]``'s slices at ``ids`` along ``axis`` set from value."""
    if value.dtype != x.dtype:
        value = cast(value, x.dtype)
    args, attrs = (x, ids, value), {"index": index, "axis": axis, "overwrite": overwrite}
    return apply_inplace(OPS["scatter"], args, attrs) if inplace else \
        apply(OPS["scatter"], args, attrs)


def _scatter_args(x: Any, index: Any, updates: Any) -> tuple[Tensor, Tensor, Tensor]:
    x = as_tensor(x)
    index = as_tensor(index)
    if np.dtype(index.dtype).kind not in "iu":
        raise TypeError(f"scatter: index must be an integer tensor, got "
                        f"{np.dtype(index.dtype).name}")
    if index.ndim == 0:
        index = index.reshape([1])
    if index.ndim != 1 or x.ndim == 0:
        raise ValueError(f"scatter: index must be 1-d and x at least 1-d, got index shape "
                         f"{index.shape}, x shape {x.shape}")
    updates = as_tensor(updates, x)
    want = [index.shape[0]] + list(x.shape[1:])
    if list(updates.shape) != want:
        raise ValueError(f"scatter: updates of shape {updates.shape} must have shape {want} "
                         f"(index shape {index.shape}, x shape {x.shape})")
    return x, index, updates


@public(methods=True)
def scatter(x: Tensor, index: Any, updates: Any, overwrite: bool = True,
            name: str | None = None) -> Tensor:
    """x with rows ``index`` (1-d, values in [0, x.shape[0])) replaced by the rows of
    ``updates`` (``overwrite``: the last of repeated indices wins), or, with
    ``overwrite=False``, set to the sum of the updates aimed at them (Paddle's scatter).
    Example: ``dt.scatter(x, dt.to_tensor([2, 0]), rows)``."""
    x, index, updates = _scatter_args(x, index, updates)
    full = normalize_index("scatter", Ellipsis, x.shape)
    return scatter_at(x, full, 0, index, updates, bool(overwrite))


@public(methods=True)
def scatter_(x: Tensor, index: Any, updates: Any, overwrite: bool = True,
             name: str | None = None) -> Tensor:
    """Inplace :func:`scatter`: writes into x and returns x."""
    x, index, updates = _scatter_args(x, index, updates)
    full = normalize_index("scatter", Ellipsis, x.shape)
    return scatter_at(x, full, 0, index, updates, bool(overwrite), inplace=True)
