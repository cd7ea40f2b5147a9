"""Pooling and resampling over ``[N, C, H, W]`` (Paddle ``F.max_pool2d``, ``F.avg_pool2d``,
``F.adaptive_avg_pool2d``, ``F.adaptive_max_pool2d``, ``F.interpolate``; ``F.pad`` is in
:mod:`.padding`).

Window pooling reads the strided window view of :func:`~.conv.windows`; its gradients scatter
back with :func:`~.conv.col2im`. Adaptive average pooling and nearest/bilinear interpolation
are one separable linear map ``out = A_h @ x @ A_w^T`` (op ``resample2d``; its gradient is the
transposed map). Max pooling's gradient goes to the first maximum of each window (PyTorch's
choice). All layouts come from the ``pool2d`` and ``pad`` rules of :mod:`spmd_rules.conv`.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np

from spmd_rules.conv import Support, pool2d_out_hw, pool_out_size, resample_spans

from ..dispatch import apply
from ..schema import DENSE_CTX, OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor
from .conv import col2im, conv_padding, pad_hw, pair, windows
from .halo import extend, extended_shapes, fold, halo_attrs, no_output, out_size
from .shape import transpose

__all__ = ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d",
           "interpolate"]

_SAME = same_dtype(0)


def _lowest(dtype) -> float:
    dtype = np.dtype(dtype)
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def _sweep(x_shape, attrs):
    """(padding incl. the ceil-mode tail, kernel, stride, out_hw) of a window pooling."""
    out_hw = pool2d_out_hw("pool2d", x_shape[2:], attrs)
    (kh, kw), (sh, sw) = attrs["kernel_size"], attrs["stride"]
    pt, pb, pl, pr = attrs["padding"]
    pb = max(pb, (out_hw[0] - 1) * sh + kh - x_shape[2] - pt)
    pr = max(pr, (out_hw[1] - 1) * sw + kw - x_shape[3] - pl)
    return (pt, pb, pl, pr), (kh, kw), (sh, sw), out_hw


# -- max pooling -----------------------------------------------------------------------------

def _window(kernel_size, stride, padding, ceil_mode, exclusive=None) -> dict:
    """A kernel's window attrs as the dict :func:`_sweep` reads."""
    return {"kernel_size": kernel_size, "stride": stride, "padding": padding,
            "ceil_mode": ceil_mode, "exclusive": exclusive}


def _empty_out(x_shape, kernel_size, stride, padding, ceil_mode, halo) -> tuple[int, ...]:
    """The output shape of a rank with no output rows along a sharded spatial axis."""
    dense = [pool_out_size(x_shape[2 + i], kernel_size[i], stride[i], padding[2 * i],
                           padding[2 * i + 1], ceil_mode) for i in range(2)]
    return (*x_shape[:2], *(out_size(halo, 2 + i, max(dense[i], 0)) for i in range(2)))


def _max_windows(xp, x, attrs):
    padding, kernel, stride, out_hw = _sweep(x.shape, attrs)
    win = windows(xp, pad_hw(xp, x, padding, _lowest(x.dtype)), kernel, stride, (1, 1), out_hw)
    return win, padding, kernel, stride, out_hw


def _max_pool2d_kernel(xp, x, kernel_size, stride, padding, ceil_mode, halo=(),
                       ctx=DENSE_CTX):
    if halo:  # H / W spatially sharded: the rows the output reads, from the neighbours
        x = extend(xp, x, halo, ctx, _lowest(x.dtype))[0]
        if no_output(halo):
            return xp.zeros(_empty_out(x.shape, kernel_size, stride, padding, ceil_mode, halo),
                            dtype=x.dtype)
    win = _max_windows(xp, x, _window(kernel_size, stride, padding, ceil_mode))[0]
    return win.max(axis=(2, 3))


def _max_pool2d_grad_kernel(xp, x, dout, kernel_size, stride, padding, ceil_mode, halo=(),
                            ctx=DENSE_CTX):
    if halo:
        x_ext, shapes = extend(xp, x, halo, ctx, _lowest(x.dtype))
        dx = xp.zeros(x_ext.shape, dout.dtype) if no_output(halo) else \
            _max_pool2d_grad_kernel(xp, x_ext, dout, kernel_size, stride, padding, ceil_mode)
        return fold(xp, dx, halo, ctx, shapes)
    win, pads, kernel, strides, out_hw = _max_windows(
        xp, x, _window(kernel_size, stride, padding, ceil_mode))
    n, c, kh, kw = win.shape[:4]
    first = xp.ascontiguousarray(win).reshape(n, c, kh * kw, *out_hw).argmax(axis=2)
    zero = xp.zeros((), dtype=dout.dtype)
    return xp.ascontiguousarray(col2im(
        xp, lambda i, j: xp.where(first == i * kw + j, dout, zero), x.shape, pads, kernel,
        strides, (1, 1), out_hw, dout.dtype))


def _pool_bwd(grad_op: str):
    def backward(node, g):
        return apply(OPS[grad_op], (node.saved_tensor(0), g), node.attrs)
    return backward


_pool_halo = halo_attrs(lambda attrs, metas: attrs["kernel_size"])
register("max_pool2d_grad", _max_pool2d_grad_kernel, rule="pool2d_grad",
         dtype=same_dtype(1), needs_ctx=True, local_attrs=_pool_halo,
         rule_attrs={"spatial": True})
register("max_pool2d", _max_pool2d_kernel, backward=_pool_bwd("max_pool2d_grad"),
         rule="pool2d", save_inputs=(0,), dtype=_SAME, needs_ctx=True, local_attrs=_pool_halo,
         rule_attrs={"spatial": True})


# -- average pooling -------------------------------------------------------------------------

def _counts(n: int, m: int, k: int, s: int, p0: int, p1: int, exclusive: bool) -> np.ndarray:
    start = np.arange(m) * s - p0
    end = np.minimum(start + k, n + p1)
    return np.minimum(end, n) - np.maximum(start, 0) if exclusive else end - start


def _divisor(xp, x_shape, attrs, dtype, halo=(), global_hw=None, global_padding=None):
    """The ``[Ho, Wo]`` element counts each window's sum is divided by (of this rank's output
    rows, from the global geometry, when the axis is spatially sharded)."""
    _, (kh, kw), (sh, sw), out_hw = _sweep(x_shape, attrs)
    pads = global_padding or attrs["padding"]
    sizes = global_hw or x_shape[2:]
    counts = []
    for i, (k, s) in enumerate(((kh, sh), (kw, sw))):
        start = next((p.out_start for a, _, p in halo if a == 2 + i), 0)
        counts.append(_counts(sizes[i], start + out_hw[i], k, s, pads[2 * i], pads[2 * i + 1],
                              attrs["exclusive"])[start:])
    return xp.asarray(np.outer(*counts), dtype=dtype)


def _avg_pool2d_kernel(xp, x, kernel_size, stride, padding, ceil_mode, exclusive, halo=(),
                       global_hw=None, global_padding=None, ctx=DENSE_CTX):
    attrs = _window(kernel_size, stride, padding, ceil_mode, exclusive)
    if halo:  # H / W spatially sharded: the rows the output reads, from the neighbours
        x = extend(xp, x, halo, ctx, 0.0)[0]
        if no_output(halo):
            return xp.zeros(_empty_out(x.shape, kernel_size, stride, padding, ceil_mode, halo),
                            dtype=x.dtype)
    pads, kernel, strides, out_hw = _sweep(x.shape, attrs)
    win = windows(xp, pad_hw(xp, x, pads, 0), kernel, strides, (1, 1), out_hw)
    out = win.sum(axis=(2, 3))
    out /= _divisor(xp, x.shape, attrs, out.dtype, halo, global_hw, global_padding)
    return out


def _avg_pool2d_grad_kernel(xp, x, dout, kernel_size, stride, padding, ceil_mode, exclusive,
                            halo=(), global_hw=None, global_padding=None, ctx=DENSE_CTX):
    attrs = _window(kernel_size, stride, padding, ceil_mode, exclusive)
    shape, shapes = extended_shapes(x.shape, halo)
    if halo and no_output(halo):
        dx = xp.zeros(shape, dtype=dout.dtype)
    else:
        pads, kernel, strides, out_hw = _sweep(shape, attrs)
        share = dout / _divisor(xp, shape, attrs, dout.dtype, halo, global_hw, global_padding)
        dx = col2im(xp, lambda i, j: share, shape, pads, kernel, strides, (1, 1), out_hw,
                    dout.dtype)
    return xp.ascontiguousarray(fold(xp, dx, halo, ctx, shapes) if halo else dx)


_avg_halo = halo_attrs(lambda attrs, metas: attrs["kernel_size"], keep_global=True)
register("avg_pool2d_grad", _avg_pool2d_grad_kernel, rule="pool2d_grad", dtype=same_dtype(1),
         needs_ctx=True, local_attrs=_avg_halo, rule_attrs={"spatial": True})
register("avg_pool2d", _avg_pool2d_kernel, backward=_pool_bwd("avg_pool2d_grad"),
         rule="pool2d", save_inputs=(0,), no_need_buffer=(0,), dtype=_SAME, needs_ctx=True,
         local_attrs=_avg_halo, rule_attrs={"spatial": True})


# -- separable resampling: adaptive average pooling, interpolation ------------------------------

@lru_cache(maxsize=256)
def _matrix(mode: str, n: int, m: int, align_corners: bool, ratio: float | None) -> np.ndarray:
    """The ``[m, n]`` map from an input axis of ``n`` to an output axis of ``m``."""
    a = np.zeros((m, n))
    rows = np.arange(m)
    if mode == "area":  # adaptive average: windows [floor(i n / m), ceil((i + 1) n / m))
        for i in range(m):
            lo, hi = (i * n) // m, -(-((i + 1) * n) // m)
            a[i, lo:hi] = 1.0 / (hi - lo)
        return a
    scale = (n - 1) / (m - 1) if align_corners and m > 1 else 0.0 if align_corners else \
        (ratio if ratio is not None else n / m)
    if mode == "nearest":
        src = np.floor(rows * scale + 0.5) if align_corners else np.floor(rows * scale)
        a[rows, np.minimum(src.astype(np.int64), n - 1)] = 1.0
        return a
    src = rows * scale if align_corners else np.maximum((rows + 0.5) * scale - 0.5, 0.0)
    i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
    i1 = np.minimum(i0 + 1, n - 1)
    lam = src - i0
    np.add.at(a, (rows, i0), 1.0 - lam)
    np.add.at(a, (rows, i1), lam)
    return a


def _maps(xp, hw, out_hw, mode, align_corners, ratio, dtype, halo=(), global_hw=None):
    """The ``[Ho, H]`` and ``[Wo, W]`` maps; along a spatially sharded axis the block of this
    rank's output rows and the input rows they read (its piece extended by the halo)."""
    ratio = ratio or (None, None)
    maps = []
    for i, (n, m, r) in enumerate(zip(global_hw or hw, out_hw, ratio)):
        a = _matrix(mode, n, m, align_corners, r)
        plan = next((p for ax, _, p in halo if ax == 2 + i), None)
        if plan is not None:
            oa, ob = plan.out_start, plan.out_start + plan.out_rows
            rows = Support(n, m, resample_spans(mode, n, m, align_corners, r)).rows(oa, ob)
            a = a[oa:ob, rows[0]:rows[1]] if rows else np.zeros((0, hw[i]))
        maps.append(xp.asarray(a, dtype=dtype))
    return tuple(maps)


def _resample2d_kernel(xp, x, out_hw, mode, align_corners, ratio, halo=(), global_hw=None,
                       ctx=DENSE_CTX):
    if halo:  # H / W spatially sharded: the rows the output reads, from the neighbours
        x = extend(xp, x, halo, ctx, 0.0)[0]
    mh, mw = _maps(xp, x.shape[2:], out_hw, mode, align_corners, ratio, x.dtype, halo,
                   global_hw)
    return xp.matmul(mh, xp.matmul(x, mw.T))


def _resample2d_grad_kernel(xp, x, dout, out_hw, mode, align_corners, ratio, halo=(),
                            global_hw=None, ctx=DENSE_CTX):
    shape, shapes = extended_shapes(x.shape, halo)
    mh, mw = _maps(xp, shape[2:], out_hw, mode, align_corners, ratio, dout.dtype, halo,
                   global_hw)
    dx = xp.matmul(mh.T, xp.matmul(dout, mw))
    return xp.ascontiguousarray(fold(xp, dx, halo, ctx, shapes) if halo else dx)


_resample_halo = halo_attrs(lambda attrs, metas: None, keep_global=True)
register("resample2d_grad", _resample2d_grad_kernel, rule="pool2d_grad", dtype=same_dtype(1),
         needs_ctx=True, local_attrs=_resample_halo, rule_attrs={"spatial": True})
register("resample2d", _resample2d_kernel, backward=_pool_bwd("resample2d_grad"),
         rule="pool2d", save_inputs=(0,), no_need_buffer=(0,), dtype=_SAME, needs_ctx=True,
         local_attrs=_resample_halo, rule_attrs={"spatial": True})


# -- adaptive max pooling --------------------------------------------------------------------

def _bins(n: int, m: int) -> list[tuple[int, int]]:
    return [((i * n) // m, -(-((i + 1) * n) // m)) for i in range(m)]


def _adaptive_max_pool2d_kernel(xp, x, out_hw):
    out = xp.empty((*x.shape[:2], *out_hw), dtype=x.dtype)
    for i, (h0, h1) in enumerate(_bins(x.shape[2], out_hw[0])):
        for j, (w0, w1) in enumerate(_bins(x.shape[3], out_hw[1])):
            out[:, :, i, j] = x[:, :, h0:h1, w0:w1].max(axis=(2, 3))
    return out


def _adaptive_max_pool2d_grad_kernel(xp, x, dout, out_hw):
    dx = xp.zeros(x.shape, dtype=dout.dtype)
    n, c = x.shape[:2]
    ni, ci = xp.meshgrid(xp.arange(n), xp.arange(c), indexing="ij")
    for i, (h0, h1) in enumerate(_bins(x.shape[2], out_hw[0])):
        for j, (w0, w1) in enumerate(_bins(x.shape[3], out_hw[1])):
            win = xp.ascontiguousarray(x[:, :, h0:h1, w0:w1])
            first = win.reshape(n, c, (h1 - h0) * (w1 - w0)).argmax(axis=2)
            dx[ni, ci, h0 + first // (w1 - w0), w0 + first % (w1 - w0)] += dout[:, :, i, j]
    return dx


register("adaptive_max_pool2d_grad", _adaptive_max_pool2d_grad_kernel, rule="pool2d_grad",
         dtype=same_dtype(1))
register("adaptive_max_pool2d", _adaptive_max_pool2d_kernel,
         backward=_pool_bwd("adaptive_max_pool2d_grad"), rule="pool2d", save_inputs=(0,),
         dtype=_SAME)


# -- public functions ------------------------------------------------------------------------

def _nchw(op: str, x: Any, data_format: str) -> tuple[Tensor, bool]:
    x = as_tensor(x)
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"{op}: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be 4-D [N, C, H, W], got shape {x.shape}")
    last = data_format == "NHWC"
    return (transpose(x, [0, 3, 1, 2]) if last else x), last


def _back(out: Tensor, channels_last: bool) -> Tensor:
    return transpose(out, [0, 2, 3, 1]) if channels_last else out


def _window_attrs(op: str, x: Tensor, kernel_size, stride, padding, ceil_mode) -> dict:
    k = pair(op, "kernel_size", kernel_size)
    s = k if stride is None else pair(op, "stride", stride)
    pads = conv_padding(op, padding, x.shape[2:], k, s, (1, 1))
    attrs = {"kernel_size": k, "stride": s, "padding": pads, "ceil_mode": bool(ceil_mode)}
    pool2d_out_hw(op, x.shape[2:], attrs)  # a clear error for an empty output
    return attrs


@public()
def max_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               return_mask: bool = False, ceil_mode: bool = False, data_format: str = "NCHW",
               name: str | None = None) -> Tensor:
    """Maximum over ``kernel_size`` windows every ``stride`` (default: the kernel size) of
    ``x [N, C, H, W]`` padded with -inf; the gradient goes to each window's first maximum.

    >>> dt.nn.functional.max_pool2d(dt.ones([1, 1, 4, 4]), 2).shape
    [1, 1, 2, 2]
    """
    if return_mask:
        raise ValueError("max_pool2d: return_mask=True is not supported")
    x, last = _nchw("max_pool2d", x, data_format)
    attrs = _window_attrs("max_pool2d", x, kernel_size, stride, padding, ceil_mode)
    (kh, kw), (pt, pb, pl, pr) = attrs["kernel_size"], attrs["padding"]
    if max(pt, pb) > kh // 2 or max(pl, pr) > kw // 2:
        raise ValueError(f"max_pool2d: padding {[pt, pb, pl, pr]} must be at most half the "
                         f"kernel size {[kh, kw]}")
    return _back(apply(OPS["max_pool2d"], (x,), attrs), last)


@public()
def avg_pool2d(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, exclusive: bool = True, divisor_override: Any = None,
               data_format: str = "NCHW", name: str | None = None) -> Tensor:
    """Mean over ``kernel_size`` windows every ``stride`` of ``x [N, C, H, W]`` padded with
    zeros; ``exclusive`` (Paddle's default) divides by the window's elements inside x, else by
    the window's size within the padded x (PyTorch's ``count_include_pad``).

    >>> dt.nn.functional.avg_pool2d(dt.ones([1, 1, 4, 4]), 2).shape
    [1, 1, 2, 2]
    """
    if divisor_override is not None:
        raise ValueError("avg_pool2d: divisor_override is not supported")
    x, last = _nchw("avg_pool2d", x, data_format)
    attrs = _window_attrs("avg_pool2d", x, kernel_size, stride, padding, ceil_mode)
    attrs["exclusive"] = bool(exclusive)
    return _back(apply(OPS["avg_pool2d"], (x,), attrs), last)


def _output_size(op: str, x: Tensor, output_size: Any) -> tuple[int, int]:
    sizes = [output_size] * 2 if isinstance(output_size, (int, np.integer)) or \
        output_size is None else list(output_size)
    if len(sizes) != 2:
        raise ValueError(f"{op}: output_size must be an int or 2 ints, got {output_size!r}")
    out = tuple(int(x.shape[2 + i]) if s is None else s for i, s in enumerate(sizes))
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0 for s in out):
        raise ValueError(f"{op}: output_size {output_size!r} must be positive ints")
    return tuple(int(s) for s in out)


@public()
def adaptive_avg_pool2d(x: Tensor, output_size: Any, data_format: str = "NCHW",
                        name: str | None = None) -> Tensor:
    """Mean over the windows ``[floor(i H / Ho), ceil((i + 1) H / Ho))`` (and likewise W), so
    the output is ``[N, C, Ho, Wo]`` whatever H, W are (None keeps that size).

    >>> dt.nn.functional.adaptive_avg_pool2d(dt.ones([2, 3, 7, 5]), 1).shape
    [2, 3, 1, 1]
    """
    x, last = _nchw("adaptive_avg_pool2d", x, data_format)
    attrs = {"out_hw": _output_size("adaptive_avg_pool2d", x, output_size), "mode": "area",
             "align_corners": False, "ratio": None}
    return _back(apply(OPS["resample2d"], (x,), attrs), last)


@public()
def adaptive_max_pool2d(x: Tensor, output_size: Any, return_mask: bool = False,
                        name: str | None = None) -> Tensor:
    """Maximum over the adaptive windows of :func:`adaptive_avg_pool2d`.

    >>> dt.nn.functional.adaptive_max_pool2d(dt.ones([2, 3, 7, 5]), [2, 3]).shape
    [2, 3, 2, 3]
    """
    if return_mask:
        raise ValueError("adaptive_max_pool2d: return_mask=True is not supported")
    x, _ = _nchw("adaptive_max_pool2d", x, "NCHW")
    out_hw = _output_size("adaptive_max_pool2d", x, output_size)
    return apply(OPS["adaptive_max_pool2d"], (x,), {"out_hw": out_hw})


@public()
def interpolate(x: Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool = False, align_mode: int = 0, data_format: str = "NCHW",
                name: str | None = None) -> Tensor:
    """Resize H, W of ``x [N, C, H, W]`` to ``size`` or ``floor(H * scale_factor)``:
    ``"nearest"`` takes ``floor(i * ratio)``, ``"bilinear"`` the half-pixel source
    ``(i + 0.5) * ratio - 0.5`` (``align_corners``: ``i * (H - 1) / (Ho - 1)``); ratio is
    ``H / Ho``, or ``1 / scale_factor`` when that is given (as Paddle and PyTorch).

    >>> dt.nn.functional.interpolate(dt.ones([1, 2, 3, 4]), scale_factor=2).shape
    [1, 2, 6, 8]
    """
    x, last = _nchw("interpolate", x, data_format)
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"interpolate: mode must be 'nearest' or 'bilinear', got {mode!r}")
    if align_mode != 0:
        raise ValueError("interpolate: only align_mode=0 (half-pixel) is supported")
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    ratio = None
    if size is not None:
        out_hw = _output_size("interpolate", x, size)
    else:
        scales = [scale_factor] * 2 if np.isscalar(scale_factor) else list(scale_factor)
        if len(scales) != 2 or any(not float(s) > 0 for s in scales):
            raise ValueError(f"interpolate: scale_factor {scale_factor!r} must be one or 2 "
                             f"positive numbers")
        out_hw = tuple(int(math.floor(n * float(s))) for n, s in zip(x.shape[2:], scales))
        if min(out_hw) <= 0:
            raise ValueError(f"interpolate: scale_factor {scale_factor!r} gives output size "
                             f"{list(out_hw)} for x {x.shape}")
        ratio = tuple(1.0 / float(s) for s in scales)
    attrs = {"out_hw": out_hw, "mode": mode, "align_corners": bool(align_corners),
             "ratio": ratio}
    return _back(apply(OPS["resample2d"], (x,), attrs), last)
