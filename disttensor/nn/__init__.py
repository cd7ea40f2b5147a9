"""Neural-network layers (Paddle's ``paddle.nn``): :class:`Layer`, common, normalization and loss
layers, ``functional`` and ``initializer``."""
from __future__ import annotations

from . import functional, initializer
from .common import (GELU, Dropout, Embedding, Flatten, Identity, LayerList, Linear, ReLU,
                     Sequential, Sigmoid, SiLU, Softmax, Tanh)
from .layer import Layer, Parameter, ParamAttr
from .loss import CrossEntropyLoss, MSELoss
from .norm import BatchNorm1D, BatchNorm2D, BatchNorm3D, LayerNorm
from .containers import LayerDict, ParameterList  # noqa: E402
from .norm import RMSNorm  # noqa: E402
from .attention import MultiHeadAttention  # noqa: E402
