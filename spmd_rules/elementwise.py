"""Elementwise ops with numpy broadcasting (rule ``elementwise``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, prod, register_rule
from .dist_attr import DistAttr
from .einsum import broadcast_notations, layout, linear_partial, merge_shardings
from .placement import LINEAR_REDUCE_TYPES, ReduceType

__all__ = ["elementwise", "optimizer_update"]

_LINEAR_KINDS = (None, "add", "mul", "unary", "like", "max", "min")


def _kept_partials(op: str, metas: Sequence[TensorMeta],
                   attrs: Mapping[str, Any]) -> tuple[list, list]:
    """Per input the partial it must have, and the output's partial (see :func:`elementwise`)."""
    linear = attrs.get("linear")
    if linear not in _LINEAR_KINDS:
        raise ValueError(f"{op}: unknown linear kind {linear!r}; expected one of {_LINEAR_KINDS}")
    attrs_ = [m.dist_attr for m in metas]
    none: list = [() for _ in metas]
    carriers = [i for i, a in enumerate(attrs_) if a.is_partial()]
    if not carriers:
        return none, []
    first = attrs_[carriers[0]].partial
    if linear in ("add", "max", "min"):
        types = LINEAR_REDUCE_TYPES if linear == "add" else {ReduceType(linear)}
        if all(attrs_[i].partial == first for i in carriers) and all(r in types for _, r in first):
            return [first] * len(metas), list(first)  # the others become Partial locally
    elif linear == "mul":
        allowed = tuple(attrs.get("linear_inputs", (0,)))
        cands = [i for i in carriers if i in allowed and linear_partial(attrs_[i])]
        # with two candidates the smaller factor is resolved (one all-reduce of fewer bytes)
        keep = max(cands, key=lambda i: (prod(metas[i].shape), -i), default=None)
        if len(metas) == 2 and keep is not None:  # the other factor is resolved (one collective)
            kept = list(none)
            kept[keep] = attrs_[keep].partial
            return kept, list(attrs_[keep].partial)
    elif linear == "unary":
        if len(metas) == 1 and linear_partial(attrs_[0]):
            return [attrs_[0].partial], list(attrs_[0].partial)
    elif linear == "like":
        return [a.partial for a in attrs_], []
    return none, []


@register_rule("elementwise")
def elementwise(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """n inputs broadcast numpy-style -> one output of the broadcast shape.

    Shardings of the same output axis are merged across inputs at the fewest bytes moved
    (:func:`~spmd_rules.einsum.merge_shardings`; a mesh dim no input uses may co-shard an
    output axis when that is free: ``[S(0),R] + [S(1),R]`` on 2x2 -> ``[S(0),S(0)]``); a
    size-1 dim broadcast against a larger one is required Replicate. Partial inputs are resolved
    (required non-partial) unless ``attrs["linear"]`` allows keeping them:

    - ``"add"`` (add, subtract): the Partial inputs share one partial of sum/avg -> the output
      keeps it and the other inputs become Partial locally (Replicate -> the value on
      coordinate 0, Shard -> the own block: no communication, as PyTorch's ``P + R``);
    - ``"max"`` / ``"min"`` (maximum, minimum): the same with Partial(max) / Partial(min);
    - ``"mul"``: 2 inputs, a Partial (sum/avg) one whose index is in ``attrs["linear_inputs"]``
      (default ``(0,)``) -> output keeps it; the other input is resolved (``P * P``: one
      all-reduce, of the smaller factor);
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
    merged = merge_shardings(notations, [m.dist_attr for m in metas], exclude,
                             [m.shape for m in metas], kept, free_labels=range(len(out_shape)))
    inputs = tuple(layout(n, merged, mesh, p) for n, p in zip(notations, kept))
    out = layout(range(len(out_shape)), merged, mesh, out_partial)
    return SpmdResult(inputs, (TensorMeta(out_shape, out),) * int(attrs.get("num_outputs", 1)))


@register_rule("optimizer_update")
def optimizer_update(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """An optimizer's fused update: the first ``attrs["tensor_inputs"]`` inputs (parameter,
    gradient, per-element states) follow :func:`elementwise`; the others (Adam's beta powers,
    the learning rate: one element each) are required Replicate whatever the parameter's layout
    (a one-element parameter sharded over a mesh dim must not shard them). Of the
    ``attrs["num_outputs"]`` outputs the first ``attrs["tensor_outputs"]`` get the parameter's
    layout, the others are replicated."""
    op = op_name(attrs, "optimizer_update")
    n_in, n_out = int(attrs["tensor_inputs"]), int(attrs["tensor_outputs"])
    if len(metas) < n_in or any(m is None for m in metas):
        raise ValueError(f"{op}: every input must be a tensor, got {list(metas)}")
    mesh = mesh_shape_of(op, metas)
    head = elementwise(metas[:n_in], {**attrs, "num_outputs": 1})
    rest = tuple(DistAttr.replicated(len(m.shape), mesh) for m in metas[n_in:])
    out = head.outputs[0]
    scalars = tuple(TensorMeta(tuple(m.shape), a) for m, a in zip(metas[n_in:], rest))
    outputs = (out,) * n_out + scalars[:int(attrs["num_outputs"]) - n_out]
    return SpmdResult(tuple(head.inputs) + rest, outputs)
