"""Slicing, slicing's grad and set_value."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, register_rule, require
from .dist_attr import DistAttr
from .einsum import keep_cheapest

__all__ = ["slice_", "slice_grad", "set_value", "parse_index"]


def parse_index(op: str, index: Sequence[Any], shape: Sequence[int]
                ) -> tuple[tuple[int, ...], list[int | None], list[bool]]:
    """Interpret a basic index (items int / slice with non-negative start, stop and positive
    step / None; missing trailing axes are full). Returns the result shape, for each result dim
    the input axis it comes from (None for a new axis), and for each input axis whether it is
    taken whole (slice covering range(size) with step 1)."""
    index = tuple(index)
    consumed = sum(1 for it in index if it is not None)
    if consumed > len(shape):
        raise ValueError(f"{op}: index {index} has {consumed} items for x of shape {tuple(shape)}")
    index = index + (slice(0, None, 1),) * (len(shape) - consumed)
    out_shape: list[int] = []
    src: list[int | None] = []
    full = [False] * len(shape)
    axis = 0
    for it in index:
        if it is None:
            out_shape.append(1)
            src.append(None)
            continue
        size = shape[axis]
        if isinstance(it, slice):
            start, stop, step = (0 if it.start is None else it.start,
                                 size if it.stop is None else it.stop,
                                 1 if it.step is None else it.step)
            if not all(isinstance(v, int) and not isinstance(v, bool)
                       for v in (start, stop, step)) \
                    or start < 0 or stop < 0 or step <= 0:
                raise ValueError(f"{op}: slice {it} on axis {axis} must have non-negative int "
                                 f"start/stop and a positive step")
            picked = range(size)[start:stop:step]
            out_shape.append(len(picked))
            src.append(axis)
            full[axis] = picked == range(size)
        elif isinstance(it, int) and not isinstance(it, bool):
            if not 0 <= it < size:
                raise ValueError(f"{op}: index {it} out of range for axis {axis} of size {size} "
                                 f"(x shape {tuple(shape)})")
        else:
            raise ValueError(f"{op}: unsupported index item {it!r}")
        axis += 1
    return tuple(out_shape), src, full


@register_rule("slice")
def slice_(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs index (see :func:`parse_index`). Axes taken by an int or by a slice
    that is not the full range are required Replicate; full-range axes keep their sharding (or
    take the others' mesh dims when cheaper: :func:`keep_cheapest`); new axes are replicated;
    Partial kept. Local index: full-range axes become ``slice(None)``, the
    others keep their global item (the axis is replicated)."""
    op = op_name(attrs, "slice")
    require(metas, op, 1)
    (x,) = metas
    mesh_shape_of(op, metas)
    out_shape, src, full = parse_index(op, attrs.get("index", ()), x.shape)
    xa = x.dist_attr
    required = keep_cheapest(x, full)
    out = xa.with_dims_mapping([() if a is None else required.dims_mapping[a] for a in src])
    return SpmdResult((required,), (TensorMeta(out_shape, out),))


@register_rule("slice_grad")
def slice_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (dout,), attrs index, input_shape -> dx of input_shape (zeros outside the slice).
    dout dims coming from full-range axes keep their sharding (so does dx on those axes); the
    other dout dims are required Replicate; Partial kept."""
    op = op_name(attrs, "slice_grad")
    require(metas, op, 1)
    (dout,) = metas
    mesh_shape_of(op, metas)
    input_shape = tuple(attrs.get("input_shape", ()))
    out_shape, src, full = parse_index(op, attrs.get("index", ()), input_shape)
    if dout.shape != out_shape:
        raise ValueError(f"{op}: dout has shape {dout.shape}, but index {attrs.get('index')} of "
                         f"input_shape {input_shape} gives {out_shape}")
    da = dout.dist_attr
    keep = [a is not None and full[a] for a in src]
    required = keep_cheapest(dout, keep)
    dx_map: list[tuple[int, ...]] = [() for _ in input_shape]
    for k, a in enumerate(src):
        if keep[k]:
            dx_map[a] = required.dims_mapping[k]
    return SpmdResult((required,), (TensorMeta(input_shape, da.with_dims_mapping(dx_map)),))


@register_rule("set_value")
def set_value(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, value), attrs index: x with ``x[index] = value`` (value broadcast numpy-style
    to the indexed region). As for slicing, axes of x taken by an int or a partial slice are
    required Replicate and full-range axes keep their sharding; each value dim that spans its
    region dim follows that dim's sharding, a broadcast (size-1) dim is replicated. Partial
    inputs are resolved. The output has x's required layout."""
    op = op_name(attrs, "set_value")
    require(metas, op, 2)
    x, value = metas
    mesh = mesh_shape_of(op, metas)
    region, src, full = parse_index(op, attrs.get("index", ()), x.shape)
    required = keep_cheapest(TensorMeta(x.shape, x.dist_attr.without_partial()), full)
    region_map = [() if a is None else required.dims_mapping[a] for a in src]
    lead = len(region) - value.ndim
    if lead < 0 or any(n not in (1, region[lead + i]) for i, n in enumerate(value.shape)):
        raise ValueError(f"{op}: value of shape {value.shape} cannot be broadcast to the indexed "
                         f"region of shape {region} (x shape {x.shape})")
    value_map = [region_map[lead + i] if n == region[lead + i] else ()
                 for i, n in enumerate(value.shape)]
    value_attr = DistAttr(tuple(mesh), tuple(value_map))
    return SpmdResult((required, value_attr), (TensorMeta(x.shape, required),))
