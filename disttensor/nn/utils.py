"""PyTorch's ``torch.nn.utils`` names: :func:`clip_grad_norm_`."""
from __future__ import annotations

from .clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
