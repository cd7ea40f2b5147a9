"""Mixed precision (Paddle's ``paddle.amp``): ``auto_cast`` (O1/O2 casting policy at dispatch),
``decorate`` (O2: low-precision models, float32 master weights) and ``GradScaler`` (dynamic
loss scaling agreed across ranks). See docs/guide/mixed_precision.md."""
from __future__ import annotations

from .auto_cast import (
    amp_guard,
    auto_cast,
    is_bfloat16_supported,
    is_float16_supported,
    set_round_after_reduction,
)
from .grad_scaler import AmpScaler, GradScaler
from .master_weights import decorate

__all__ = ["auto_cast", "amp_guard", "decorate", "GradScaler", "AmpScaler",
           "is_float16_supported", "is_bfloat16_supported", "set_round_after_reduction"]
