"""Common layers: Linear, Embedding, Dropout, activations, Identity, Flatten, Sequential,
LayerList."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from ..ops import flatten
from ..tape import no_grad
from ..tensor import Tensor
from . import functional as F
from .layer import Layer

__all__ = ["Linear", "Embedding", "Dropout", "ReLU", "GELU", "SiLU", "Sigmoid", "Tanh",
           "Softmax", "Identity", "Flatten", "Sequential", "LayerList"]


def _positive_int(layer: str, arg: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{layer}: {arg} must be a positive int, got {v!r}")
    return int(v)


class Linear(Layer):
    """``y = x @ weight + bias``; ``weight`` is ``[in_features, out_features]`` (XavierUniform by
    default), ``bias`` is ``[out_features]`` (zeros; ``bias_attr=False`` for none)."""

    def __init__(self, in_features: int, out_features: int, weight_attr: Any = None,
                 bias_attr: Any = None, name: str | None = None):
        super().__init__()
        self.in_features = _positive_int("Linear", "in_features", in_features)
        self.out_features = _positive_int("Linear", "out_features", out_features)
        self.weight = self.create_parameter([self.in_features, self.out_features], weight_attr)
        self.bias = self.create_parameter([self.out_features], bias_attr, is_bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={np.dtype(self._dtype).name}")


class Embedding(Layer):
    """Lookup table ``weight[num_embeddings, embedding_dim]`` (XavierUniform); the row of
    ``padding_idx`` (negative counts from the end) is zero and gets no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 sparse: bool = False, weight_attr: Any = None, name: str | None = None):
        super().__init__()
        self._num_embeddings = _positive_int("Embedding", "num_embeddings", num_embeddings)
        self._embedding_dim = _positive_int("Embedding", "embedding_dim", embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} is out of range for "
                                 f"num_embeddings {num_embeddings}")
            padding_idx = int(padding_idx) % num_embeddings
        self._padding_idx = padding_idx
        self._sparse = bool(sparse)
        self.weight = self.create_parameter([self._num_embeddings, self._embedding_dim],
                                            weight_attr)
        if padding_idx is not None:
            with no_grad():
                self.weight[padding_idx] = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return F.embedding(x, self.weight, padding_idx=self._padding_idx, sparse=self._sparse)

    def extra_repr(self) -> str:
        s = f"{self._num_embeddings}, {self._embedding_dim}"
        if self._padding_idx is not None:
            s += f", padding_idx={self._padding_idx}"
        return s + (", sparse=True" if self._sparse else "")


class Dropout(Layer):
    """Zeroes elements with probability ``p`` in training mode (``mode`` as in
    ``F.dropout``); identity in eval mode with the default ``"upscale_in_train"``."""

    def __init__(self, p: float = 0.5, axis: Any = None, mode: str = "upscale_in_train",
                 name: str | None = None):
        super().__init__()
        if not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be a number in [0, 1], got {p!r}")
        if mode not in ("upscale_in_train", "downscale_in_infer"):
            raise ValueError(f"Dropout: mode must be 'upscale_in_train' or "
                             f"'downscale_in_infer', got {mode!r}")
        self.p, self.axis, self.mode = float(p), axis, mode

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, p=self.p, axis=self.axis, training=self.training, mode=self.mode)

    def extra_repr(self) -> str:
        return f"p={self.p}, axis={self.axis}, mode={self.mode}"


class ReLU(Layer):
    """``max(x, 0)``."""

    def __init__(self, name: str | None = None):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Layer):
    """GELU, exact (erf) or with the tanh approximation."""

    def __init__(self, approximate: bool = False, name: str | None = None):
        super().__init__()
        self.approximate = bool(approximate)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate}"


class SiLU(Layer):
    """``x * sigmoid(x)``."""

    def __init__(self, name: str | None = None):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Sigmoid(Layer):
    """``1 / (1 + exp(-x))``."""

    def __init__(self, name: str | None = None):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return F.sigmoid(x)


class Tanh(Layer):
    """``tanh(x)``."""

    def __init__(self, name: str | None = None):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return F.tanh(x)


class Softmax(Layer):
    """Softmax along ``axis``."""

    def __init__(self, axis: int = -1, name: str | None = None):
        super().__init__()
        self.axis = axis

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, axis=self.axis)

    def extra_repr(self) -> str:
        return f"axis={self.axis}"


class Identity(Layer):
    """Returns its input."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return x


class Flatten(Layer):
    """Flattens dims ``start_axis..stop_axis`` into one (a view)."""

    def __init__(self, start_axis: int = 1, stop_axis: int = -1):
        super().__init__()
        self.start_axis, self.stop_axis = start_axis, stop_axis

    def forward(self, x: Tensor) -> Tensor:
        return flatten(x, self.start_axis, self.stop_axis)

    def extra_repr(self) -> str:
        return f"start_axis={self.start_axis}, stop_axis={self.stop_axis}"


class Sequential(Layer):
    """Runs its sublayers in order. ``Sequential(l1, l2)`` names them "0", "1";
    ``Sequential(("a", l1), ("b", l2))`` names them "a", "b"."""

    def __init__(self, *layers: Any):
        super().__init__()
        named = len(layers) > 0 and all(isinstance(x, (tuple, list)) for x in layers)
        for i, item in enumerate(layers):
            name, layer = (item[0], item[1]) if named else (str(i), item)
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential: item {i} must be a Layer or a (name, Layer) pair, "
                                f"got {type(item).__name__}")
            self.add_sublayer(name, layer)

    def __getitem__(self, idx: int | slice | str) -> Layer:
        if isinstance(idx, str):
            return self._sub_layers[idx]
        layers = list(self._sub_layers.values())
        if isinstance(idx, slice):
            return Sequential(*layers[idx])
        if not -len(layers) <= idx < len(layers):
            raise IndexError(f"Sequential: index {idx} is out of range for {len(layers)} layers")
        return layers[idx]

    def __len__(self) -> int:
        return len(self._sub_layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._sub_layers.values())

    def forward(self, x: Any) -> Any:
        for layer in self._sub_layers.values():
            x = layer(x)
        return x


class LayerList(Layer):
    """A list of sublayers (registered as "0", "1", ...); it has no forward."""

    def __init__(self, sublayers: Iterable[Layer] | None = None):
        super().__init__()
        for layer in sublayers or ():
            self.append(layer)

    def _abs(self, idx: int) -> int:
        n = len(self._sub_layers)
        if not -n <= idx < n:
            raise IndexError(f"LayerList: index {idx} is out of range for {n} layers")
        return idx % n

    def __getitem__(self, idx: int | slice) -> Any:
        layers = list(self._sub_layers.values())
        if isinstance(idx, slice):
            return LayerList(layers[idx])
        return layers[self._abs(idx)]

    def __setitem__(self, idx: int, layer: Layer) -> None:
        self.add_sublayer(str(self._abs(idx)), layer)

    def __len__(self) -> int:
        return len(self._sub_layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._sub_layers.values())

    def append(self, layer: Layer) -> "LayerList":
        self.add_sublayer(str(len(self._sub_layers)), layer)
        return self

    def extend(self, layers: Iterable[Layer]) -> "LayerList":
        for layer in layers:
            self.append(layer)
        return self

    def insert(self, index: int, layer: Layer) -> None:
        if not isinstance(layer, Layer):
            raise TypeError(f"LayerList.insert: expected a Layer, got {type(layer).__name__}")
        layers = list(self._sub_layers.values())
        layers.insert(index, layer)
        self._sub_layers.clear()
        for i, sub in enumerate(layers):
            self._sub_layers[str(i)] = sub
