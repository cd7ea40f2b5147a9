"""Optimizers (Paddle's ``paddle.optimizer``): SGD, Momentum, Adam, AdamW, with parameter
groups, ``grad_clip`` and learning-rate schedules (:mod:`disttensor.optimizer.lr`)."""
from __future__ import annotations

from . import lr
from .lr import LRScheduler
from .optimizers import SGD, Adam, AdamW, Momentum, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "LRScheduler", "Momentum", "Optimizer", "lr"]
