"""tile and expand (broadcast_to)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, register_rule, require
from .einsum import keep_cheapest

__all__ = ["tile", "expand"]


def _int_tuple(op: str, name: str, value: Any) -> tuple[int, ...]:
    value = tuple(value) if value is not None else None
    if value is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ValueError(f"{op}: {name} must be a tuple of non-negative ints, got {value!r}")
    return value


@register_rule("tile")
def tile(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs repeat_times (numpy.tile: shorter reps are padded with leading 1s,
    longer ones add leading axes). Axes repeated more than once are required Replicate, the
    others keep their sharding (a repeated axis's mesh dims move to them when that is cheaper:
    :func:`keep_cheapest`); new leading axes are replicated; Partial kept."""
    op = op_name(attrs, "tile")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    reps = _int_tuple(op, "repeat_times", attrs.get("repeat_times"))
    ndim = max(x.ndim, len(reps))
    reps = (1,) * (ndim - len(reps)) + reps
    lead = ndim - x.ndim
    xa = x.dist_attr
    required = keep_cheapest(x, [reps[lead + d] == 1 for d in range(x.ndim)])
    out_shape = tuple(((1,) * lead + x.shape)[d] * reps[d] for d in range(ndim))
    out = xa.with_dims_mapping(((),) * lead + required.dims_mapping)
    return SpmdResult((required,), (TensorMeta(out_shape, out),))


@register_rule("expand")
def expand(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs shape (global target, numpy broadcast_to rules). Expanded axes
    (size 1 -> n != 1) and new leading axes are replicated, the others keep their sharding
    (or take an expanded axis's mesh dims when cheaper: :func:`keep_cheapest`); Partial kept."""
    op = op_name(attrs, "expand")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    shape = _int_tuple(op, "shape", attrs.get("shape"))
    lead = len(shape) - x.ndim
    if lead < 0 or any(s != t and s != 1 for s, t in zip(x.shape, shape[lead:])):
        raise ValueError(f"{op}: cannot expand x of shape {x.shape} to {shape}")
    xa = x.dist_attr
    required = keep_cheapest(x, [s == t for s, t in zip(x.shape, shape[lead:])])
    out = xa.with_dims_mapping(((),) * lead + required.dims_mapping)
    return SpmdResult((required,), (TensorMeta(shape, out),))
