"""disttensor: a semi-automatic distributed tensor runtime (see README.md and docs/)."""
from __future__ import annotations

from . import dtype, tensor_methods  # noqa: F401  (binds Tensor methods)
from .autograd import enable_grad, grad, is_grad_enabled, no_grad, set_grad_enabled
from .dtype import bool_, float16, float32, float64, int32, int64
from .ops import *  # noqa: F401,F403
from .ops import OPS
from .tensor import Tensor, is_tensor, to_tensor

__version__ = "0.1.0"
