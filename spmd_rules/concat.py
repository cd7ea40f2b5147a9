"""concat, stack and split."""
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
from .einsum import keep_cheapest, layout, merge_shardings

__all__ = ["concat", "stack", "split"]


def _inputs(op: str, metas: Sequence[TensorMeta | None]) -> tuple[int, ...]:
    if not metas or any(m is None for m in metas):
        raise ValueError(f"{op}: every input must be a tensor, got {list(metas)}")
    return mesh_shape_of(op, metas)


def _shared_partial(metas: Sequence[TensorMeta]) -> tuple:
    """The partial every input has in common (kept: concat/stack move elements), else ()."""
    partials = {m.dist_attr.partial for m in metas}
    return partials.pop() if len(partials) == 1 else ()


@register_rule("concat")
def concat(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """n inputs, attrs axis. The concat axis is required Replicate, the other axes merge across
    inputs (first wins). A partial shared by all inputs is kept, otherwise resolved."""
    op = op_name(attrs, "concat")
    mesh = _inputs(op, metas)
    first = metas[0]
    check_ndim(op, "input 0", first, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", 0), first.ndim)
    for i, m in enumerate(metas):
        if m.ndim != first.ndim or any(a != b for d, (a, b) in enumerate(zip(m.shape, first.shape))
                                       if d != axis):
            raise ValueError(f"{op}: input {i} has shape {m.shape}, incompatible with input 0 "
                             f"{first.shape} for concat on axis {axis}")
    notation = [None if d == axis else d for d in range(first.ndim)]
    partial = _shared_partial(metas)
    merged = merge_shardings([notation] * len(metas), [m.dist_attr for m in metas],
                             {m for m, _ in partial}, [m.shape for m in metas],
                             [partial] * len(metas))
    attr = layout(notation, merged, mesh, partial)
    shape = list(first.shape)
    shape[axis] = sum(m.shape[axis] for m in metas)
    return SpmdResult(tuple(attr for _ in metas), (TensorMeta(tuple(shape), attr),))


@register_rule("stack")
def stack(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """n same-shape inputs, attrs axis (position of the new axis in the output, replicated).
    Input axes merge across inputs; a partial shared by all inputs is kept."""
    op = op_name(attrs, "stack")
    mesh = _inputs(op, metas)
    shape = metas[0].shape
    for i, m in enumerate(metas):
        if m.shape != shape:
            raise ValueError(f"{op}: input {i} has shape {m.shape}, expected {shape} like input 0")
    axis = check_axis(op, "axis", attrs.get("axis", 0), len(shape), allow_end=True)
    notation = list(range(len(shape)))
    partial = _shared_partial(metas)
    merged = merge_shardings([notation] * len(metas), [m.dist_attr for m in metas],
                             {m for m, _ in partial}, [m.shape for m in metas],
                             [partial] * len(metas))
    attr = layout(notation, merged, mesh, partial)
    out_not = notation[:axis] + [None] + notation[axis:]
    out_shape = shape[:axis] + (len(metas),) + shape[axis:]
    return SpmdResult(tuple(attr for _ in metas),
                      (TensorMeta(out_shape, layout(out_not, merged, mesh, partial)),))


@register_rule("split")
def split(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs sections (sizes summing to x.shape[axis]), axis -> len(sections)
    outputs. The split axis is required Replicate (its mesh dims move to another axis when that
    is cheaper: :func:`keep_cheapest`); other axes and Partial kept."""
    op = op_name(attrs, "split")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    check_ndim(op, "x", x, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", 0), x.ndim)
    sections = tuple(attrs.get("sections", ()))
    if not sections or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                           for s in sections) \
            or sum(sections) != x.shape[axis]:
        raise ValueError(f"{op}: sections={sections} must be non-negative ints summing to "
                         f"x.shape[{axis}]={x.shape[axis]} (x shape {x.shape})")
    attr = keep_cheapest(x, [d != axis for d in range(x.ndim)])
    outs = tuple(TensorMeta(x.shape[:axis] + (s,) + x.shape[axis + 1:], attr) for s in sections)
    return SpmdResult((attr,), outs)
