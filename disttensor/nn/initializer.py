"""Parameter initializers (Paddle's ``paddle.nn.initializer``).

An initializer is called on an existing tensor, ``init(param)``, and overwrites its values
inplace (without recording a graph), so a distributed parameter keeps its mesh and placements.
Random values are drawn for the *global* shape from ``disttensor.ops.creation.default_generator``;
every rank seeded alike draws the same numbers. Fans follow Paddle: for a 2-D ``[in, out]`` weight
``fan_in = in`` and ``fan_out = out``; for ``[out_c, in_c, *k]`` conv kernels
``fan_in = in_c * prod(k)`` and ``fan_out = out_c * prod(k)``.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..dtype import is_floating
from ..generator import default_generator
from ..ops.common import as_tensor
from ..tape import no_grad
from ..tensor import Tensor

__all__ = ["Initializer", "Constant", "Normal", "Uniform", "XavierUniform", "XavierNormal",
           "KaimingUniform", "KaimingNormal", "calculate_gain"]


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for ``nonlinearity`` (Paddle's ``calculate_gain``)."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv1d_transpose", "conv2d_transpose",
              "conv3d_transpose", "sigmoid")
    if nonlinearity in linear:
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3.0
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1.0 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4.0
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def _fans(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[2:], dtype=np.int64))
    return shape[1] * receptive, shape[0] * receptive


class Initializer:
    """Base class: subclasses implement :meth:`sample` for a global shape and dtype."""

    def sample(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, param: Tensor) -> Tensor:
        """Overwrite ``param``'s values inplace with a sample; returns ``param``."""
        if not isinstance(param, Tensor):
            raise TypeError(f"{type(self).__name__}: expected a Tensor, got "
                            f"{type(param).__name__}")
        dtype = np.dtype(param.dtype)
        if not is_floating(dtype) and not isinstance(self, Constant):
            raise TypeError(f"{type(self).__name__}: parameter '{param._label()}' has dtype "
                            f"{dtype.name}; random initializers need a floating dtype")
        values = self.sample(tuple(param.shape), dtype)
        with no_grad():
            param.copy_(as_tensor(values, param))
        return param

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class Constant(Initializer):
    """Every element equals ``value``."""

    def __init__(self, value: float = 0.0):
        self.value = value

    def sample(self, shape, dtype):
        return np.full(shape, self.value, dtype=dtype)


class Normal(Initializer):
    """Samples from N(mean, std**2)."""

    def __init__(self, mean: float = 0.0, std: float = 1.0):
        if std < 0:
            raise ValueError(f"Normal: std must be >= 0, got {std}")
        self.mean, self.std = float(mean), float(std)

    def sample(self, shape, dtype):
        return default_generator.rng.normal(self.mean, self.std, shape).astype(dtype)


class Uniform(Initializer):
    """Samples from U[low, high)."""

    def __init__(self, low: float = -1.0, high: float = 1.0):
        if low > high:
            raise ValueError(f"Uniform: low ({low}) is greater than high ({high})")
        self.low, self.high = float(low), float(high)

    def sample(self, shape, dtype):
        return default_generator.rng.uniform(self.low, self.high, shape).astype(dtype)


class _Xavier(Initializer):
    """Shared fan handling of the Xavier initializers (fans from the shape unless given)."""

    def __init__(self, fan_in: float | None = None, fan_out: float | None = None,
                 gain: float = 1.0):
        self.fan_in, self.fan_out, self.gain = fan_in, fan_out, float(gain)

    def _fan_sum(self, shape) -> float:
        fi, fo = _fans(shape)
        fi = fi if self.fan_in is None else self.fan_in
        fo = fo if self.fan_out is None else self.fan_out
        return max(fi + fo, 1)


class XavierUniform(_Xavier):
    """U[-a, a] with ``a = gain * sqrt(6 / (fan_in + fan_out))`` (Paddle's default for weights)."""

    def sample(self, shape, dtype):
        limit = self.gain * math.sqrt(6.0 / self._fan_sum(shape))
        return default_generator.rng.uniform(-limit, limit, shape).astype(dtype)


class XavierNormal(_Xavier):
    """N(0, std**2) with ``std = gain * sqrt(2 / (fan_in + fan_out))``."""

    def sample(self, shape, dtype):
        std = self.gain * math.sqrt(2.0 / self._fan_sum(shape))
        return default_generator.rng.normal(0.0, std, shape).astype(dtype)


class _Kaiming(Initializer):
    """Shared fan-in and gain of the Kaiming initializers."""

    def __init__(self, fan_in: float | None = None, negative_slope: float = 0.0,
                 nonlinearity: str = "relu"):
        self.fan_in, self.negative_slope, self.nonlinearity = fan_in, negative_slope, nonlinearity

    def _std(self, shape) -> float:
        """``gain / sqrt(fan_in)``."""
        fi = _fans(shape)[0] if self.fan_in is None else self.fan_in
        return calculate_gain(self.nonlinearity, self.negative_slope) / math.sqrt(max(fi, 1))


class KaimingUniform(_Kaiming):
    """U[-a, a] with ``a = gain * sqrt(3 / fan_in)``, gain from ``nonlinearity``."""

    def sample(self, shape, dtype):
        limit = math.sqrt(3.0) * self._std(shape)
        return default_generator.rng.uniform(-limit, limit, shape).astype(dtype)


class KaimingNormal(_Kaiming):
    """N(0, std**2) with ``std = gain / sqrt(fan_in)``, gain from ``nonlinearity``."""

    def sample(self, shape, dtype):
        return default_generator.rng.normal(0.0, self._std(shape), shape).astype(dtype)
