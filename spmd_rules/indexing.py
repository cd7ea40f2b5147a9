"""gather (index_select), its grad, and one_hot."""
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
from .einsum import contracted_partial, layout, linear_partial, merge_shardings

__all__ = ["gather", "gather_grad", "one_hot"]


@register_rule("gather")
def gather(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, index 1-d int), attrs axis -> x.shape with axis replaced by len(index).

    x's gathered axis is required Replicate, its other axes keep their sharding (x first); the
    index's sharding goes to the output's gathered axis. x's Partial is kept (gathering moves
    elements); the index must not be partial."""
    op = op_name(attrs, "gather")
    require(metas, op, 2)
    x, index = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "x", x, min_ndim=1)
    check_ndim(op, "index", index, ndims=(1,))
    axis = check_axis(op, "axis", attrs.get("axis", 0), x.ndim)
    x_not = [None if d == axis else d for d in range(x.ndim)]
    out_not = ["i" if d == axis else d for d in range(x.ndim)]
    keep = x.dist_attr.partial
    merged = merge_shardings([x_not, ["i"]], [x.dist_attr, index.dist_attr], {m for m, _ in keep},
                             [x.shape, index.shape], [keep, ()])
    out_shape = x.shape[:axis] + index.shape + x.shape[axis + 1:]
    return SpmdResult((layout(x_not, merged, mesh, keep), layout(["i"], merged, mesh)),
                      (TensorMeta(out_shape, layout(out_not, merged, mesh, keep)),))


@register_rule("gather_grad")
def gather_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (index, dout), attrs axis, input_shape -> dx of input_shape (scatter-add).

    The gathered axis of dout merges with the index (index first); dx is replicated on that
    axis and Partial(sum) on the mesh dims sharding it. Other axes keep dout's sharding. A
    Partial (sum/avg) dout is kept (linear)."""
    op = op_name(attrs, "gather_grad")
    require(metas, op, 2)
    index, dout = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "index", index, ndims=(1,))
    input_shape = tuple(attrs.get("input_shape", ()))
    axis = check_axis(op, "axis", attrs.get("axis", 0), len(input_shape))
    want = input_shape[:axis] + index.shape + input_shape[axis + 1:]
    if dout.shape != want:
        raise ValueError(f"{op}: dout has shape {dout.shape}, expected {want} for input_shape "
                         f"{input_shape}, index {index.shape}, axis {axis}")
    d_not = ["i" if d == axis else d for d in range(len(input_shape))]
    out_not = [None if d == axis else d for d in range(len(input_shape))]
    keep = dout.dist_attr.partial if linear_partial(dout.dist_attr) else ()
    merged = merge_shardings([["i"], d_not], [index.dist_attr, dout.dist_attr],
                             {m for m, _ in keep},
                             [index.shape, dout.shape], [(), keep])
    partial = list(keep) + contracted_partial(merged, out_not)
    return SpmdResult((layout(["i"], merged, mesh), layout(d_not, merged, mesh, keep)),
                      (TensorMeta(input_shape, layout(out_not, merged, mesh, partial)),))


@register_rule("one_hot")
def one_hot(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x int,), attrs num_classes -> x.shape + (num_classes,). x keeps its sharding, the
    class axis is replicated; a partial x is resolved."""
    op = op_name(attrs, "one_hot")
    require(metas, op, 1)
    (x,) = metas
    mesh = mesh_shape_of(op, metas)
    classes = attrs.get("num_classes")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
        raise ValueError(f"{op}: num_classes must be a non-negative int, got {classes!r}")
    notation = list(range(x.ndim))
    merged = merge_shardings([notation], [x.dist_attr], shapes=[x.shape])
    return SpmdResult((layout(notation, merged, mesh),),
                      (TensorMeta(x.shape + (classes,), layout(notation + [None], merged, mesh)),))
