"""Reductions over axes (rule ``reduction``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, check_axis, mesh_shape_of, op_name, register_rule, require
from .einsum import contracted_partial, layout, merge_shardings
from .placement import LINEAR_REDUCE_TYPES, ReduceType

__all__ = ["reduction", "REDUCE_PARTIAL"]

#: reduce_type -> Partial type of the output on mesh dims sharding a reduced axis
#: (None: the reduced axes must be replicated).
REDUCE_PARTIAL: dict[str, ReduceType | None] = {
    "sum": ReduceType.SUM, "mean": ReduceType.SUM, "max": ReduceType.MAX,
    "min": ReduceType.MIN, "prod": ReduceType.PROD,
    "argmax": None, "argmin": None, "any": None, "all": None,
}


def _reduce_axes(op: str, attrs: Mapping[str, Any], ndim: int) -> tuple[int, ...]:
    axis = attrs.get("axis")
    if axis is None or axis == () or axis == []:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        check_axis(op, "axis", a, ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: duplicate axes in axis={axes}")
    return tuple(sorted(axes))


@register_rule("reduction")
def reduction(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs axis (None/empty = all), keepdim, reduce_type.

    Non-reduced axes keep their sharding. A sharded reduced axis makes the output Partial:
    sum/mean -> Partial(sum) (the kernel must divide a mean by the GLOBAL count of the reduced
    axes), max -> Partial(max), min -> Partial(min), prod -> Partial(prod); for
    argmax/argmin/any/all the reduced axes are required Replicate. An input Partial is kept when
    the reduction commutes with it (sum/mean with sum/avg, max with max, min with min, prod with
    prod), otherwise resolved. keepdim axes (size 1) are replicated.
    """
    op = op_name(attrs, "reduction")
    require(metas, op, 1)
    (x,) = metas
    mesh = mesh_shape_of(op, metas)
    kind = attrs.get("reduce_type", "sum")
    if kind not in REDUCE_PARTIAL:
        raise ValueError(f"{op}: unknown reduce_type {kind!r}; expected one of "
                         f"{sorted(REDUCE_PARTIAL)}")
    axes = _reduce_axes(op, attrs, x.ndim)
    keepdim = bool(attrs.get("keepdim", False))
    out_type = REDUCE_PARTIAL[kind]
    compatible = LINEAR_REDUCE_TYPES if out_type is ReduceType.SUM else {out_type}
    xa = x.dist_attr
    keep = xa.partial if xa.is_partial() and all(r in compatible for _, r in xa.partial) else ()
    x_not = [None if (out_type is None and d in axes) else d for d in range(x.ndim)]
    merged = merge_shardings([x_not], [xa], {m for m, _ in keep}, [x.shape], [keep])
    out_not = [None if d in axes else d for d in range(x.ndim) if keepdim or d not in axes]
    out_shape = tuple(1 if d in axes else s for d, s in enumerate(x.shape) if keepdim
                      or d not in axes)
    partial = list(keep) + (contracted_partial(merged, out_not, out_type) if out_type else [])
    return SpmdResult((layout(x_not, merged, mesh, keep),),
                      (TensorMeta(out_shape, layout(out_not, merged, mesh, partial)),))
