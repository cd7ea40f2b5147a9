"""Paddle's ``paddle.incubate.nn``."""
from __future__ import annotations

from . import functional  # noqa: F401
