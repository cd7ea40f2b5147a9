"""PyTorch's spellings of :class:`~disttensor.nn.Layer` methods, mixed into ``Layer``: each
calls the Paddle method of the same meaning (``load_state_dict`` is ``set_state_dict``, strict
by default as in PyTorch)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

__all__ = ["IncompatibleKeys", "TorchLayerNames"]


class IncompatibleKeys(NamedTuple):
    """What ``Layer.set_state_dict`` returns: unpacks as Paddle's ``(missing, unexpected)``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class TorchLayerNames:
    """``load_state_dict``, ``named_modules``, ``modules``, ``add_module`` and ``zero_grad``
    (every ``Layer`` is a ``TorchLayerNames``: the hints name this class, so this module needs
    no import of ``layer``)."""

    def load_state_dict(self, state_dict: Mapping, strict: bool = True) -> IncompatibleKeys:
        """PyTorch's name for ``set_state_dict``, strict by default as in PyTorch: missing or
        unexpected keys raise ValueError naming them, before anything is copied.

        Example::

            missing, unexpected = model.load_state_dict(other.state_dict())
        """
        return self.set_state_dict(state_dict, strict=strict)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "TorchLayerNames"]]:
        """(structured name, layer) for this layer (named ``prefix``) and every sublayer."""
        return self.named_sublayers(prefix, include_self=True)

    def modules(self) -> Iterator["TorchLayerNames"]:
        """This layer and every sublayer."""
        return iter(self.sublayers(include_self=True))

    def add_module(self, name: str, module: "TorchLayerNames | None") -> "TorchLayerNames | None":
        """PyTorch's name for ``add_sublayer``."""
        return self.add_sublayer(name, module)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (zero it when ``set_to_none`` is False); Paddle's
        name is ``clear_gradients``."""
        self.clear_gradients(set_to_zero=not set_to_none)
