"""Binds the registered Tensor methods and operators (:data:`disttensor.schema.METHODS`, filled
by :func:`disttensor.schema.public` next to each function) to :class:`Tensor`."""
from __future__ import annotations

from . import autograd, ops  # noqa: F401  (register their methods)
from .distributed import api  # noqa: F401  (numpy)
from .schema import METHODS
from .tensor import Tensor

for _name, _fn in METHODS.items():
    setattr(Tensor, _name, _fn)
Tensor.T = property(lambda self: ops.transpose(self, list(range(self.ndim))[::-1]),
                    doc="The tensor with its axes reversed (a view).")
