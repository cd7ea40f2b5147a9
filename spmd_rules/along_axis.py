"""Ops that read or write whole lines along some axes: sort, argsort, topk, cumsum, flip, roll,
repeat_interleave, unbind, take_along_axis (and its grad), put_along_axis, scatter.

The axes an op works along are required whole (Replicate: a sort or a scan of a sharded axis
needs the axis' every element); the other axes keep their sharding, or take the dropped mesh
dims where that moves fewer bytes (:func:`~spmd_rules.einsum.keep_cheapest`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    SpmdResult,
    TensorMeta,
    check_axis,
    check_ndim,
    mesh_shape_of,
    op_name,
    register_rule,
    require,
)
from .dist_attr import DistAttr
from .einsum import contracted_partial, keep_cheapest, layout, linear_partial, merge_shardings
from .view import parse_index

__all__ = ["along_axes", "unbind", "take_along_axis", "take_along_axis_grad", "put_along_axis",
           "scatter"]


def _axes(op: str, attrs: Mapping[str, Any], ndim: int) -> tuple[int, ...]:
    axes = attrs.get("axes", (attrs.get("axis", 0),))
    return tuple(check_axis(op, "axis", a, ndim) for a in axes)


def _whole_along(x: TensorMeta, axes: Sequence[int], keep_partial: bool) -> DistAttr:
    """x's layout with ``axes`` whole; a Partial is kept only when ``keep_partial``."""
    a = x.dist_attr if keep_partial else x.dist_attr.without_partial()
    return keep_cheapest(TensorMeta(x.shape, a), [d not in axes for d in range(x.ndim)])


@register_rule("along_axes")
def along_axes(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs ``axes`` (or ``axis``), ``out_size`` (the output's size on the single
    axis, default unchanged: topk's k, repeat_interleave's total), ``num_outputs`` (default 1),
    ``linear`` (the op is linear in x: a Partial(sum/avg) x stays Partial: cumsum, flip, roll).

    The axes are required Replicate, the other axes keep their sharding; every output is laid
    out like the required input."""
    op = op_name(attrs, "along_axes")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    check_ndim(op, "x", x, min_ndim=1)
    axes = _axes(op, attrs, x.ndim)
    keep = bool(attrs.get("linear")) and linear_partial(x.dist_attr)
    required = _whole_along(x, axes, keep)
    shape = list(x.shape)
    if attrs.get("out_size") is not None:
        if len(axes) != 1:
            raise ValueError(f"{op}: out_size needs exactly one axis, got axes {axes}")
        shape[axes[0]] = int(attrs["out_size"])
    out = TensorMeta(tuple(shape), required)
    return SpmdResult((required,), (out,) * int(attrs.get("num_outputs", 1)))


@register_rule("unbind")
def unbind(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs axis -> ``x.shape[axis]`` outputs of x's shape without the axis. The
    axis is required Replicate, the others keep their sharding; a Partial x stays Partial
    (picking slices is linear)."""
    op = op_name(attrs, "unbind")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    check_ndim(op, "x", x, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", 0), x.ndim)
    required = _whole_along(x, (axis,), linear_partial(x.dist_attr))
    dims = required.dims_mapping[:axis] + required.dims_mapping[axis + 1:]
    out = TensorMeta(x.shape[:axis] + x.shape[axis + 1:], required.with_dims_mapping(dims))
    return SpmdResult((required,), (out,) * x.shape[axis])


def _check_index_shape(op: str, x: TensorMeta, index: TensorMeta, axis: int) -> None:
    if index.ndim != x.ndim or any(n != m for d, (n, m) in enumerate(zip(index.shape, x.shape))
                                   if d != axis):
        raise ValueError(f"{op}: indices of shape {list(index.shape)} must match arr of shape "
                         f"{list(x.shape)} on every axis but axis {axis}")


def _line_notations(ndim: int, axis: int, label: Any) -> list:
    return [label if d == axis else d for d in range(ndim)]


@register_rule("take_along_axis")
def take_along_axis(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (arr, indices int, same ndim, equal sizes off the axis), attrs axis -> an output
    shaped like indices: ``out[..., j, ...] = arr[..., indices[..., j, ...], ...]``. arr's axis
    is required Replicate; indices' axis may stay sharded (the output follows it); the other
    axes merge across both. arr's Partial (sum/avg) is kept (picking elements is linear)."""
    op = op_name(attrs, "take_along_axis")
    require(metas, op, 2)
    x, index = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "arr", x, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", 0), x.ndim)
    _check_index_shape(op, x, index, axis)
    keep = x.dist_attr.partial if linear_partial(x.dist_attr) else ()
    x_not, i_not = _line_notations(x.ndim, axis, None), _line_notations(x.ndim, axis, "i")
    merged = merge_shardings([x_not, i_not], [x.dist_attr, index.dist_attr],
                             {m for m, _ in keep}, [x.shape, index.shape], [keep, ()])
    return SpmdResult((layout(x_not, merged, mesh, keep), layout(i_not, merged, mesh)),
                      (TensorMeta(index.shape, layout(i_not, merged, mesh, keep)),))


@register_rule("take_along_axis_grad")
def take_along_axis_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
                         ) -> SpmdResult:
    """inputs (indices, dout), attrs axis, input_shape -> dx of input_shape (dout scatter-added
    at indices along the axis). dx's axis is replicated and Partial(sum) on the mesh dims
    sharding the indices' axis; the other axes merge; a Partial (sum/avg) dout is kept."""
    op = op_name(attrs, "take_along_axis_grad")
    require(metas, op, 2)
    index, dout = metas
    mesh = mesh_shape_of(op, metas)
    input_shape = tuple(attrs.get("input_shape", ()))
    axis = check_axis(op, "axis", attrs.get("axis", 0), len(input_shape))
    if dout.shape != index.shape:
        raise ValueError(f"{op}: dout of shape {list(dout.shape)} must have the shape of indices "
                         f"{list(index.shape)}")
    _check_index_shape(op, TensorMeta(input_shape, DistAttr.replicated(len(input_shape), mesh)),
                       index, axis)
    keep = dout.dist_attr.partial if linear_partial(dout.dist_attr) else ()
    i_not, x_not = _line_notations(index.ndim, axis, "i"), _line_notations(index.ndim, axis, None)
    merged = merge_shardings([i_not, i_not], [index.dist_attr, dout.dist_attr],
                             {m for m, _ in keep}, [index.shape, dout.shape], [(), keep])
    partial = list(keep) + contracted_partial(merged, x_not)
    return SpmdResult((layout(i_not, merged, mesh), layout(i_not, merged, mesh, keep)),
                      (TensorMeta(input_shape, layout(x_not, merged, mesh, partial)),))


@register_rule("put_along_axis")
def put_along_axis(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (arr, indices int, values shaped like indices), attrs axis -> arr with the values
    written (or added) at indices along the axis. The axis is required Replicate in all three
    (a write may land anywhere on it), the other axes merge; Partial inputs are resolved. The
    output is laid out like the required arr."""
    op = op_name(attrs, "put_along_axis")
    require(metas, op, 3)
    x, index, values = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "arr", x, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", 0), x.ndim)
    _check_index_shape(op, x, index, axis)
    if values.shape != index.shape:
        raise ValueError(f"{op}: values of shape {list(values.shape)} must have the shape of "
                         f"indices {list(index.shape)}")
    notation = _line_notations(x.ndim, axis, None)
    attrs_ = [m.dist_attr.without_partial() for m in metas]
    merged = merge_shardings([notation] * 3, attrs_, shapes=[m.shape for m in metas])
    req = layout(notation, merged, mesh)
    return SpmdResult((req, req, req), (TensorMeta(x.shape, req),))


@register_rule("scatter")
def scatter(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, index 1-d int, value), attrs ``index`` (a basic index, see
    :func:`~spmd_rules.view.parse_index`) and ``axis`` (an axis of the region ``x[index]``):
    x with the region's slices at ``index`` along ``axis`` replaced by (or summed from) value,
    whose shape is the region's with ``len(index)`` on ``axis``. As for set_value, x's axes
    taken by an int or a partial slice are required Replicate, and so is the scattered axis;
    value dims follow the region's; the index is replicated; Partials are resolved. The output
    has x's required layout."""
    op = op_name(attrs, "scatter")
    require(metas, op, 3)
    x, index, value = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "index", index, ndims=(1,))
    region, src, full = parse_index(op, attrs.get("index", ()), x.shape)
    axis = check_axis(op, "axis", attrs.get("axis", 0), len(region))
    if src[axis] is None:
        raise ValueError(f"{op}: axis {axis} of the region is a new axis")
    full[src[axis]] = False
    want = region[:axis] + index.shape + region[axis + 1:]
    if value.shape != want:
        raise ValueError(f"{op}: value of shape {list(value.shape)} must have shape "
                         f"{list(want)} (index of shape {list(index.shape)}, x of shape "
                         f"{list(x.shape)})")
    x_not = [a if ok else None for a, ok in enumerate(full)]
    v_not = [None if a is None or d == axis or not full[a] else a for d, a in enumerate(src)]
    merged = merge_shardings([x_not, [None], v_not], [m.dist_attr.without_partial() for m in metas],
                             shapes=[m.shape for m in metas])
    required = layout(x_not, merged, mesh)
    return SpmdResult((required, layout([None], merged, mesh), layout(v_not, merged, mesh)),
                      (TensorMeta(x.shape, required),))
