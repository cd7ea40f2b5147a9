"""Convolutional layers (Paddle's ``nn.Conv1D``, ``nn.Conv2D``, their transposes, pooling
layers), the per-group normalizations ``nn.GroupNorm`` / ``nn.InstanceNorm2D`` and ``nn.Dropout2D``.

Defaults follow Paddle: a conv weight ``[out, in/groups, *kernel]`` drawn from
``Normal(0, sqrt(2 / (in_channels * prod(kernel))))`` (a transposed conv's
``[in, out/groups, *kernel]`` Xavier-uniform), a zero bias (``bias_attr=False``: none);
norm weights one and biases zero.
"""
from __future__ import annotations

import math
from typing import Any

from ..ops import reshape
from ..ops.conv import conv1d, conv2d, pair
from ..ops.conv_transpose import conv1d_transpose, conv2d_transpose
from ..ops.pool import adaptive_avg_pool2d, adaptive_max_pool2d, avg_pool2d, max_pool2d
from ..tensor import Tensor
from . import functional as F
from .common import _positive_int
from .initializer import Constant, Normal
from .layer import Layer

__all__ = ["Conv1D", "Conv2D", "Conv1DTranspose", "Conv2DTranspose", "MaxPool2D", "AvgPool2D",
           "AdaptiveAvgPool2D", "AdaptiveMaxPool2D", "GroupNorm", "InstanceNorm2D", "Dropout2D"]


class _ConvNd(Layer):
    _nd = 2
    _fn = staticmethod(conv2d)
    _formats: tuple[str, ...] = ("NCHW", "NHWC")

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1,
                 padding_mode: str = "zeros", weight_attr: Any = None, bias_attr: Any = None,
                 data_format: str | None = None):
        super().__init__()
        if padding_mode != "zeros":
            raise ValueError(f"{type(self).__name__}: only padding_mode='zeros' is supported, "
                             f"got {padding_mode!r}")
        self._setup(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                    data_format)
        std = math.sqrt(2.0 / (self._in * math.prod(self._kernel)))
        self.weight = self.create_parameter(
            [self._out, self._in // self._groups, *self._kernel], weight_attr,
            default_initializer=Normal(0.0, std))
        self.bias = self.create_parameter([self._out], bias_attr, is_bias=True)

    def _setup(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
               data_format) -> None:
        cls = type(self).__name__
        self._in = _positive_int(cls, "in_channels", in_channels)
        self._out = _positive_int(cls, "out_channels", out_channels)
        self._groups = _positive_int(cls, "groups", groups)
        if self._in % self._groups or self._out % self._groups:
            raise ValueError(f"{cls}: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        self._kernel = pair(cls, "kernel_size", kernel_size, self._nd)
        self._stride, self._padding, self._dilation = stride, padding, dilation
        self._data_format = data_format or self._formats[0]

    def forward(self, x: Tensor) -> Tensor:
        return self._fn(x, self.weight, self.bias, self._stride, self._padding, self._dilation,
                        self._groups, self._data_format)

    def extra_repr(self) -> str:
        return (f"{self._in}, {self._out}, kernel_size={list(self._kernel)}, "
                f"stride={self._stride}, padding={self._padding}, groups={self._groups}")


class Conv2D(_ConvNd):
    """2-D convolution layer over ``[N, C, H, W]`` (see ``F.conv2d``).

    >>> conv = dt.nn.Conv2D(3, 8, 3, padding=1)
    >>> conv(dt.ones([2, 3, 16, 16])).shape
    [2, 8, 16, 16]
    """


class Conv1D(_ConvNd):
    """1-D convolution layer over ``[N, C, L]`` (see ``F.conv1d``)."""

    _nd = 1
    _fn = staticmethod(conv1d)
    _formats = ("NCL", "NLC")


class _ConvTransposeNd(_ConvNd):
    _fn = staticmethod(conv2d_transpose)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, output_padding: Any = 0, groups: int = 1, dilation: Any = 1,
                 weight_attr: Any = None, bias_attr: Any = None, data_format: str | None = None):
        Layer.__init__(self)
        self._setup(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                    data_format)
        self._output_padding = output_padding
        self.weight = self.create_parameter(
            [self._in, self._out // self._groups, *self._kernel], weight_attr)
        self.bias = self.create_parameter([self._out], bias_attr, is_bias=True)

    def forward(self, x: Tensor, output_size: Any = None) -> Tensor:
        return self._fn(x, self.weight, self.bias, self._stride, self._padding,
                        0 if output_size is not None else self._output_padding, self._groups,
                        self._dilation, output_size, self._data_format)


class Conv2DTranspose(_ConvTransposeNd):
    """2-D transposed convolution layer over ``[N, C, H, W]`` (see ``F.conv2d_transpose``):
    weight ``[in_channels, out_channels / groups, kh, kw]`` (Xavier-uniform, as Paddle's).

    >>> up = dt.nn.Conv2DTranspose(4, 2, 2, stride=2)
    >>> up(dt.ones([1, 4, 5, 5])).shape
    [1, 2, 10, 10]
    """


class Conv1DTranspose(_ConvTransposeNd):
    """1-D transposed convolution layer over ``[N, C, L]`` (see ``F.conv1d_transpose``)."""

    _nd = 1
    _fn = staticmethod(conv1d_transpose)
    _formats = ("NCL", "NLC")


class MaxPool2D(Layer):
    """``F.max_pool2d`` as a layer."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 return_mask: bool = False, ceil_mode: bool = False,
                 data_format: str = "NCHW", name: str | None = None):
        super().__init__()
        self._args = (kernel_size, stride, padding, return_mask, ceil_mode, data_format)

    def forward(self, x: Tensor) -> Tensor:
        return max_pool2d(x, *self._args)


class AvgPool2D(Layer):
    """``F.avg_pool2d`` as a layer."""

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 ceil_mode: bool = False, exclusive: bool = True, divisor_override: Any = None,
                 data_format: str = "NCHW", name: str | None = None):
        super().__init__()
        self._args = (kernel_size, stride, padding, ceil_mode, exclusive, divisor_override,
                      data_format)

    def forward(self, x: Tensor) -> Tensor:
        return avg_pool2d(x, *self._args)


class AdaptiveAvgPool2D(Layer):
    """``F.adaptive_avg_pool2d`` as a layer (``AdaptiveAvgPool2D(1)``: global average)."""

    def __init__(self, output_size: Any, data_format: str = "NCHW", name: str | None = None):
        super().__init__()
        self._output_size, self._data_format = output_size, data_format

    def forward(self, x: Tensor) -> Tensor:
        return adaptive_avg_pool2d(x, self._output_size, self._data_format)


class AdaptiveMaxPool2D(Layer):
    """``F.adaptive_max_pool2d`` as a layer."""

    def __init__(self, output_size: Any, return_mask: bool = False, name: str | None = None):
        super().__init__()
        self._output_size, self._return_mask = output_size, return_mask

    def forward(self, x: Tensor) -> Tensor:
        return adaptive_max_pool2d(x, self._output_size, self._return_mask)


class GroupNorm(Layer):
    """Normalize each of ``num_groups`` channel groups of ``x [N, C, *]`` over its channels and
    spatial positions (biased variance), then scale and shift per channel.

    >>> gn = dt.nn.GroupNorm(2, 4)
    >>> gn(dt.rand([3, 4, 5, 5])).shape
    [3, 4, 5, 5]
    """

    def __init__(self, num_groups: int, num_channels: int, epsilon: float = 1e-5,
                 weight_attr: Any = None, bias_attr: Any = None, data_format: str = "NCHW",
                 name: str | None = None):
        super().__init__()
        cls = type(self).__name__
        self._groups = _positive_int(cls, "num_groups", num_groups)
        self._channels = _positive_int(cls, "num_channels", num_channels)
        if self._channels % self._groups:
            raise ValueError(f"{cls}: num_groups={num_groups} must divide "
                             f"num_channels={num_channels}")
        if data_format not in ("NCHW", "NCL", "NCDHW", "NC"):
            raise ValueError(f"{cls}: only channels-first data formats are supported, got "
                             f"{data_format!r}")
        self._epsilon = float(epsilon)
        self.weight = self.create_parameter([self._channels], weight_attr,
                                            default_initializer=Constant(1.0))
        self.bias = self.create_parameter([self._channels], bias_attr, is_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        cls = type(self).__name__
        if x.ndim < 2 or x.shape[1] != self._channels:
            raise ValueError(f"{cls}: x {x.shape} must be [N, {self._channels}, ...]")
        n, c, rest = x.shape[0], x.shape[1], list(x.shape[2:])
        g = self._groups
        grouped = reshape(x, [n, g, c // g, *rest])
        out = reshape(F.layer_norm(grouped, [c // g, *rest], epsilon=self._epsilon), x.shape)
        per_channel = [1, c] + [1] * len(rest)
        if self.weight is not None:
            out = out * reshape(self.weight, per_channel)
        if self.bias is not None:
            out = out + reshape(self.bias, per_channel)
        return out


class InstanceNorm2D(GroupNorm):
    """Normalize each channel of each sample of ``x [N, C, H, W]`` over H, W (GroupNorm with
    one group per channel; no running statistics, as Paddle's)."""

    def __init__(self, num_features: int, epsilon: float = 1e-5, momentum: float = 0.9,
                 weight_attr: Any = None, bias_attr: Any = None, data_format: str = "NCHW",
                 name: str | None = None):
        super().__init__(num_features, num_features, epsilon, weight_attr, bias_attr,
                         data_format)


class Dropout2D(Layer):
    """Zero whole channels of ``x [N, C, H, W]`` with probability ``p`` in training (kept
    channels scaled by ``1 / (1 - p)``); identity in eval mode."""

    def __init__(self, p: float = 0.5, data_format: str = "NCHW", name: str | None = None):
        super().__init__()
        if data_format not in ("NCHW", "NHWC"):
            raise ValueError(f"Dropout2D: data_format must be 'NCHW' or 'NHWC', got "
                             f"{data_format!r}")
        self.p, self._axes = p, [0, 1] if data_format == "NCHW" else [0, 3]

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4:
            raise ValueError(f"Dropout2D: x must be 4-D, got shape {x.shape}")
        return F.dropout(x, p=self.p, axis=self._axes, training=self.training)
