"""``Parameter``: the trainable leaf tensor that layers own and optimizers update (Paddle's
``EagerParamBase``, PyTorch's ``torch.nn.Parameter``; ``nn.Parameter`` is this class).

It lives below ``nn`` because the runtime keeps it a parameter where it makes new tensors from
one (``shard_tensor`` of a parameter returns a parameter of the same name)."""
from __future__ import annotations

from typing import Any

from .tensor import Tensor

__all__ = ["Parameter"]


class Parameter(Tensor):
    """A trainable leaf tensor: ``stop_gradient=False`` (unless not trainable),
    ``persistable=True``, a unique ``name`` and ``optimize_attr["learning_rate"]`` (a multiplier
    of the optimizer's learning rate)."""

    __slots__ = ("optimize_attr",)

    def __init__(self, value: Any, name: str, trainable: bool = True, learning_rate: float = 1.0):
        super().__init__(value, stop_gradient=not trainable, name=name)
        self.persistable = True
        self.optimize_attr = {"learning_rate": float(learning_rate)}

    @property
    def trainable(self) -> bool:
        return not self.stop_gradient

    @trainable.setter
    def trainable(self, value: bool) -> None:
        self.stop_gradient = not value

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
