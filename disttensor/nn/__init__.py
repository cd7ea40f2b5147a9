"""Neural-network layers (Paddle's ``paddle.nn``): :class:`Layer`, common, normalization and loss
layers, ``functional`` and ``initializer``."""
from __future__ import annotations

# the public layers and submodules (re-exported: no __all__, so every public name is exported)
from . import functional, initializer, utils  # noqa: F401
from .attention import MultiHeadAttention  # noqa: F401
from .clip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue  # noqa: F401
from .common import (  # noqa: F401
    GELU,
    Dropout,
    Embedding,
    Flatten,
    Identity,
    LayerList,
    Linear,
    ReLU,
    Sequential,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)
from .containers import LayerDict, ParameterList  # noqa: F401
from .conv import (  # noqa: F401
    AdaptiveAvgPool2D,
    AdaptiveMaxPool2D,
    AvgPool2D,
    Conv1D,
    Conv1DTranspose,
    Conv2D,
    Conv2DTranspose,
    Dropout2D,
    GroupNorm,
    InstanceNorm2D,
    MaxPool2D,
)
from .layer import Layer, ParamAttr, Parameter  # noqa: F401
from .loss import CrossEntropyLoss, MSELoss  # noqa: F401
from .norm import BatchNorm1D, BatchNorm2D, BatchNorm3D, LayerNorm, RMSNorm  # noqa: F401

# PyTorch's names for the same classes (Paddle semantics)
Module = Layer
ModuleList = LayerList
ModuleDict = LayerDict
