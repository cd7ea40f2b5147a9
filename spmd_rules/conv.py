"""Convolution, pooling, resampling and padding over ``[N, C, H, W]`` inputs (rules ``conv2d``,
``conv2d_grad``, ``conv2d_transpose``, ``conv2d_transpose_grad``, ``pool2d``, ``pool2d_grad``,
``pad``, ``pad_grad``), and the output-size arithmetic the kernels share with them.

Layouts: the batch axis keeps its sharding (data parallel, no communication); channels follow
the weight (``conv2d`` with ``groups == 1``: output channels sharded with the weight's dim 0 —
column parallel — and input channels with its dim 1 — row parallel, output Partial(sum));
pooling keeps the channel sharding.

Spatial sharding: conv2d, window pooling and resampling (adaptive average pooling,
interpolation) keep H (and/or W) sharded when x already is, each by one mesh dim, and pad keeps
any padded axis so sharded; the output's pieces are the usual split of the output size, and
each rank reads the input rows its output rows need from its two neighbours along that mesh
dim (a halo exchange, :func:`halo_plan` over a :class:`Window` or a :class:`Support`; the
rules check on every rank that no piece needs more than its neighbours hold: conv2d and
window pooling raise, resampling and pad move the axis instead). conv2d_transpose and
adaptive max pooling require H and W whole.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from .base import SpmdResult, TensorMeta, check_ndim, mesh_shape_of, op_name, register_rule, require
from .dist_attr import split_range
from .einsum import assignments, layout
from .placement import ReduceType
from .redistribute import reshard_cost

__all__ = ["conv_out_size", "pool_out_size", "conv2d", "conv2d_grad", "pool2d", "pool2d_grad",
           "conv_transpose_out_size", "conv2d_transpose", "conv2d_transpose_grad",
           "pad", "pad_grad", "pool2d_out_hw", "Window", "Support", "resample_spans", "sweep",
           "halo_plan", "HaloPlan", "merge_spatial", "pad_spans", "pad_sweep", "spatial_pad_axes"]


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
    """``(h, w) -> [x, weight, out]`` notations: channels are labels only without groups."""
    grouped = int(attrs.get("groups", 1)) != 1
    c, o = (None, None) if grouped else ("c", "o")
    return lambda h, w: [["n", c, h, w], [o, c, None, None], ["n", o, h, w]]


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
    merged, (xn, wn, on) = merge_spatial(metas, _conv_notations(attrs), lambda merged: (
        check_spatial(op, x, attrs, w.shape[2:], out_shape[2:], merged)))
    partial = [(m, ReduceType.SUM) for m in merged.get("c", ())]
    return SpmdResult((layout(xn, merged, mesh), layout(wn, merged, mesh)),
                      (TensorMeta(out_shape, layout(on, merged, mesh, partial)),))


@register_rule("conv2d_grad")
def conv2d_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, weight, dout), attrs as conv2d. Outputs (dx like x, dweight like weight):
    dx is Partial(sum) over the mesh dims sharding the output channels, dweight over those
    sharding the batch and the spatial axes."""
    op = op_name(attrs, "conv2d_grad")
    require(metas, op, 3)
    x, w, dout = metas
    mesh = mesh_shape_of(op, metas)
    out_shape = _conv_out_shape(op, x, w, attrs)
    if dout.shape != out_shape:
        raise ValueError(f"{op}: dout has shape {list(dout.shape)}, expected {list(out_shape)}")
    merged, (xn, wn, on) = merge_spatial(metas, _conv_notations(attrs), lambda merged: (
        check_spatial(op, x, attrs, w.shape[2:], out_shape[2:], merged)))
    dx_partial = [(m, ReduceType.SUM) for m in merged.get("o", ())]
    dw_partial = [(m, ReduceType.SUM) for lab in ("n", "h", "w") for m in merged.get(lab, ())]
    return SpmdResult(tuple(layout(n, merged, mesh) for n in (xn, wn, on)),
                      (TensorMeta(x.shape, layout(xn, merged, mesh, dx_partial)),
                       TensorMeta(w.shape, layout(wn, merged, mesh, dw_partial))))



def conv_transpose_out_size(n: int, k: int, stride: int, pad0: int, pad1: int, dilation: int,
                            extra: int) -> int:
    """Output length of a transposed convolution: ``(n - 1) * stride - pad0 - pad1 +
    dilation * (k - 1) + 1 + extra`` (``extra``: the output padding, below the stride)."""
    return (n - 1) * stride - pad0 - pad1 + dilation * (k - 1) + 1 + extra


def _conv_transpose_out_shape(op: str, x: TensorMeta, w: TensorMeta,
                              attrs: Mapping[str, Any]) -> tuple[int, ...]:
    check_ndim(op, "x", x, (4,))
    check_ndim(op, "weight", w, (4,))
    n, c, h, wd = x.shape
    ci, og, kh, kw = w.shape
    groups = int(attrs.get("groups", 1))
    if groups <= 0 or c % groups:
        raise ValueError(f"{op}: groups={groups} must divide the input channels {c} of x "
                         f"{list(x.shape)}")
    if ci != c:
        raise ValueError(f"{op}: x {list(x.shape)} has {c} channels but weight {list(w.shape)} "
                         f"[in_channels, out_channels / groups, kh, kw] expects {ci}")
    (sh, sw), (dh, dw) = attrs["stride"], attrs["dilation"]
    pt, pb, pl, pr = attrs["padding"]
    eh, ew = attrs["output_padding"]
    if not (0 <= eh < sh and 0 <= ew < sw):
        raise ValueError(f"{op}: output_padding {[eh, ew]} must be non-negative and smaller "
                         f"than the stride {[sh, sw]}")
    out = (conv_transpose_out_size(h, kh, sh, pt, pb, dh, eh),
           conv_transpose_out_size(wd, kw, sw, pl, pr, dw, ew))
    if min(out) <= 0 or 0 in (h, wd):
        raise ValueError(f"{op}: output size {list(out)} of x {list(x.shape)}, kernel "
                         f"{[kh, kw]}, stride {[sh, sw]}, padding {[pt, pb, pl, pr]} is not "
                         f"positive")
    return (n, og * groups, *out)


def _transpose_notations(attrs: Mapping[str, Any]):
    """Notations of (x, weight [C, O/groups, kh, kw], out): H and W whole."""
    grouped = int(attrs.get("groups", 1)) != 1
    c, o = (None, None) if grouped else ("c", "o")
    return lambda h, w: [["n", c, None, None], [c, o, None, None], ["n", o, None, None]]


def _whole_hw(merged: dict) -> None:
    """The ``check`` of :func:`merge_spatial` for ops that keep H and W whole."""


@register_rule("conv2d_transpose")
def conv2d_transpose(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
                     ) -> SpmdResult:
    """inputs (x [N, C, H, W], weight [C, O/groups, kh, kw]), attrs stride, padding, dilation,
    groups, output_padding. The batch and (without groups) both channel axes merge across x
    and weight at the fewest moved bytes: output channels sharded with the weight's dim 1;
    mesh dims on the input channels (weight dim 0) make the output Partial(sum). H and W are
    Replicate; partial inputs are resolved."""
    op = op_name(attrs, "conv2d_transpose")
    require(metas, op, 2)
    x, w = metas
    mesh = mesh_shape_of(op, metas)
    out_shape = _conv_transpose_out_shape(op, x, w, attrs)
    merged, (xn, wn, on) = merge_spatial(metas, _transpose_notations(attrs), _whole_hw, False)
    partial = [(m, ReduceType.SUM) for m in merged.get("c", ())]
    return SpmdResult((layout(xn, merged, mesh), layout(wn, merged, mesh)),
                      (TensorMeta(out_shape, layout(on, merged, mesh, partial)),))


@register_rule("conv2d_transpose_grad")
def conv2d_transpose_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]
                          ) -> SpmdResult:
    """inputs (x, weight, dout), attrs as conv2d_transpose. Outputs (dx like x, dweight like
    weight): dx is Partial(sum) over the mesh dims sharding the output channels, dweight over
    those sharding the batch."""
    op = op_name(attrs, "conv2d_transpose_grad")
    require(metas, op, 3)
    x, w, dout = metas
    mesh = mesh_shape_of(op, metas)
    out_shape = _conv_transpose_out_shape(op, x, w, attrs)
    if dout.shape != out_shape:
        raise ValueError(f"{op}: dout has shape {list(dout.shape)}, expected {list(out_shape)}")
    merged, (xn, wn, on) = merge_spatial(metas, _transpose_notations(attrs), _whole_hw, False)
    dx_partial = [(m, ReduceType.SUM) for m in merged.get("o", ())]
    dw_partial = [(m, ReduceType.SUM) for m in merged.get("n", ())]
    return SpmdResult(tuple(layout(n, merged, mesh) for n in (xn, wn, on)),
                      (TensorMeta(x.shape, layout(xn, merged, mesh, dx_partial)),
                       TensorMeta(w.shape, layout(wn, merged, mesh, dw_partial))))


def _check_pool_spatial(op, x, attrs, out_hw, merged) -> None:
    if attrs.get("spatial"):
        check_spatial(op, x, attrs, attrs.get("kernel_size"), out_hw, merged)


@register_rule("pool2d")
def pool2d(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x [N, C, H, W]); output [N, C, Ho, Wo] (:func:`pool2d_out_hw`). N and C keep
    their sharding; H and W too when attrs ``spatial`` (window pooling, resampling) and x is so
    sharded (halo exchange), else they are Replicate; a Partial input is resolved. A
    resampling (attrs ``mode``) whose halo does not fit gathers the axis instead of raising."""
    op = op_name(attrs, "pool2d")
    require(metas, op, 1)
    (x,) = metas
    check_ndim(op, "x", x, (4,))
    mesh = mesh_shape_of(op, metas)
    ho, wo = pool2d_out_hw(op, x.shape[2:], attrs)
    merged, (notation,) = merge_spatial(
        metas, lambda h, w: [["n", "c", h, w]],
        lambda merged: _check_pool_spatial(op, x, attrs, (ho, wo), merged),
        bool(attrs.get("spatial")), attrs.get("mode") is None)
    xa = layout(notation, merged, mesh)
    return SpmdResult((xa,), (TensorMeta((*x.shape[:2], ho, wo), xa),))


@register_rule("pool2d_grad")
def pool2d_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, dout); output dx like x. N and C (and spatial axes as in ``pool2d``) merge
    across x and dout."""
    op = op_name(attrs, "pool2d_grad")
    require(metas, op, 2)
    x, dout = metas
    check_ndim(op, "x", x, (4,))
    mesh = mesh_shape_of(op, metas)
    out_hw = pool2d_out_hw(op, x.shape[2:], attrs)
    want = (*x.shape[:2], *out_hw)
    if dout.shape != want:
        raise ValueError(f"{op}: dout has shape {list(dout.shape)}, expected {list(want)}")
    merged, (notation, _) = merge_spatial(
        metas, lambda h, w: [["n", "c", h, w]] * 2,
        lambda merged: _check_pool_spatial(op, x, attrs, out_hw, merged),
        bool(attrs.get("spatial")), attrs.get("mode") is None)
    xa, ga = layout(notation, merged, mesh), layout(notation, merged, mesh)
    return SpmdResult((xa, ga), (TensorMeta(x.shape, xa),))


def _padded(op: str, x: TensorMeta, pads: Sequence[Sequence[int]], sign: int) -> tuple[int, ...]:
    if len(pads) != x.ndim:
        raise ValueError(f"{op}: pads {list(pads)} give {len(pads)} (before, after) pairs for x "
                         f"of shape {list(x.shape)}")
    shape = tuple(s + sign * (a + b) for s, (a, b) in zip(x.shape, pads))
    if any(s < 0 for s in shape):
        raise ValueError(f"{op}: pads {list(pads)} do not fit shape {list(x.shape)}")
    return shape


def pad_spans(mode: str, n: int, before: int, after: int) -> tuple[tuple[int, int], ...]:
    """For each output of padding an axis of ``n`` by (before, after), the input index
    ``[lo, hi)`` it copies (``mode`` reflect: mirrored without the edge; replicate: the edge);
    for a constant row the empty span at the nearer end."""
    spans = []
    for i in range(n + before + after):
        src = i - before
        if mode == "reflect":
            src = -src if src < 0 else 2 * (n - 1) - src if src >= n else src
        elif mode == "replicate":
            src = min(max(src, 0), n - 1)
        spans.append((0, 0) if src < 0 else (n, n) if src >= n else (src, src + 1))
    return tuple(spans)


def pad_sweep(mode: str, n: int, before: int, after: int) -> Support:
    """The :class:`Support` of padding an axis of ``n`` by (before, after)."""
    return Support(n, n + before + after, pad_spans(mode, n, before, after))


def _pad_halo_fits(op: str, x: TensorMeta, attrs: Mapping[str, Any], axis: int,
                   mesh_dim: int) -> bool:
    """Whether padded ``axis`` split over ``mesh_dim`` alone can run with a halo exchange."""
    (a, b), parts = attrs["pads"][axis], x.dist_attr.mesh_shape[mesh_dim]
    try:
        check_halo(op, axis, pad_sweep(attrs["mode"], x.shape[axis], a, b), parts, mesh_dim)
    except ValueError:
        return False
    return True


def spatial_pad_axes(op: str, x: TensorMeta, attrs: Mapping[str, Any]) -> dict[int, int]:
    """Padded axes that stay sharded in x's own layout, as the rule keeps them: axis -> mesh
    dim for each padded axis x shards by one mesh dim whose output pieces read only their own
    and their neighbours' input pieces (a halo exchange; none on a mesh dim of one rank)."""
    return {d: dims[0] for d, ((a, b), dims) in enumerate(zip(attrs["pads"],
                                                              x.dist_attr.dims_mapping))
            if (a or b) and len(dims) == 1 and _pad_halo_fits(op, x, attrs, d, dims[0])}


def _pad_layout(op: str, x: TensorMeta, attrs: Mapping[str, Any]):
    """x's layout at the fewest moved bytes over every assignment of the mesh dims x uses to
    its axes, a padded axis taking at most one, which x has there and whose halo fits; ties
    go to x's own layout, then to the layout that shards more."""
    mesh = mesh_shape_of(op, [x])
    used = sorted({m for dm in x.dist_attr.dims_mapping for m in dm})
    axes = list(range(x.ndim))
    best = None
    for merged in assignments(used, [[None] + axes] * len(used)):
        if any((a or b) and merged.get(d) and (
                len(merged[d]) > 1 or merged[d][0] not in x.dist_attr.dims_mapping[d]
                or not _pad_halo_fits(op, x, attrs, d, merged[d][0]))
               for d, (a, b) in enumerate(attrs["pads"])):
            continue
        want = layout(axes, merged, mesh)
        key = (reshard_cost(x.shape, 1, x.dist_attr, want), want != x.dist_attr,
               -sum(len(dm) for dm in merged.values()))
        if best is None or key < best[0]:
            best = (key, want)
    return best[1]


@register_rule("pad")
def pad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x), attrs pads ((before, after) per axis), mode. Unpadded axes keep their
    sharding, and so do padded ones x already shards by one mesh dim where each output piece
    reads only its own and its neighbours' input pieces (:func:`spatial_pad_axes`: a halo
    exchange; the output's pieces are the usual split of its size); other padded axes are
    Replicate. A Partial input is resolved."""
    op = op_name(attrs, "pad")
    require(metas, op, 1)
    (x,) = metas
    out = _padded(op, x, attrs["pads"], +1)
    xa = _pad_layout(op, x, attrs)
    return SpmdResult((xa,), (TensorMeta(out, xa),))


@register_rule("pad_grad")
def pad_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (dout), attrs pads: the gradient of the unpadded input, laid out as ``pad``."""
    op = op_name(attrs, "pad_grad")
    require(metas, op, 1)
    (g,) = metas
    out = _padded(op, g, attrs["pads"], -1)
    ga = _pad_layout(op, TensorMeta(out, g.dist_attr), attrs)
    return SpmdResult((ga,), (TensorMeta(out, ga),))


# -- spatial sharding: halo geometry --------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """A window sweep along one axis: size ``n`` in, ``n_out`` out, kernel ``k``, stride ``s``,
    leading padding ``p0``, dilation ``d``."""

    n: int
    n_out: int
    k: int
    s: int
    p0: int
    d: int = 1

    def need(self, parts: int, r: int) -> tuple[int, int] | None:
        """The global input rows (padding included: may leave [0, n)) that output piece ``r``
        of ``parts`` reads; None for an empty output piece."""
        oa, ob = split_range(self.n_out, parts, r)
        if oa == ob:
            return None
        return oa * self.s - self.p0, (ob - 1) * self.s - self.p0 + self.d * (self.k - 1) + 1

    def describe(self) -> str:
        return f"kernel {self.k}, stride {self.s}, dilation {self.d}"


def resample_spans(mode: str, n: int, m: int, align_corners: bool, ratio: float | None
                   ) -> tuple[tuple[int, int], ...]:
    """For each of the ``m`` outputs of a resampling of an axis of ``n``, the input indices
    ``[lo, hi)`` it reads: ``"area"`` (adaptive average) windows ``[floor(i n / m),
    ceil((i + 1) n / m))``; ``"nearest"`` one index; ``"bilinear"`` the two it interpolates
    (the kernels' formulas, in the same double arithmetic)."""
    if mode == "area":
        return tuple(((i * n) // m, -(-((i + 1) * n) // m)) for i in range(m))
    scale = (n - 1) / (m - 1) if align_corners and m > 1 else 0.0 if align_corners else \
        (ratio if ratio is not None else n / m)
    spans = []
    for i in range(m):
        if mode == "nearest":
            src = math.floor(i * scale + 0.5) if align_corners else math.floor(i * scale)
            lo = min(int(src), n - 1)
            spans.append((lo, lo + 1))
            continue
        src = i * scale if align_corners else max((i + 0.5) * scale - 0.5, 0.0)
        lo = min(int(math.floor(src)), n - 1)
        spans.append((lo, min(lo + 1, n - 1) + 1))
    return tuple(spans)


@dataclass(frozen=True)
class Support:
    """A resampling of an axis of ``n`` to ``n_out`` (:func:`resample_spans`), with the
    interface of :class:`Window` that :func:`halo_plan` reads."""

    n: int
    n_out: int
    spans: tuple[tuple[int, int], ...]

    def rows(self, oa: int, ob: int) -> tuple[int, int] | None:
        """The input rows outputs ``[oa, ob)`` read; None when there are none."""
        if oa == ob:
            return None
        return (min(lo for lo, _ in self.spans[oa:ob]), max(hi for _, hi in self.spans[oa:ob]))

    def need(self, parts: int, r: int) -> tuple[int, int] | None:
        return self.rows(*split_range(self.n_out, parts, r))

    def describe(self) -> str:
        return f"resampling to {self.n_out}"


@dataclass(frozen=True)
class HaloPlan:
    """What piece ``r`` does along one axis (local row indices of its own input piece):
    ``fill_before``/``fill_after`` padding rows, ``from_prev``/``from_next`` rows received,
    ``own`` the slice of its piece it keeps, ``to_prev``/``to_next`` the slices it sends;
    ``out_rows``/``out_start``: the size and global start of its output piece."""

    fill_before: int
    from_prev: int
    own: tuple[int, int]
    from_next: int
    fill_after: int
    to_prev: tuple[int, int]
    to_next: tuple[int, int]
    out_rows: int
    out_start: int = 0


def _overlap(need, a: int, b: int) -> tuple[int, int]:
    if need is None:
        return (a, a)
    lo, hi = max(need[0], a), min(need[1], b)
    return (lo, hi) if lo < hi else (a, a)


def halo_plan(win: Window | Support, parts: int, r: int) -> HaloPlan:
    """Piece ``r``'s halo exchange along an axis split into ``parts`` (see :class:`HaloPlan`)."""
    piece = [split_range(win.n, parts, q) for q in range(parts)]
    a, b = piece[r]
    need = win.need(parts, r)
    prev = _overlap(need, *piece[r - 1]) if r > 0 else (0, 0)
    nxt = _overlap(need, *piece[r + 1]) if r + 1 < parts else (0, 0)
    own = _overlap(need, a, b)
    fill_before = max(0, -need[0]) if need else 0
    fill_after = max(0, need[1] - win.n) if need else 0
    to_prev = _overlap(win.need(parts, r - 1), a, b) if r > 0 else (a, a)
    to_next = _overlap(win.need(parts, r + 1), a, b) if r + 1 < parts else (a, a)
    oa, ob = split_range(win.n_out, parts, r)
    return HaloPlan(fill_before, prev[1] - prev[0], (own[0] - a, own[1] - a), nxt[1] - nxt[0],
                    fill_after, (to_prev[0] - a, to_prev[1] - a), (to_next[0] - a, to_next[1] - a),
                    ob - oa, oa)


def check_halo(op: str, axis: int, win: Window | Support, parts: int, mesh_dim: int) -> None:
    """Every output piece's input rows lie in its own and its two neighbours' pieces, else a
    ValueError naming the piece (raised alike on every rank: pure metadata)."""
    piece = [split_range(win.n, parts, q) for q in range(parts)]
    for r in range(parts):
        need = win.need(parts, r)
        if need is None:
            continue
        lo, hi = max(need[0], 0), min(need[1], win.n)
        first = piece[max(r - 1, 0)][0]
        last = piece[min(r + 1, parts - 1)][1]
        if lo < first or hi > last:
            raise ValueError(
                f"{op}: axis {axis} (size {win.n}) sharded over mesh dim {mesh_dim} in {parts} "
                f"pieces: the rank at coordinate {r} of that mesh dim needs input indices "
                f"[{lo}, {hi}) but it and its neighbours hold only [{first}, {last}) "
                f"({win.describe()}); use fewer ranks on mesh dim {mesh_dim}")


def sweep(attrs: Mapping[str, Any], hw: Sequence[int], out_hw: Sequence[int],
          kernel: Sequence[int] | None, i: int) -> Window | Support:
    """The sweep along spatial axis ``i`` (of size ``hw[i]`` in, ``out_hw[i]`` out): a
    resampling's :class:`Support` (attrs ``mode``), else the :class:`Window` of ``kernel``."""
    if attrs.get("mode") is not None:
        ratio = (attrs.get("ratio") or (None, None))[i]
        return Support(hw[i], out_hw[i], resample_spans(attrs["mode"], hw[i], out_hw[i],
                                                        bool(attrs["align_corners"]), ratio))
    dil = attrs.get("dilation", (1, 1))
    return Window(hw[i], out_hw[i], kernel[i], attrs["stride"][i], attrs["padding"][2 * i],
                  dil[i])


def merge_spatial(metas: Sequence[TensorMeta], notations_of: Callable[[Any, Any], list],
                  check: Callable[[dict], None], allowed: bool = True, strict: bool = True
                  ) -> tuple[dict, list]:
    """(label -> mesh dims, notations) at the fewest moved bytes over every assignment of the
    mesh dims to the labels, H and W (labels ``"h"``, ``"w"``; only when ``allowed``) taking
    at most one mesh dim each; ties go to the inputs' own layouts, then to the map that shards
    more. ``notations_of(h, w)``
    gives every input's notation; ``check(merged)`` raises where a halo does not fit: an
    error when x itself is so sharded and ``strict`` (else that map is skipped, so the axis is
    gathered)."""
    x = metas[0]
    mesh = x.dist_attr.mesh_shape
    own = {lab: dm for lab, dm in zip("hw", x.dist_attr.dims_mapping[2:]) if len(dm) == 1}
    if allowed and strict and own:
        check(own)  # the user's spatial layout: an error, on every rank, when it cannot work
    spatial = ["h", "w"] if allowed else []
    labels = list(dict.fromkeys(lab for n in notations_of(*(spatial or [None, None]))
                                for lab in n if lab is not None))
    best = None
    for merged in assignments(list(range(len(mesh))), [[None] + labels] * len(mesh)):
        if any(len(merged.get(lab, ())) > 1 for lab in spatial):
            continue
        notations = notations_of(*(lab if lab in merged else None for lab in "hw"))
        try:
            check(merged)
        except ValueError:
            continue
        wanted = [layout(n, merged, mesh) for n in notations]
        cost = sum(reshard_cost(m.shape, 1, m.dist_attr, a) for m, a in zip(metas, wanted))
        moves = any(m.dist_attr != a for m, a in zip(metas, wanted))
        key = (cost, moves, -sum(len(dm) for dm in merged.values()))
        if best is None or key < best[0]:
            best = (key, merged, notations)
    return best[1], best[2]


def check_spatial(op: str, x: TensorMeta, attrs: Mapping[str, Any], kernel: Sequence[int],
                  out_hw: Sequence[int], merged: Mapping[Any, tuple[int, ...]]) -> None:
    """:func:`check_halo` for each spatial axis the merged layout shards."""
    wins = [sweep(attrs, x.shape[2:], out_hw, kernel, i) for i in range(2)]
    for i, label in ((0, "h"), (1, "w")):
        dims = merged.get(label, ())
        if dims:
            check_halo(op, 2 + i, wins[i], x.dist_attr.mesh_shape[dims[0]], dims[0])
