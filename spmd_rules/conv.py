"""Convolution, pooling, resampling and padding over ``[N, C, H, W]`` inputs (rules ``conv2d``,
``conv2d_grad``, ``pool2d``, ``pool2d_grad``, ``pad``, ``pad_grad``), and the output-size
arithmetic the kernels share with them.

Layouts: the batch axis keeps its sharding (data parallel, no communication); channels follow
the weight (``conv2d`` with ``groups == 1``: output channels sharded with the weight's dim 0 —
column parallel — and input channels with its dim 1 — row parallel, output Partial(sum));
pooling keeps the channel sharding. The spatial axes H, W are required whole on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, check_ndim, mesh_shape_of, op_name, register_rule, require
from .einsum import layout, merge_shardings
from .placement import ReduceType

__all__ = ["conv_out_size", "pool_out_size", "conv2d", "conv2d_grad", "pool2d", "pool2d_grad",
           "pad", "pad_grad", "pool2d_out_hw"]


def conv_out_size(n: int, k: int, stride: int, pad0: int, pad1: int, dilation: int) -> int:
    """Output length of a convolution window sweep (floor division, as Paddle and PyTorch)."""
    return (n + pad0 + pad1 - dilation * (k - 1) - 1) // stride + 1


def pool_out_size(n: int, k: int, stride: int, pad0: int, pad1: int, ceil_mode: bool) -> int:
    """Output length of a pooling sweep; with ``ceil_mode`` a last partial window counts when it
    starts inside the input or its leading padding (PyTorch's rule)."""
    span = n + pad0 + pad1 - k
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + pad0:
        out -= 1
    return out


def pool2d_out_hw(op: str, hw: Sequence[int], attrs: Mapping[str, Any]) -> tuple[int, int]:
    """The output (H, W) of a ``pool2d``-rule op from its attrs: ``out_hw`` given, or computed
    from ``kernel_size``, ``stride``, ``padding`` (top, bottom, left, right), ``ceil_mode``."""
    if attrs.get("out_hw") is not None:
        return tuple(int(v) for v in attrs["out_hw"])
    (kh, kw), (sh, sw) = attrs["kernel_size"], attrs["stride"]
    pt, pb, pl, pr = attrs["padding"]
    ceil = bool(attrs.get("ceil_mode", False))
    out = (pool_out_size(hw[0], kh, sh, pt, pb, ceil), pool_out_size(hw[1], kw, sw, pl, pr, ceil))
    if min(out) <= 0:
        raise ValueError(f"{op}: output size {list(out)} is not positive for input H, W "
                         f"{list(hw)}, kernel_size {[kh, kw]}, stride {[sh, sw]}, padding "
                         f"{[pt, pb, pl, pr]}")
    return out


def _conv_out_shape(op: str, x: TensorMeta, w: TensorMeta, attrs: Mapping[str, Any]
                    ) -> tuple[int, ...]:
    check_ndim(op, "x", x, (4,))
    check_ndim(op, "weight", w, (4,))
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    groups = int(attrs.get("groups", 1))
    if groups <= 0 or c % groups or o % groups:
        raise ValueError(f"{op}: groups={groups} must divide the input channels {c} of x "
                         f"{list(x.shape)} and the output channels {o} of weight {list(w.shape)}")
    if cg * groups != c:
        raise ValueError(f"{op}: x {list(x.shape)} has {c} channels but weight {list(w.shape)} "
                         f"expects {cg} per group x groups={groups} = {cg * groups}")
    (sh, sw), (dh, dw) = attrs["stride"], attrs["dilation"]
    pt, pb, pl, pr = attrs["padding"]
    ho = conv_out_size(h, kh, sh, pt, pb, dh)
    wo = conv_out_size(wd, kw, sw, pl, pr, dw)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"{op}: kernel {[kh, kw]} (dilation {[dh, dw]}) is larger than the "
                         f"padded input {[h + pt + pb, wd + pl + pr]} of x {list(x.shape)}: "
                         f"output size {[ho, wo]}")
    return (n, o, ho, wo)


def _conv_notations(attrs: Mapping[str, Any]):
    """x, weight and out notations: channels are labels only without groups."""
    grouped = int(attrs.get("groups", 1)) != 1
    c, o = (None, None) if grouped else ("c", "o")
    return ["n", c, None, None], [o, c, None, None], ["n", o, None, None]


@register_rule("conv2d")
def conv2d(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x [N, C, H, W], weight [O, C/groups, kh, kw]), attrs stride, padding (top, bottom,
    left, right), dilation, groups.

    Batch and (without groups) both channel axes merge across x and weight at the fewest moved
    bytes; H and W are Replicate. Mesh dims on the input channels make the output
    Partial(sum) (row-parallel conv); partial inputs are resolved."""
    op = op_name(attrs, "conv2d")
    require(metas, op, 2)
    x, w = metas
    mesh = mesh_shape_of(op, metas)
    out_shape = _conv_out_shape(op, x, w, attrs)
    xn, wn, on = _conv_notations(attrs)
    merged = merge_shardings([xn, wn], [x.dist_attr, w.dist_attr], shapes=[x.shape, w.shape])
    partial = [(m, ReduceType.SUM) for m in merged.get("c", ())]
    return SpmdResult((layout(xn, merged, mesh), layout(wn, merged, mesh)),
                      (TensorMeta(out_shape, layout(on, merged, mesh, partial)),))


@register_rule("conv2d_grad")
def conv2d_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight, dout), attrs as conv2d. Outputs (dx like x, dweight like weight):
    dx is Partial(sum) over the mesh dims sharding the output channels, dweight over those
    sharding the batch."""
    op = op_name(attrs, "conv2d_grad")
    require(metas, op, 3)
    x, w, dout = metas
    mesh = mesh_shape_of(op, metas)
    out_shape = _conv_out_shape(op, x, w, attrs)
    if dout.shape != out_shape:
        raise ValueError(f"{op}: dout has shape {list(dout.shape)}, expected {list(out_shape)}")
    xn, wn, on = _conv_notations(attrs)
    merged = merge_shardings([xn, wn, on], [m.dist_attr for m in metas],
                             shapes=[m.shape for m in metas])
    dx_partial = [(m, ReduceType.SUM) for m in merged.get("o", ())]
    dw_partial = [(m, ReduceType.SUM) for m in merged.get("n", ())]
    return SpmdResult(tuple(layout(n, merged, mesh) for n in (xn, wn, on)),
                      (TensorMeta(x.shape, layout(xn, merged, mesh, dx_partial)),
                       TensorMeta(w.shape, layout(wn, merged, mesh, dw_partial))))


_NC = ["n", "c", None, None]


@register_rule("pool2d")
def pool2d(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x [N, C, H, W]); output [N, C, Ho, Wo] (:func:`pool2d_out_hw`). N and C keep
    their sharding, H and W are Replicate; a Partial input is resolved."""
    op = op_name(attrs, "pool2d")
    require(metas, op, 1)
    (x,) = metas
    check_ndim(op, "x", x, (4,))
    mesh = mesh_shape_of(op, metas)
    ho, wo = pool2d_out_hw(op, x.shape[2:], attrs)
    merged = merge_shardings([_NC], [x.dist_attr], shapes=[x.shape])
    xa = layout(_NC, merged, mesh)
    return SpmdResult((xa,), (TensorMeta((*x.shape[:2], ho, wo), xa),))


@register_rule("pool2d_grad")
def pool2d_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, dout); output dx like x. N and C merge across x and dout; H, W Replicate."""
    op = op_name(attrs, "pool2d_grad")
    require(metas, op, 2)
    x, dout = metas
    check_ndim(op, "x", x, (4,))
    mesh = mesh_shape_of(op, metas)
    want = (*x.shape[:2], *pool2d_out_hw(op, x.shape[2:], attrs))
    if dout.shape != want:
        raise ValueError(f"{op}: dout has shape {list(dout.shape)}, expected {list(want)}")
    merged = merge_shardings([_NC, _NC], [x.dist_attr, dout.dist_attr],
                             shapes=[x.shape, dout.shape])
    xa = layout(_NC, merged, mesh)
    return SpmdResult((xa, xa), (TensorMeta(x.shape, xa),))


def _padded(op: str, x: TensorMeta, pads: Sequence[Sequence[int]], sign: int) -> tuple[int, ...]:
    if len(pads) != x.ndim:
        raise ValueError(f"{op}: pads {list(pads)} give {len(pads)} (before, after) pairs for x "
                         f"of shape {list(x.shape)}")
    shape = tuple(s + sign * (a + b) for s, (a, b) in zip(x.shape, pads))
    if any(s < 0 for s in shape):
        raise ValueError(f"{op}: pads {list(pads)} do not fit shape {list(x.shape)}")
    return shape


def _pad_layout(op: str, x: TensorMeta, pads: Sequence[Sequence[int]]):
    notation = [d if a == 0 and b == 0 else None for d, (a, b) in enumerate(pads)]
    merged = merge_shardings([notation], [x.dist_attr], shapes=[x.shape])
    return layout(notation, merged, mesh_shape_of(op, [x]))


@register_rule("pad")
def pad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x), attrs pads ((before, after) per axis). Padded axes are Replicate, the others
    keep their sharding; a Partial input is resolved."""
    op = op_name(attrs, "pad")
    require(metas, op, 1)
    (x,) = metas
    out = _padded(op, x, attrs["pads"], +1)
    xa = _pad_layout(op, x, attrs["pads"])
    return SpmdResult((xa,), (TensorMeta(out, xa),))


@register_rule("pad_grad")
def pad_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (dout), attrs pads: the gradient of the unpadded input, laid out as ``pad``."""
    op = op_name(attrs, "pad_grad")
    require(metas, op, 1)
    (g,) = metas
    out = _padded(op, g, attrs["pads"], -1)
    ga = _pad_layout(op, g, attrs["pads"])
    return SpmdResult((ga,), (TensorMeta(out, ga),))
