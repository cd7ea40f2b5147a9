"""Softmax cross entropy with hard integer labels (parallel when the class axis is sharded)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import (
    DistAttr,
    SpmdResult,
    TensorMeta,
    check_axis,
    check_ndim,
    mesh_shape_of,
    op_name,
    register_rule,
)
from .einsum import layout, merge_shardings

__all__ = ["cross_entropy", "cross_entropy_grad", "cross_entropy_mean",
           "cross_entropy_mean_grad"]


def _notations(op: str, logits: TensorMeta, label: TensorMeta, attrs: Mapping[str, Any]):
    check_ndim(op, "logits", logits, min_ndim=1)
    axis = check_axis(op, "axis", attrs.get("axis", logits.ndim - 1), logits.ndim)
    batch = logits.shape[:axis] + logits.shape[axis + 1:]
    keep = logits.shape[:axis] + (1,) + logits.shape[axis + 1:]
    if label.shape == keep:
        label_not = [None if d == axis else d for d in range(logits.ndim)]
    elif label.shape == batch:
        label_not = [d for d in range(logits.ndim) if d != axis]
    else:
        raise ValueError(f"{op}: label shape {label.shape} must be {batch} or {keep} for logits "
                         f"{logits.shape} with class axis {axis}")
    logit_not = list(range(logits.ndim))
    loss_not = [None if d == axis else d for d in range(logits.ndim)]
    return axis, keep, logit_not, label_not, loss_not


@register_rule("cross_entropy")
def cross_entropy(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (logits [*B, C], label [*B] or [*B, 1]), attrs axis (class axis, default last),
    ignore_index -> (softmax like logits, loss [*B, 1]).

    Batch axes merge between logits and label (logits first). The class axis may stay sharded
    (parallel cross entropy: the kernel all-reduces max, sum-exp and the picked logit over the
    mesh dims sharding it), so no output is Partial: softmax keeps the class sharding and the
    loss is replicated on those mesh dims. Partial inputs are resolved.
    """
    op = op_name(attrs, "cross_entropy")
    if len(metas) != 2 or any(m is None for m in metas):
        raise ValueError(f"{op}: expected inputs (logits, label), got {list(metas)}")
    logits, label = metas
    mesh = mesh_shape_of(op, metas)
    _, loss_shape, logit_not, label_not, loss_not = _notations(op, logits, label, attrs)
    merged = merge_shardings([logit_not, label_not], [logits.dist_attr, label.dist_attr],
                             shapes=[logits.shape, label.shape])
    la = layout(logit_not, merged, mesh)
    return SpmdResult((la, layout(label_not, merged, mesh)),
                      (TensorMeta(logits.shape, la), TensorMeta(loss_shape,
                                                                layout(loss_not, merged, mesh))))


@register_rule("cross_entropy_grad")
def cross_entropy_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (softmax [*B, C], label, dloss [*B, 1]), attrs as cross_entropy -> dlogits like
    softmax. Batch axes merge across all three (softmax first); the class axis may stay sharded."""
    op = op_name(attrs, "cross_entropy_grad")
    if len(metas) != 3 or any(m is None for m in metas):
        raise ValueError(f"{op}: expected inputs (softmax, label, dloss), got {list(metas)}")
    sm, label, dloss = metas
    mesh = mesh_shape_of(op, metas)
    _, loss_shape, sm_not, label_not, loss_not = _notations(op, sm, label, attrs)
    if dloss.shape != loss_shape:
        raise ValueError(f"{op}: dloss has shape {dloss.shape}, expected {loss_shape}")
    merged = merge_shardings([sm_not, label_not, loss_not],
                             [sm.dist_attr, label.dist_attr, dloss.dist_attr],
                             shapes=[sm.shape, label.shape, dloss.shape])
    sa = layout(sm_not, merged, mesh)
    return SpmdResult((sa, layout(label_not, merged, mesh), layout(loss_not, merged, mesh)),
                      (TensorMeta(sm.shape, sa),))


@register_rule("cross_entropy_mean")
def cross_entropy_mean(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs and attrs as cross_entropy -> (softmax like logits, loss [], count []): the loss
    averaged over the labels not ignored and their count, both replicated (the kernel
    all-reduces the batch's sums over the mesh dims sharding the batch axes)."""
    op = op_name(attrs, "cross_entropy_mean")
    res = cross_entropy(metas, {**attrs, "op": op})
    la, lab = res.inputs
    scalar = TensorMeta((), DistAttr(la.mesh_shape, (), ()))
    return SpmdResult((la, lab), (res.outputs[0], scalar, scalar))


@register_rule("cross_entropy_mean_grad")
def cross_entropy_mean_grad(metas: Sequence[TensorMeta | None],
                            attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (softmax [*B, C], label, count [], dloss []) -> dlogits like softmax: the layouts
    of cross_entropy for softmax and label, count and dloss replicated."""
    op = op_name(attrs, "cross_entropy_mean_grad")
    if len(metas) != 4 or any(m is None for m in metas):
        raise ValueError(f"{op}: expected inputs (softmax, label, count, dloss), got "
                         f"{list(metas)}")
    for name, m in (("count", metas[2]), ("dloss", metas[3])):
        if tuple(m.shape) != ():
            raise ValueError(f"{op}: {name} must be a scalar, got shape {m.shape}")
    res = cross_entropy(metas[:2], {**attrs, "op": op})
    sa, lab = res.inputs
    rep = DistAttr(sa.mesh_shape, (), ())
    return SpmdResult((sa, lab, rep, rep), (res.outputs[0],))
