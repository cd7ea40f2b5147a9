"""Neural-network layers (Paddle's ``paddle.nn``): :class:`Layer`, common, normalization and loss
layers, ``functional`` and ``initializer``."""
from __future__ import annotations

from . import functional, initializer
from .common import (GELU, Dropout, Embedding, Flatten, Identity, LayerList, Linear, ReLU,
                     Sequential, Sigmoid, SiLU, Softmax, Tanh)
from .layer import Layer, Parameter, ParamAttr
from .loss import CrossEntropyLoss, MSELoss
from .norm import BatchNorm1D, BatchNorm2D, BatchNorm3D, LayerNorm
from .clip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue
from . import utils
