"""Optimizers (Paddle's ``paddle.optimizer``): SGD, Momentum, Adam, AdamW, with parameter
groups, ``grad_clip`` and learning-rate schedules (:mod:`disttensor.optimizer.lr`)."""
from __future__ import annotations

from . import lr
from .gradient_merge import merged_step, micro_batches
from .lr import LRScheduler
from .optimizers import SGD, Adam, AdamW, Momentum, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "LRScheduler", "Momentum", "Optimizer", "lr"]
__all__ += ["merged_step", "micro_batches"]
