"""layer_norm, batch_norm and their grads."""
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
    prod,
    register_rule,
    require,
)
from .einsum import layout, merge_shardings
from .placement import ReduceType

__all__ = ["layer_norm", "layer_norm_grad", "batch_norm", "batch_norm_grad", "channel_axis",
           "rms_norm", "rms_norm_grad"]


def _begin(op: str, attrs: Mapping[str, Any], x: TensorMeta) -> int:
    return check_axis(op, "begin_norm_axis", attrs.get("begin_norm_axis", x.ndim - 1), x.ndim,
                      allow_end=True)


def _check_affine(op: str, name: str, meta: TensorMeta | None, x: TensorMeta, begin: int) -> None:
    if meta is not None and prod(meta.shape) != prod(x.shape[begin:]):
        raise ValueError(f"{op}: {name} shape {meta.shape} does not match x.shape[{begin}:] = "
                         f"{x.shape[begin:]} of x {x.shape}")


def _check_stat(op: str, name: str, meta: TensorMeta, want: tuple[int, ...]) -> None:
    if meta.shape != want:
        raise ValueError(f"{op}: {name} has shape {meta.shape}, expected {want}")


@register_rule("layer_norm")
def layer_norm(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight|None, bias|None), attrs begin_norm_axis.

    Axes >= begin_norm_axis are required Replicate, leading axes keep x's sharding; weight and
    bias (shape x.shape[begin:], flattened or not) are Replicate; no partials. Outputs:
    (out like x, mean [x.shape[:begin]], rstd [x.shape[:begin]]) sharded like x's leading axes.
    """
    op = op_name(attrs, "layer_norm")
    require(metas, op, 3, optional=(1, 2))
    x, w, b = metas
    mesh = mesh_shape_of(op, metas)
    begin = _begin(op, attrs, x)
    _check_affine(op, "weight", w, x, begin)
    _check_affine(op, "bias", b, x, begin)
    x_not = [d if d < begin else None for d in range(x.ndim)]
    merged = merge_shardings([x_not], [x.dist_attr], shapes=[x.shape])
    xa = layout(x_not, merged, mesh)
    stat = TensorMeta(x.shape[:begin], layout(range(begin), merged, mesh))
    rep = [None if m is None else layout([None] * m.ndim, {}, mesh) for m in (w, b)]
    return SpmdResult((xa, *rep), (TensorMeta(x.shape, xa), stat, stat))


@register_rule("layer_norm_grad")
def layer_norm_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight|None, mean, rstd, dout), attrs begin_norm_axis.

    Leading axes merge across x, mean, rstd, dout (x first); trailing axes and weight Replicate.
    Outputs (dx like x, dweight, dbias): dweight/dbias have the weight's shape (x.shape[begin:]
    when weight is None) and are Partial(sum) on the mesh dims sharding the leading axes.
    """
    op = op_name(attrs, "layer_norm_grad")
    require(metas, op, 5, optional=(1,))
    x, w, mean, rstd, dout = metas
    mesh = mesh_shape_of(op, metas)
    begin = _begin(op, attrs, x)
    _check_affine(op, "weight", w, x, begin)
    _check_stat(op, "mean", mean, x.shape[:begin])
    _check_stat(op, "rstd", rstd, x.shape[:begin])
    _check_stat(op, "dout", dout, x.shape)
    x_not = [d if d < begin else None for d in range(x.ndim)]
    lead = list(range(begin))
    merged = merge_shardings([x_not, None, lead, lead, x_not],
                             [m.dist_attr if m is not None else None for m in metas],
                             shapes=[None if m is None else m.shape for m in metas])
    xa = layout(x_not, merged, mesh)
    sa = layout(lead, merged, mesh)
    pshape = w.shape if w is not None else x.shape[begin:]
    partial = [(m, ReduceType.SUM) for dm in merged.values() for m in dm]
    pa = layout([None] * len(pshape), {}, mesh, partial)
    wa = None if w is None else layout([None] * w.ndim, {}, mesh)
    return SpmdResult((xa, wa, sa, sa, xa),
                      (TensorMeta(x.shape, xa), TensorMeta(pshape, pa), TensorMeta(pshape, pa)))


def channel_axis(op: str, attrs: Mapping[str, Any], ndim: int) -> int:
    """Channel axis of a batch_norm input: 1 for data_format "NC", "NCL", "NCHW", "NCDHW"
    (default "NCHW"); last for "NLC", "NHWC", "NDHWC"."""
    fmt = str(attrs.get("data_format", "NCHW"))
    if fmt in ("NC", "NCL", "NCHW", "NCDHW"):
        return 1
    if fmt in ("NLC", "NHWC", "NDHWC"):
        return ndim - 1
    raise ValueError(f"{op}: unknown data_format {fmt!r}")


def _bn_setup(op: str, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any],
              vec_inputs: Sequence[int], names: Sequence[str]):
    x = metas[0]
    check_ndim(op, "x", x, min_ndim=2)
    c_axis = channel_axis(op, attrs, x.ndim)
    channels = x.shape[c_axis]
    for i, name in zip(vec_inputs, names):
        m = metas[i]
        if m is not None and m.shape != (channels,):
            raise ValueError(f"{op}: {name} has shape {m.shape}, expected ({channels},) "
                             f"for x {x.shape} with channel axis {c_axis}")
    x_not = ["c" if d == c_axis else d for d in range(x.ndim)]
    return x, x_not


@register_rule("batch_norm")
def batch_norm(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x [N, C, *spatial], running_mean [C], running_var [C], weight|None, bias|None),
    attrs training, momentum, epsilon, data_format (see :func:`channel_axis`).

    The channel axis sharding merges across x and the 1-d inputs (first sharded wins, x first);
    non-channel axes of x keep their sharding in training and eval (the kernel all-reduces the
    per-channel statistics over the mesh dims sharding them), so no output is Partial; partial
    inputs are resolved. Outputs: (out like x, mean_out, variance_out, saved_mean, saved_rstd),
    each [C] sharded like the channel axis.
    """
    op = op_name(attrs, "batch_norm")
    require(metas, op, 5, optional=(3, 4))
    mesh = mesh_shape_of(op, metas)
    x, x_not = _bn_setup(op, metas, attrs, (1, 2, 3, 4),
                         ("running_mean", "running_var", "weight", "bias"))
    nots = [x_not, ["c"], ["c"], ["c"], ["c"]]
    merged = merge_shardings(nots, [m.dist_attr if m is not None else None for m in metas],
                             shapes=[None if m is None else m.shape for m in metas])
    xa, ca = layout(x_not, merged, mesh), layout(["c"], merged, mesh)
    vec = TensorMeta((x.shape[x_not.index("c")],), ca)
    return SpmdResult((xa, ca, ca, *(None if m is None else ca for m in metas[3:])),
                      (TensorMeta(x.shape, xa), vec, vec, vec, vec))


@register_rule("batch_norm_grad")
def batch_norm_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight|None, saved_mean, saved_rstd, dout), attrs as batch_norm.

    Same merge as batch_norm (dout like x). Outputs (dx like x, dweight [C], dbias [C]) sharded
    on the channel axis and never Partial (the kernel all-reduces over the non-channel mesh dims).
    """
    op = op_name(attrs, "batch_norm_grad")
    require(metas, op, 5, optional=(1,))
    mesh = mesh_shape_of(op, metas)
    x, x_not = _bn_setup(op, metas, attrs, (1, 2, 3), ("weight", "saved_mean", "saved_rstd"))
    if metas[4].shape != x.shape:
        raise ValueError(f"{op}: dout has shape {metas[4].shape}, expected {x.shape} like x")
    nots = [x_not, ["c"], ["c"], ["c"], x_not]
    merged = merge_shardings(nots, [m.dist_attr if m is not None else None for m in metas],
                             shapes=[None if m is None else m.shape for m in metas])
    xa, ca = layout(x_not, merged, mesh), layout(["c"], merged, mesh)
    vec = TensorMeta((x.shape[x_not.index("c")],), ca)
    return SpmdResult((xa, None if metas[1] is None else ca, ca, ca, xa),
                      (TensorMeta(x.shape, xa), vec, vec))


def _rms_setup(op: str, metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]):
    x, w = metas[0], metas[1]
    begin = _begin(op, attrs, x)
    if w is not None and w.shape != x.shape[begin:]:
        raise ValueError(f"{op}: weight shape {list(w.shape)} does not match "
                         f"x.shape[{begin}:] = {list(x.shape[begin:])} of x {list(x.shape)}")
    return x, begin, list(range(x.ndim)), list(range(begin, x.ndim))


@register_rule("rms_norm")
def rms_norm(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight|None), attrs begin_norm_axis.

    Every axis of x keeps its sharding, the normalized ones too: the kernel all-reduces its
    rows' sums of squares over the mesh dims sharding them (``[rows]`` values, never x);
    weight is sliced like x's normalized axes; Partial inputs are resolved. Outputs (out like
    x, rstd ``x.shape[:begin]`` sharded like the leading axes)."""
    op = op_name(attrs, "rms_norm")
    require(metas, op, 2, optional=(1,))
    mesh = mesh_shape_of(op, metas)
    x, begin, x_not, w_not = _rms_setup(op, metas, attrs)
    merged = merge_shardings([x_not, w_not], [m.dist_attr if m is not None else None
                                              for m in metas],
                             shapes=[None if m is None else m.shape for m in metas])
    xa = layout(x_not, merged, mesh)
    wa = None if metas[1] is None else layout(w_not, merged, mesh)
    stat = TensorMeta(x.shape[:begin], layout(range(begin), merged, mesh))
    return SpmdResult((xa, wa), (TensorMeta(x.shape, xa), stat))


@register_rule("rms_norm_grad")
def rms_norm_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight|None, rstd, dout), attrs begin_norm_axis; laid out as in the forward.
    Outputs (dx like x, dweight like weight, Partial(sum) over the mesh dims sharding the
    leading axes; shaped x.shape[begin:] when weight is None)."""
    op = op_name(attrs, "rms_norm_grad")
    require(metas, op, 4, optional=(1,))
    mesh = mesh_shape_of(op, metas)
    x, begin, x_not, w_not = _rms_setup(op, metas, attrs)
    _check_stat(op, "rstd", metas[2], x.shape[:begin])
    _check_stat(op, "dout", metas[3], x.shape)
    lead = list(range(begin))
    merged = merge_shardings([x_not, w_not, lead, x_not],
                             [m.dist_attr if m is not None else None for m in metas],
                             shapes=[None if m is None else m.shape for m in metas])
    xa = layout(x_not, merged, mesh)
    wa = None if metas[1] is None else layout(w_not, merged, mesh)
    partial = [(m, ReduceType.SUM) for lab in lead for m in merged.get(lab, ())]
    dw = TensorMeta(x.shape[begin:], layout(w_not, merged, mesh, partial))
    return SpmdResult((xa, wa, layout(lead, merged, mesh), xa), (TensorMeta(x.shape, xa), dw))
