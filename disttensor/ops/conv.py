"""Convolution (Paddle ``F.conv1d`` / ``F.conv2d``): im2col through a strided window view and
one batched GEMM over the groups, written once against ``xp`` (numpy or cupy); 3x3 stride-1
convolutions with many channels run Winograd's F(2x2, 3x3) where numba is installed
(:mod:`.conv_winograd`), their input and weight gradients included.

The op ``conv2d(x [N, C, H, W], weight [O, C/groups, kh, kw])`` takes normalized attrs
(``stride``, ``dilation`` pairs, ``padding`` as (top, bottom, left, right), ``groups``);
bias is added by the public function (an elementwise add). Its gradient op ``conv2d_grad``
returns (dx, dweight). Layouts are given by the ``conv2d`` rules in :mod:`spmd_rules.conv`.
The window helpers (:func:`windows`, :func:`col2im`, :func:`pad_hw`) are shared with pooling.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from spmd_rules.conv import conv_out_size

from ..dispatch import apply
from ..schema import DENSE_CTX, OPS, public, register, same_dtype
from ..tensor import Tensor
from . import conv_winograd
from .common import as_tensor
from .elementwise import add
from .halo import extend, fold, halo_attrs, no_output, out_size
from .shape import reshape, squeeze, transpose, unsqueeze

__all__ = ["conv1d", "conv2d", "windows", "col2im", "pad_hw", "pair", "conv_padding",
           "conv2d_kernel", "input_grad", "weight_grad", "check_conv_inputs"]


# -- shared window helpers -------------------------------------------------------------------

def _as_strided(xp):
    return xp.lib.stride_tricks.as_strided


def pad_hw(xp, x, padding: Sequence[int], value: float):
    """``x [N, C, H, W]`` padded by (top, bottom, left, right) with ``value`` (a contiguous
    array either way)."""
    pt, pb, pl, pr = padding
    if not (pt or pb or pl or pr):
        return xp.ascontiguousarray(x)
    n, c, h, w = x.shape
    out = xp.full((n, c, h + pt + pb, w + pl + pr), value, dtype=x.dtype)
    out[:, :, pt:pt + h, pl:pl + w] = x
    return out


def windows(xp, x, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
            out_hw: Sequence[int]):
    """The read-only view ``[N, C, kh, kw, Ho, Wo]`` of the windows of a contiguous
    ``x [N, C, Hp, Wp]``: element ``[n, c, i, j, p, q]`` is
    ``x[n, c, p * sh + i * dh, q * sw + j * dw]``."""
    n, c = x.shape[:2]
    s0, s1, s2, s3 = x.strides
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = kernel, stride, dilation, out_hw
    return _as_strided(xp)(x, (n, c, kh, kw, ho, wo),
                           (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw), writeable=False)


def col2im(xp, part: Callable[[int, int], Any], shape: Sequence[int], padding: Sequence[int],
           kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
           out_hw: Sequence[int], dtype):
    """The adjoint of :func:`windows` after :func:`pad_hw`: a zero ``[N, C, H, W]`` gradient to
    which ``part(i, j)`` (``[N, C, Ho, Wo]``, the gradient of window offset (i, j)) is added at
    every offset, the padding then cropped."""
    n, c, h, w = shape
    pt, pb, pl, pr = padding
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = kernel, stride, dilation, out_hw
    grad = xp.zeros((n, c, h + pt + pb, w + pl + pr), dtype=dtype)
    for i in range(kh):
        for j in range(kw):
            grad[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh,
                 j * dw:j * dw + sw * (wo - 1) + 1:sw] += part(i, j)
    return grad[:, :, pt:pt + h, pl:pl + w]


# -- attribute normalization -----------------------------------------------------------------

def pair(op: str, name: str, value: Any, n: int = 2) -> tuple[int, ...]:
    """An int or a sequence of ``n`` ints as a tuple of ``n`` positive ints."""
    vals = [value] * n if isinstance(value, (int, np.integer)) else list(value)
    if len(vals) != n or any(isinstance(v, bool) or not isinstance(v, (int, np.integer))
                             or v <= 0 for v in vals):
        raise ValueError(f"{op}: {name} must be a positive int or {n} positive ints, got "
                         f"{value!r}")
    return tuple(int(v) for v in vals)


def conv_padding(op: str, padding: Any, size: Sequence[int], kernel: Sequence[int],
                 stride: Sequence[int], dilation: Sequence[int]) -> tuple[int, ...]:
    """Paddle's padding forms for the spatial axes of sizes ``size`` as (before, after) per
    axis, flattened: an int; one int per axis; (before, after) per axis flattened; a pair per
    axis of the whole input (batch and channel pairs zero); ``"valid"`` (none) or ``"same"``
    (output ceil(size / stride), the odd pad after, as Paddle and TensorFlow)."""
    nd = len(size)
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return (0,) * (2 * nd)
        if mode != "same":
            raise ValueError(f"{op}: padding must be 'same', 'valid' or ints, got {padding!r}")
        out = []
        for n, k, s, d in zip(size, kernel, stride, dilation):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            out += [total // 2, total - total // 2]
        return tuple(out)
    if isinstance(padding, (int, np.integer)):
        vals = [int(padding)] * (2 * nd)
    else:
        items = list(padding)
        if items and all(isinstance(p, (list, tuple)) for p in items):
            if len(items) != nd + 2 or any(tuple(p) != (0, 0) for p in items[:2]):
                raise ValueError(f"{op}: padding pairs {padding!r} must be one per axis of the "
                                 f"input with zero batch and channel pairs")
            items = [v for p in items[2:] for v in p]
        if len(items) == nd:
            items = [v for p in items for v in (p, p)]
        if len(items) != 2 * nd:
            raise ValueError(f"{op}: padding {padding!r} must give {nd} or {2 * nd} ints")
        vals = items
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in vals):
        raise ValueError(f"{op}: padding {padding!r} must be non-negative ints")
    return tuple(int(v) for v in vals)


# -- kernels -------------------------------------------------------------------------------

def _geometry(x_shape, w_shape, stride, padding, dilation):
    kh, kw = w_shape[2:]
    ho = conv_out_size(x_shape[2], kh, stride[0], padding[0], padding[1], dilation[0])
    wo = conv_out_size(x_shape[3], kw, stride[1], padding[2], padding[3], dilation[1])
    return (kh, kw), (ho, wo)


#: bytes of im2col columns built at once on the CPU (samples are taken in chunks of about this
#: size, so the columns stay in cache instead of making one batch-sized copy)
CHUNK_BYTES = 4 << 20


def _chunks(xp, x, w_shape, stride, padding, dilation, groups):
    """Yield ``(start, stop, cols)``: im2col ``[stop - start, groups, C/groups * kh * kw,
    Ho * Wo]`` of consecutive samples (all at once for cupy). Every chunk is copied into one
    buffer, valid until the next chunk: a fresh array per chunk would pay its page faults
    again each time (a sample's columns are megabytes)."""
    kernel, out_hw = _geometry(x.shape, w_shape, stride, padding, dilation)
    win = windows(xp, pad_hw(xp, x, padding, 0), kernel, stride, dilation, out_hw)
    n = x.shape[0]
    k, lsize = w_shape[1] * kernel[0] * kernel[1], out_hw[0] * out_hw[1]
    per_sample = max(groups * k * lsize * x.dtype.itemsize, 1)
    step = min(max(1, CHUNK_BYTES // per_sample) if xp is np else n, max(n, 1))
    buf = xp.empty((step, groups, k, lsize), dtype=x.dtype)
    for start in range(0, n, step):
        cols = buf[:min(n, start + step) - start]
        xp.copyto(cols.reshape(win[start:start + len(cols)].shape), win[start:start + len(cols)])
        yield start, start + len(cols), cols


def _empty_out(x_shape, weight, stride, padding, dilation, halo) -> tuple[int, ...]:
    """The output shape of a rank with no output rows along a sharded spatial axis."""
    dense = _geometry(x_shape, weight.shape, stride, padding, dilation)[1]
    return (x_shape[0], weight.shape[0],
            *(out_size(halo, 2 + i, max(dense[i], 0)) for i in range(2)))


def _per_output(weight) -> int:
    """Weights per output channel (``C/groups * kh * kw``; also for an empty local piece)."""
    return weight.shape[1] * weight.shape[2] * weight.shape[3]


def conv2d_kernel(xp, x, weight, stride, padding, dilation, groups, halo=(), ctx=DENSE_CTX):
    if halo:  # H / W spatially sharded: the rows the output reads, from the neighbours
        x = extend(xp, x, halo, ctx, 0.0)[0]
        if no_output(halo):
            return xp.zeros(_empty_out(x.shape, weight, stride, padding, dilation, halo),
                            dtype=x.dtype)
    if conv_winograd.fits(xp, x, weight, weight.shape, stride, dilation, groups):
        return conv_winograd.conv3x3(x, weight, padding)
    o = weight.shape[0]
    _, (ho, wo) = _geometry(x.shape, weight.shape, stride, padding, dilation)
    out = xp.empty((x.shape[0], groups, o // groups, ho * wo), dtype=x.dtype)
    wmat = weight.reshape(groups, o // groups, _per_output(weight))
    for start, stop, cols in _chunks(xp, x, weight.shape, stride, padding, dilation, groups):
        xp.matmul(wmat, cols, out=out[start:stop])
    return out.reshape(x.shape[0], o, ho, wo)


def _conv2d_grad_kernel(xp, x, weight, dout, stride, padding, dilation, groups, halo=(),
                        ctx=DENSE_CTX):
    if halo:
        x_ext, shapes = extend(xp, x, halo, ctx, 0.0)
        if no_output(halo):
            dx, dw = xp.zeros(x_ext.shape, dout.dtype), xp.zeros(weight.shape, dout.dtype)
        else:
            dx, dw = _conv2d_grad_kernel(xp, x_ext, weight, dout, stride, padding, dilation,
                                         groups)
        return fold(xp, dx, halo, ctx, shapes), dw
    return (input_grad(xp, x.shape, weight, dout, stride, padding, dilation, groups),
            weight_grad(xp, x, weight.shape, dout, stride, padding, dilation, groups))


def weight_grad(xp, x, w_shape, dout, stride, padding, dilation, groups):
    """dweight of ``conv2d(x, weight)`` for the output gradient ``dout``:
    ``dweight[gr, o, k] = sum_n dout[n, gr, o, :] . cols[n, gr, k, :]``, one GEMM per sample
    over im2col chunks."""
    if conv_winograd.fits(xp, x, dout, w_shape, stride, dilation, groups):
        return conv_winograd.weight_grad3x3(x, dout, padding)
    n, o = dout.shape[:2]
    g = dout.reshape(n, groups, o // groups, dout.shape[2] * dout.shape[3])
    dw = xp.zeros((groups, o // groups, w_shape[1] * w_shape[2] * w_shape[3]), dtype=dout.dtype)
    for start, stop, cols in _chunks(xp, x, w_shape, stride, padding, dilation, groups):
        dw += xp.matmul(g[start:stop], cols.transpose(0, 1, 3, 2)).sum(axis=0)
    return dw.reshape(w_shape)


def input_grad(xp, x_shape, weight, dout, stride, padding, dilation, groups):
    """dx of ``conv2d(x, weight)`` (x of ``x_shape``) for the output gradient ``dout`` — also
    the transposed convolution of dout. At stride 1 (padding within the kernel's extent) a
    convolution of dout, padded by ``dilation * (k - 1) - padding`` (plus the rows of x no
    window reads, after), with the flipped weight, in- and output channels swapped per group:
    an im2col instead of kh * kw strided adds. Else a GEMM then :func:`col2im`."""
    o, cg, kh, kw = weight.shape
    og, (dh, dw_), (pt, _, pl, _) = o // groups, dilation, padding
    (h, w), (ho, wo) = x_shape[2:], dout.shape[2:]
    flip = (dh * (kh - 1) - pt, h + pt - ho, dw_ * (kw - 1) - pl, w + pl - wo)
    if tuple(stride) == (1, 1) and min(flip) >= 0:
        wt = weight.reshape(groups, og, cg, kh, kw).transpose(0, 2, 1, 3, 4)
        wt = xp.ascontiguousarray(wt.reshape(groups * cg, og, kh, kw)[:, :, ::-1, ::-1])
        return conv2d_kernel(xp, dout, wt, (1, 1), flip, dilation, groups)
    n, out_hw = dout.shape[0], dout.shape[2:]
    g = dout.reshape(n, groups, og, out_hw[0] * out_hw[1])
    wmat = weight.reshape(groups, og, cg * kh * kw)
    dcols = xp.matmul(wmat.transpose(0, 2, 1), g).reshape(n, groups * cg, kh, kw, *out_hw)
    dx = col2im(xp, lambda i, j: dcols[:, :, i, j], x_shape, padding, (kh, kw), stride,
                dilation, out_hw, dcols.dtype)
    return xp.ascontiguousarray(dx)


def _conv2d_bwd(node, g):
    x, w = node.saved_tensor(0), node.saved_tensor(1)
    return tuple(apply(OPS["conv2d_grad"], (x, w, g), node.attrs))


_conv_halo = halo_attrs(lambda attrs, metas: metas[1].shape[2:])
register("conv2d_grad", _conv2d_grad_kernel, rule="conv2d_grad", n_out=2, needs_ctx=True,
         local_attrs=_conv_halo,
         dtype=lambda dtypes, attrs: (np.result_type(dtypes[0], dtypes[2]),
                                      np.result_type(dtypes[1], dtypes[2])))
register("conv2d", conv2d_kernel, backward=_conv2d_bwd, rule="conv2d", save_inputs=(0, 1),
         dtype=same_dtype(0), needs_ctx=True, local_attrs=_conv_halo)


# -- public functions ------------------------------------------------------------------------

def _check_float(op: str, x: Tensor, weight: Tensor) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if np.dtype(t.dtype).kind != "f":
            raise TypeError(f"{op}: {name} must be floating, got {np.dtype(t.dtype).name}")
    if np.dtype(x.dtype) != np.dtype(weight.dtype):
        raise TypeError(f"{op}: x ({np.dtype(x.dtype).name}) and weight "
                        f"({np.dtype(weight.dtype).name}) must have one dtype")


def check_conv_inputs(op: str, x: Tensor, weight: Tensor, groups: Any, channels_last: bool,
                      nd: int) -> Tensor:
    """Check what every convolution needs of x, weight and groups (ranks, one floating dtype,
    a positive int groups dividing the channels) and return x channels-first."""
    if x.ndim != nd + 2 or weight.ndim != nd + 2:
        raise ValueError(f"{op}: x {x.shape} and weight {weight.shape} must both be "
                         f"{nd + 2}-D")
    _check_float(op, x, weight)
    if channels_last:
        x = transpose(x, [0, nd + 1, *range(1, nd + 1)])
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    if x.shape[1] % groups:
        raise ValueError(f"{op}: groups={groups} must divide the {x.shape[1]} channels of x "
                         f"{x.shape}")
    return x


def _conv(op: str, x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any, padding: Any,
          dilation: Any, groups: int, channels_last: bool, nd: int) -> Tensor:
    """conv over the last ``nd`` (1 or 2) spatial axes of a channels-first x."""
    x, weight = as_tensor(x), as_tensor(weight)
    x = check_conv_inputs(op, x, weight, groups, channels_last, nd)
    c, o = x.shape[1], weight.shape[0]
    if c % groups or o % groups or weight.shape[1] * groups != c:
        raise ValueError(f"{op}: x {x.shape} has {c} channels and weight {weight.shape} "
                         f"{o} output channels; with groups={groups} both must divide and "
                         f"weight.shape[1] * groups must equal {c}")
    stride, dilation = pair(op, "stride", stride, nd), pair(op, "dilation", dilation, nd)
    pads = conv_padding(op, padding, x.shape[2:], weight.shape[2:], stride, dilation)
    if nd == 1:  # a conv2d over an H of 1
        x, weight = unsqueeze(x, 2), unsqueeze(weight, 2)
        stride, dilation, pads = (1, *stride), (1, *dilation), (0, 0, *pads)
    attrs = {"stride": stride, "padding": pads, "dilation": dilation, "groups": int(groups)}
    kernel, out_hw = _geometry(x.shape, weight.shape, stride, pads, dilation)
    if min(out_hw) <= 0:
        raise ValueError(f"{op}: kernel {list(weight.shape[2 + (nd == 1):])} (dilation "
                         f"{list(dilation[(nd == 1):])}) is larger than the padded input of x "
                         f"{x.shape}: output size {list(out_hw)[(nd == 1):]}")
    out = apply(OPS["conv2d"], (x, weight), attrs)
    if nd == 1:
        out = squeeze(out, [2])
    if bias is not None:
        bias = as_tensor(bias)
        if bias.shape != [o]:
            raise ValueError(f"{op}: bias shape {bias.shape} must be [{o}] (the output "
                             f"channels of weight {weight.shape})")
        out = add(out, reshape(bias, [1, o] + [1] * nd))
    if channels_last:
        out = transpose(out, [0, *range(2, nd + 2), 1])
    return out


@public()
def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
           padding: Any = 0, dilation: Any = 1, groups: int = 1, data_format: str = "NCHW",
           name: str | None = None) -> Tensor:
    """2-D convolution (cross-correlation, as Paddle and PyTorch) of ``x [N, C, H, W]`` with
    ``weight [O, C/groups, kh, kw]`` plus ``bias [O]``. ``padding``: an int, [ph, pw],
    [top, bottom, left, right], or "same"/"valid"; ``groups == C`` is depthwise.

    >>> y = dt.nn.functional.conv2d(dt.ones([1, 2, 5, 5]), dt.ones([4, 2, 3, 3]), padding=1)
    >>> y.shape
    [1, 4, 5, 5]
    """
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"conv2d: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    return _conv("conv2d", x, weight, bias, stride, padding, dilation, groups,
                 data_format == "NHWC", 2)


@public()
def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
           padding: Any = 0, dilation: Any = 1, groups: int = 1, data_format: str = "NCL",
           name: str | None = None) -> Tensor:
    """1-D convolution of ``x [N, C, L]`` with ``weight [O, C/groups, k]`` plus ``bias [O]``
    (runs as a conv2d over a height of 1).

    >>> dt.nn.functional.conv1d(dt.ones([2, 3, 8]), dt.ones([4, 3, 3])).shape
    [2, 4, 6]
    """
    if data_format not in ("NCL", "NLC"):
        raise ValueError(f"conv1d: data_format must be 'NCL' or 'NLC', got {data_format!r}")
    return _conv("conv1d", x, weight, bias, stride, padding, dilation, groups,
                 data_format == "NLC", 1)
