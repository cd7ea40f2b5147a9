"""The replicated fallback rule for ops without a real rule."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import FALLBACK_RULE, SpmdResult, TensorMeta, mesh_shape_of, op_name, register_rule
from .dist_attr import DistAttr

__all__ = ["replicated"]


@register_rule(FALLBACK_RULE)
def replicated(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """Every present input is required Replicate (no partial); attrs out_shapes (tuple of global
    shapes) gives the outputs, all Replicate. With no tensor input, attrs mesh_shape is used."""
    op = op_name(attrs, FALLBACK_RULE)
    mesh = mesh_shape_of(op, metas, attrs)
    shapes = attrs.get("out_shapes")
    if shapes is None:
        raise ValueError(f"{op}: the replicated rule needs attrs['out_shapes']")
    inputs = tuple(None if m is None else DistAttr.replicated(m.ndim, mesh) for m in metas)
    outputs = tuple(TensorMeta(tuple(s), DistAttr.replicated(len(s), mesh)) for s in shapes)
    return SpmdResult(inputs, outputs)
