"""softmax / log_softmax and their grads (rule ``softmax``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, check_axis, mesh_shape_of, op_name, register_rule
from .einsum import layout, merge_shardings

__all__ = ["softmax"]


@register_rule("softmax")
def softmax(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs: any number of same-shape tensors (x; or out, dout for the grads), attrs axis,
    num_outputs (default 1). The softmax axis is required Replicate, the other axes merge across
    inputs (first wins); no partials. Every output is shaped and laid out like input 0."""
    op = op_name(attrs, "softmax")
    if not metas or any(m is None for m in metas):
        raise ValueError(f"{op}: every input must be a tensor, got {list(metas)}")
    mesh = mesh_shape_of(op, metas)
    shape = metas[0].shape
    for i, m in enumerate(metas[1:], 1):
        if m.shape != shape:
            raise ValueError(f"{op}: input {i} has shape {m.shape}, expected {shape} like input 0")
    ndim = len(shape)
    axis = attrs.get("axis", ndim - 1 if ndim else 0)
    if ndim:
        check_axis(op, "axis", axis, ndim)
    notation = [None if d == axis else d for d in range(ndim)]
    merged = merge_shardings([notation] * len(metas), [m.dist_attr for m in metas],
                             shapes=[m.shape for m in metas])
    attr = layout(notation, merged, mesh)
    n_out = int(attrs.get("num_outputs", 1))
    return SpmdResult(tuple(attr for _ in metas), tuple(TensorMeta(shape, attr)
                                                        for _ in range(n_out)))
