"""Normalization layers: LayerNorm, BatchNorm1D, BatchNorm2D, BatchNorm3D."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..ops import full
from ..tensor import Tensor
from . import functional as F
from .initializer import Constant
from .layer import Layer

__all__ = ["LayerNorm", "BatchNorm1D", "BatchNorm2D", "BatchNorm3D", "RMSNorm"]


class LayerNorm(Layer):
    """Normalizes over the trailing ``normalized_shape`` axes; ``weight`` (ones) and ``bias``
    (zeros) have shape ``normalized_shape`` (``weight_attr`` / ``bias_attr`` False: none)."""

    def __init__(self, normalized_shape: int | Sequence[int], epsilon: float = 1e-5,
                 weight_attr: Any = None, bias_attr: Any = None, name: str | None = None):
        super().__init__()
        ns = [normalized_shape] if isinstance(normalized_shape, (int, np.integer)) \
            else list(normalized_shape)
        if not ns or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0
                         for n in ns):
            raise ValueError(f"LayerNorm: normalized_shape must be a positive int or a non-empty "
                             f"list of positive ints, got {normalized_shape!r}")
        self._normalized_shape = [int(n) for n in ns]
        self._epsilon = float(epsilon)
        self.weight = self.create_parameter(self._normalized_shape, weight_attr,
                                            default_initializer=Constant(1.0))
        self.bias = self.create_parameter(self._normalized_shape, bias_attr, is_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self._normalized_shape, self.weight, self.bias, self._epsilon)

    def extra_repr(self) -> str:
        return f"normalized_shape={self._normalized_shape}, epsilon={self._epsilon}"


class _BatchNormBase(Layer):
    """Batch normalization over every axis but the channel one.

    Parameters ``weight`` (ones) and ``bias`` (zeros); persistable buffers ``_mean`` (zeros) and
    ``_variance`` (ones). In training mode (unless ``use_global_stats``) the batch statistics
    normalize and the op updates the buffers inplace:
    ``running = momentum * running + (1 - momentum) * batch_stat`` (biased batch variance).
    In eval mode (or with ``use_global_stats=True``) the buffers normalize.
    """

    _formats: tuple[str, ...] = ()
    _ndims: tuple[int, ...] = ()

    def __init__(self, num_features: int, momentum: float = 0.9, epsilon: float = 1e-5,
                 weight_attr: Any = None, bias_attr: Any = None, data_format: str | None = None,
                 use_global_stats: bool | None = None, name: str | None = None):
        super().__init__()
        cls = type(self).__name__
        if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) \
                or num_features <= 0:
            raise ValueError(f"{cls}: num_features must be a positive int, got {num_features!r}")
        data_format = self._formats[0] if data_format is None else data_format
        if data_format not in self._formats:
            raise ValueError(f"{cls}: data_format must be one of {list(self._formats)}, got "
                             f"{data_format!r}")
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{cls}: momentum must be in [0, 1], got {momentum}")
        self._num_features = int(num_features)
        self._momentum = float(momentum)
        self._epsilon = float(epsilon)
        self._data_format = data_format
        self._use_global_stats = use_global_stats
        c = [self._num_features]
        self.weight = self.create_parameter(c, weight_attr, default_initializer=Constant(1.0))
        self.bias = self.create_parameter(c, bias_attr, is_bias=True)
        self.register_buffer("_mean", full(c, 0.0, dtype=self._dtype))
        self.register_buffer("_variance", full(c, 1.0, dtype=self._dtype))
        self._mean.name = f"{self._full_name}._mean"
        self._variance.name = f"{self._full_name}._variance"

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim not in self._ndims:
            dims = " or ".join(f"{n}-D" for n in self._ndims)
            raise ValueError(f"{type(self).__name__}: expected a {dims} input "
                             f"(data_format {self._data_format}), got shape {x.shape}")
        return F.batch_norm(x, self._mean, self._variance, self.weight, self.bias,
                            training=self.training, momentum=self._momentum,
                            epsilon=self._epsilon, data_format=self._data_format,
                            use_global_stats=self._use_global_stats)

    def extra_repr(self) -> str:
        return (f"num_features={self._num_features}, momentum={self._momentum}, "
                f"epsilon={self._epsilon}, data_format={self._data_format}")


class BatchNorm1D(_BatchNormBase):
    """Batch norm of a ``[N, C]`` or ``[N, C, L]`` input (``data_format`` "NCL"; "NLC" for
    ``[N, L, C]``)."""

    _formats = ("NCL", "NC", "NLC")
    _ndims = (2, 3)


class BatchNorm2D(_BatchNormBase):
    """Batch norm of a ``[N, C, H, W]`` input (``data_format`` "NCHW"; or "NHWC")."""

    _formats = ("NCHW", "NHWC")
    _ndims = (4,)


class BatchNorm3D(_BatchNormBase):
    """Batch norm of a ``[N, C, D, H, W]`` input (``data_format`` "NCDHW"; or "NDHWC")."""

    _formats = ("NCDHW", "NDHWC")
    _ndims = (5,)


class RMSNorm(Layer):
    """``x / sqrt(mean(x^2) + epsilon) * weight`` over the trailing ``normalized_shape`` axes
    (LLaMA's normalization, one fused op); ``weight`` (ones) has shape ``normalized_shape``.

    Example::

        norm = dt.nn.RMSNorm(16)
        y = norm(dt.randn([2, 8, 16]))
    """

    def __init__(self, normalized_shape: int | Sequence[int], epsilon: float = 1e-5,
                 weight_attr: Any = None, name: str | None = None):
        super().__init__()
        ns = [normalized_shape] if isinstance(normalized_shape, (int, np.integer)) \
            else list(normalized_shape)
        if not ns or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0
                         for n in ns):
            raise ValueError(f"RMSNorm: normalized_shape must be a positive int or a non-empty "
                             f"list of positive ints, got {normalized_shape!r}")
        self._normalized_shape = [int(n) for n in ns]
        self._epsilon = float(epsilon)
        self.weight = self.create_parameter(self._normalized_shape, weight_attr,
                                            default_initializer=Constant(1.0))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self._normalized_shape, self.weight, self._epsilon)

    def extra_repr(self) -> str:
        return f"normalized_shape={self._normalized_shape}, epsilon={self._epsilon}"
