"""Elementwise ops with numpy broadcasting (rule ``elementwise``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, register_rule
from .einsum import broadcast_notations, layout, linear_partial, merge_shardings

__all__ = ["elementwise"]

_LINEAR_KINDS = (None, "add", "mul", "unary", "like")


def _kept_partials(op: str, metas: Sequence[TensorMeta], attrs: Mapping[str, Any]) -> tuple[list, list]:
    """Per input the partial it may keep, and the output's partial."""
    linear = attrs.get("linear")
    if linear not in _LINEAR_KINDS:
        raise ValueError(f"{op}: unknown linear kind {linear!r}; expected one of {_LINEAR_KINDS}")
    attrs_ = [m.dist_attr for m in metas]
    none: list = [() for _ in metas]
    if linear == "add":
        if all(linear_partial(a) for a in attrs_) and len({a.partial for a in attrs_}) == 1:
            return [a.partial for a in attrs_], list(attrs_[0].partial)
    elif linear == "mul":
        allowed = tuple(attrs.get("linear_inputs", (0,)))
        carriers = [i for i, a in enumerate(attrs_) if a.is_partial()]
        if (len(metas) == 2 and len(carriers) == 1 and carriers[0] in allowed
                and linear_partial(attrs_[carriers[0]])):
            kept = list(none)
            kept[carriers[0]] = attrs_[carriers[0]].partial
            return kept, list(attrs_[carriers[0]].partial)
    elif linear == "unary":
        if len(metas) == 1 and linear_partial(attrs_[0]):
            return [attrs_[0].partial], list(attrs_[0].partial)
    elif linear == "like":
        return [a.partial for a in attrs_], []
    return none, []


@register_rule("elementwise")
def elementwise(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """n inputs broadcast numpy-style -> one output of the broadcast shape.

    Shardings of the same output axis are merged across inputs (first input wins); a size-1 dim
    broadcast against a larger one is required Replicate. Partial inputs are resolved (required
    non-partial) unless ``attrs["linear"]`` allows keeping them:

    - ``"add"``: every input Partial (sum/avg) with identical partial -> output keeps it;
    - ``"mul"``: 2 inputs, exactly one Partial (sum/avg) and its index in
      ``attrs["linear_inputs"]`` (default ``(0,)``) -> output keeps it;
    - ``"unary"``: a single Partial (sum/avg) input -> output keeps it;
    - ``"like"`` (full_like & co.): inputs keep any partial (values unused), output not partial.

    ``attrs["num_outputs"]`` (default 1) outputs all get that layout (dropout's out and mask).
    """
    op = op_name(attrs, "elementwise")
    if not metas or any(m is None for m in metas):
        raise ValueError(f"{op}: every input must be a tensor, got {list(metas)}")
    mesh = mesh_shape_of(op, metas)
    out_shape, notations = broadcast_notations(op, [m.shape for m in metas],
                                               [f"input {i}" for i in range(len(metas))])
    kept, out_partial = _kept_partials(op, metas, attrs)
    exclude = {m for p in kept for m, _ in p}
    merged = merge_shardings(notations, [m.dist_attr for m in metas], exclude)
    inputs = tuple(layout(n, merged, mesh, p) for n, p in zip(notations, kept))
    out = layout(range(len(out_shape)), merged, mesh, out_partial)
    return SpmdResult(inputs, (TensorMeta(out_shape, out),) * int(attrs.get("num_outputs", 1)))
