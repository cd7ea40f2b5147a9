"""Paddle's ``paddle.incubate.nn.functional``: fused rotary position embedding and SwiGLU."""
from __future__ import annotations

from ...ops.gated import swiglu
from ...ops.position import fused_rotary_position_embedding, rotary_tables

__all__ = ["fused_rotary_position_embedding", "swiglu", "rotary_tables"]
