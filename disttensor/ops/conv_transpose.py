"""Transposed convolution (Paddle ``F.conv2d_transpose`` / ``F.conv1d_transpose``): the adjoint
of :func:`~.conv.conv2d` in x, so its kernels are conv2d's own gradient kernels.

The op ``conv2d_transpose(x [N, C, H, W], weight [C, O/groups, kh, kw])`` takes normalized attrs
(``stride``, ``dilation``, ``output_padding`` pairs, ``padding`` as (top, bottom, left, right),
``groups``) and gives ``[N, O, Ho, Wo]`` with ``Ho = (H - 1) * stride - top - bottom +
dilation * (kh - 1) + 1 + output_padding``. Its forward is conv2d's input gradient with x as the
output gradient; its gradient op ``conv2d_transpose_grad`` returns (dx = conv2d(dout, weight),
dweight = conv2d's weight gradient with the roles of x and dout swapped). Layouts come from the
``conv2d_transpose`` rules of :mod:`spmd_rules.conv`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_rules.conv import conv_transpose_out_size

from ..dispatch import apply
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor
from .conv import check_conv_inputs, conv2d_kernel, conv_padding, input_grad, pair, weight_grad
from .elementwise import add
from .shape import reshape, squeeze, transpose, unsqueeze

__all__ = ["conv1d_transpose", "conv2d_transpose"]


def _out_shape(x_shape, w_shape, stride, padding, output_padding, dilation, groups):
    return (x_shape[0], w_shape[1] * groups,
            *(conv_transpose_out_size(x_shape[2 + i], w_shape[2 + i], stride[i],
                                      padding[2 * i], padding[2 * i + 1], dilation[i],
                                      output_padding[i]) for i in range(2)))


def _conv2d_transpose_kernel(xp, x, weight, stride, padding, output_padding, dilation, groups):
    out_shape = _out_shape(x.shape, weight.shape, stride, padding, output_padding, dilation,
                           groups)
    return input_grad(xp, out_shape, weight, x, stride, padding, dilation, groups)


def _conv2d_transpose_grad_kernel(xp, x, weight, dout, stride, padding, output_padding, dilation,
                                  groups):
    dx = conv2d_kernel(xp, xp.ascontiguousarray(dout), weight, stride, padding, dilation, groups)
    return dx, weight_grad(xp, dout, weight.shape, x, stride, padding, dilation, groups)


def _conv2d_transpose_bwd(node, g):
    x, w = node.saved_tensor(0), node.saved_tensor(1)
    return tuple(apply(OPS["conv2d_transpose_grad"], (x, w, g), node.attrs))


register("conv2d_transpose_grad", _conv2d_transpose_grad_kernel, rule="conv2d_transpose_grad",
         n_out=2, dtype=lambda dtypes, attrs: (np.result_type(dtypes[0], dtypes[2]),
                                               np.result_type(dtypes[1], dtypes[2])))
register("conv2d_transpose", _conv2d_transpose_kernel, backward=_conv2d_transpose_bwd,
         rule="conv2d_transpose", save_inputs=(0, 1), dtype=same_dtype(0))


# -- public functions ------------------------------------------------------------------------

def _output_padding(op: str, output_padding: Any, output_size: Any, x: Tensor, weight: Tensor,
                    stride, pads, dilation, nd: int) -> tuple[int, ...]:
    """The output padding per spatial axis: given, or what makes the output ``output_size``
    (which must lie in ``[base, base + stride)``, base the size without output padding)."""
    base = [conv_transpose_out_size(x.shape[2 + i], weight.shape[2 + i], stride[i], pads[2 * i],
                                    pads[2 * i + 1], dilation[i], 0) for i in range(nd)]
    if output_size is None:
        extra = [output_padding] * nd if isinstance(output_padding, (int, np.integer)) else \
            list(output_padding)
        if len(extra) != nd or any(isinstance(e, bool) or not isinstance(e, (int, np.integer))
                                   for e in extra):
            raise ValueError(f"{op}: output_padding must be an int or {nd} ints, got "
                             f"{output_padding!r}")
    else:
        if output_padding not in (0, None) and any(np.atleast_1d(output_padding)):
            raise ValueError(f"{op}: give output_size or output_padding, not both")
        size = [output_size] * nd if isinstance(output_size, (int, np.integer)) else \
            [int(v) for v in output_size]
        if len(size) != nd:
            raise ValueError(f"{op}: output_size must be an int or {nd} ints, got "
                             f"{output_size!r}")
        extra = [s - b for s, b in zip(size, base)]
    for i, e in enumerate(extra):
        if not 0 <= e < stride[i]:
            raise ValueError(f"{op}: output size {base[i] + e} of spatial axis {i} must lie in "
                             f"[{base[i]}, {base[i] + stride[i]}) for x {x.shape}, weight "
                             f"{weight.shape}, stride {list(stride)} (output_padding "
                             f"{list(extra)} must be below the stride)")
    if min(b + e for b, e in zip(base, extra)) <= 0:
        raise ValueError(f"{op}: output size {[b + e for b, e in zip(base, extra)]} of x "
                         f"{x.shape}, weight {weight.shape}, stride {list(stride)}, padding "
                         f"{list(pads)} is not positive")
    return tuple(int(e) for e in extra)


def _conv_transpose(op: str, x: Tensor, weight: Tensor, bias: Tensor | None, stride: Any,
                    padding: Any, output_padding: Any, groups: int, dilation: Any,
                    output_size: Any, channels_last: bool, nd: int) -> Tensor:
    """conv_transpose over the last ``nd`` (1 or 2) spatial axes of a channels-first x."""
    x, weight = as_tensor(x), as_tensor(weight)
    x = check_conv_inputs(op, x, weight, groups, channels_last, nd)
    c, o = x.shape[1], weight.shape[1] * groups
    if weight.shape[0] != c:
        raise ValueError(f"{op}: x {x.shape} has {c} channels but weight {weight.shape} "
                         f"[in_channels, out_channels / groups, *kernel] expects "
                         f"{weight.shape[0]}")
    stride, dilation = pair(op, "stride", stride, nd), pair(op, "dilation", dilation, nd)
    pads = conv_padding(op, padding, x.shape[2:], weight.shape[2:], stride, dilation)
    extra = _output_padding(op, output_padding, output_size, x, weight, stride, pads, dilation,
                            nd)
    if nd == 1:  # a 2-D transposed conv over an H of 1
        x, weight = unsqueeze(x, 2), unsqueeze(weight, 2)
        stride, dilation, pads, extra = (1, *stride), (1, *dilation), (0, 0, *pads), (0, *extra)
    attrs = {"stride": stride, "padding": pads, "output_padding": extra, "dilation": dilation,
             "groups": int(groups)}
    out = apply(OPS["conv2d_transpose"], (x, weight), attrs)
    if nd == 1:
        out = squeeze(out, [2])
    if bias is not None:
        bias = as_tensor(bias)
        if bias.shape != [o]:
            raise ValueError(f"{op}: bias shape {bias.shape} must be [{o}] (the output "
                             f"channels of weight {weight.shape} with groups={groups})")
        out = add(out, reshape(bias, [1, o] + [1] * nd))
    if channels_last:
        out = transpose(out, [0, *range(2, nd + 2), 1])
    return out


@public()
def conv2d_transpose(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
                     padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                     dilation: Any = 1, output_size: Any = None, data_format: str = "NCHW",
                     name: str | None = None) -> Tensor:
    """2-D transposed convolution (the gradient of ``conv2d`` in its input) of
    ``x [N, C, H, W]`` with ``weight [C, O/groups, kh, kw]`` plus ``bias [O]``: output
    ``Ho = (H - 1) * stride - pad_top - pad_bottom + dilation * (kh - 1) + 1 + output_padding``.
    ``padding`` takes conv2d's forms; ``output_size`` picks the output padding instead.

    >>> w = dt.ones([2, 4, 3, 3])
    >>> dt.nn.functional.conv2d_transpose(dt.ones([1, 2, 5, 5]), w, stride=2, padding=1).shape
    [1, 4, 9, 9]
    """
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"conv2d_transpose: data_format must be 'NCHW' or 'NHWC', got "
                         f"{data_format!r}")
    return _conv_transpose("conv2d_transpose", x, weight, bias, stride, padding, output_padding,
                           groups, dilation, output_size, data_format == "NHWC", 2)


@public()
def conv1d_transpose(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: Any = 1,
                     padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                     dilation: Any = 1, output_size: Any = None, data_format: str = "NCL",
                     name: str | None = None) -> Tensor:
    """1-D transposed convolution of ``x [N, C, L]`` with ``weight [C, O/groups, k]`` plus
    ``bias [O]`` (runs as a 2-D one over a height of 1).

    >>> dt.nn.functional.conv1d_transpose(dt.ones([2, 3, 8]), dt.ones([3, 4, 3])).shape
    [2, 4, 10]
    """
    if data_format not in ("NCL", "NLC"):
        raise ValueError(f"conv1d_transpose: data_format must be 'NCL' or 'NLC', got "
                         f"{data_format!r}")
    return _conv_transpose("conv1d_transpose", x, weight, bias, stride, padding, output_padding,
                           groups, dilation, output_size, data_format == "NLC", 1)
