"""Neural-network layers (Paddle's ``paddle.nn``): :class:`Layer`, common, normalization and loss
layers, ``functional`` and ``initializer``."""
from __future__ import annotations

from . import functional, initializer
from .common import (GELU, Dropout, Embedding, Flatten, Identity, LayerList, Linear, ReLU,
                     Sequential, Sigmoid, SiLU, Softmax, Tanh)
from .layer import Layer, Parameter, ParamAttr
from .loss import CrossEntropyLoss, MSELoss
from .norm import BatchNorm1D, BatchNorm2D, BatchNorm3D, LayerNorm
from .conv import (AdaptiveAvgPool2D, AdaptiveMaxPool2D, AvgPool2D, Conv1D, Conv2D, Dropout2D,
                   GroupNorm, InstanceNorm2D, MaxPool2D)
from .containers import LayerDict, ParameterList  # noqa: E402
from .norm import RMSNorm  # noqa: E402
from .attention import MultiHeadAttention  # noqa: E402
from .clip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue  # noqa: E402
from . import utils  # noqa: E402
from .conv import Conv1DTranspose, Conv2DTranspose  # noqa: E402

# PyTorch's names for the same classes (Paddle semantics)
Module = Layer
ModuleList = LayerList
ModuleDict = LayerDict
