"""Constructor arguments shared by every optimizer: parameter groups and PyTorch spellings.

``parameters`` is an iterable of Tensors or, as in Paddle, of dicts
``{"params": [...], "weight_decay": wd, "learning_rate": scale, ...}``: a group's
``learning_rate`` multiplies the optimizer's learning rate (and so its schedule), its other keys
override the optimizer's hyperparameters for the group's parameters.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..tensor import Tensor
from .lr import LRScheduler


def _is_lr(value: Any) -> bool:
    return isinstance(value, (int, float, LRScheduler)) and not isinstance(value, bool)


def torch_args(cls: str, learning_rate: Any, parameters: Any, lr: Any) -> tuple[Any, Any]:
    """``(learning_rate, parameters)`` from Paddle's or PyTorch's spelling: the parameters may
    come first (``AdamW(model.parameters(), lr=1e-3)``); ``lr=`` is ``learning_rate``."""
    if not _is_lr(learning_rate) and learning_rate is not None:
        if parameters is not None:
            raise TypeError(f"{cls}: parameters given twice (positionally as the first argument "
                            f"and as parameters=)")
        learning_rate, parameters = 0.001, learning_rate
    if lr is not None:
        learning_rate = lr
    return learning_rate, parameters


def param_groups(cls: str, parameters: Iterable[Tensor | dict] | None,
                 group_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Validated groups ``[{"params": [Tensor, ...], key: value, ...}, ...]``; a flat list of
    Tensors is one group. Errors name the group and key; a parameter may be in one group only."""
    if parameters is None:
        raise ValueError(f"{cls}: parameters is required (e.g. model.parameters())")
    if isinstance(parameters, (Tensor, dict)):
        raise TypeError(f"{cls}: parameters must be an iterable of Tensors or of dicts, got a "
                        f"{type(parameters).__name__}")
    items = list(parameters)
    flat = not any(isinstance(x, dict) for x in items)
    if flat:
        items = [{"params": items}] if items else []
    groups, seen = [], {}
    for gi, group in enumerate(items):
        if not isinstance(group, dict):
            raise TypeError(f"{cls}: parameters[{gi}] must be a dict like the other groups, got "
                            f"{type(group).__name__}")
        if "params" not in group:
            raise ValueError(f"{cls}: parameter group {gi} has no 'params' key")
        unknown = sorted(set(group) - {"params", "weight_decay", "learning_rate", *group_keys})
        if unknown:
            raise ValueError(f"{cls}: parameter group {gi} has unknown keys {unknown} (allowed: "
                             f"params, weight_decay, learning_rate"
                             f"{''.join(', ' + k for k in group_keys)})")
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                where = f"parameters[{i}]" if flat else f"group {gi} params[{i}]"
                raise TypeError(f"{cls}: {where} must be a Tensor, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError(f"{cls}: parameter '{p._label()}' is in group {seen[id(p)]} "
                                 f"and group {gi}; a parameter may be in one group only")
            seen[id(p)] = gi
        scale = group.get("learning_rate", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise ValueError(f"{cls}: group {gi} 'learning_rate' (a multiplier of the "
                             f"optimizer's learning rate) must be a number >= 0, got {scale!r}")
        wd = group.get("weight_decay")
        if wd is not None and (isinstance(wd, bool) or not isinstance(wd, (int, float))):
            raise TypeError(f"{cls}: group {gi} 'weight_decay' must be a float or None, got "
                            f"{type(wd).__name__}")
        groups.append({**group, "params": params})
    return groups
