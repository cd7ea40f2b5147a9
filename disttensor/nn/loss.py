"""Loss layers: CrossEntropyLoss, MSELoss."""
from __future__ import annotations

from ..tensor import Tensor
from . import functional as F
from .layer import Layer

__all__ = ["CrossEntropyLoss", "MSELoss"]

_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(layer: str, reduction: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{layer}: reduction must be one of {list(_REDUCTIONS)}, got "
                         f"{reduction!r}")
    return reduction


class CrossEntropyLoss(Layer):
    """Softmax cross entropy of logits ``input`` against ``label`` (class indices, or
    probabilities with ``soft_label=True``); see ``F.cross_entropy``."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", soft_label: bool = False, axis: int = -1,
                 use_softmax: bool = True, name: str | None = None):
        super().__init__()
        self.weight = weight
        self.ignore_index = int(ignore_index)
        self.reduction = _check_reduction("CrossEntropyLoss", reduction)
        self.soft_label = bool(soft_label)
        self.axis = axis
        self.use_softmax = bool(use_softmax)

    def forward(self, input: Tensor, label: Tensor) -> Tensor:
        return F.cross_entropy(input, label, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, soft_label=self.soft_label,
                               axis=self.axis, use_softmax=self.use_softmax)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction}, "
                f"soft_label={self.soft_label}, axis={self.axis}")


class MSELoss(Layer):
    """``(input - label) ** 2`` reduced by ``reduction`` ("mean", "sum" or "none")."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = _check_reduction("MSELoss", reduction)

    def forward(self, input: Tensor, label: Tensor) -> Tensor:
        return F.mse_loss(input, label, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction}"
