"""Paddle's ``paddle.incubate``: the fused transformer functions in ``incubate.nn.functional``."""
from __future__ import annotations

from . import nn  # noqa: F401
