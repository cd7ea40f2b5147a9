"""Paddle's ``paddle.distributed.Strategy``: the settings of a ``to_static`` training step, in
groups of attributes (``strategy.gradient_merge.k_steps = 4``) or from a dict of groups."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

__all__ = ["Strategy"]

#: each group's settings and Paddle's defaults
_DEFAULTS = {
    "sharding": {"enable": False, "stage": 1, "degree": 8},
    "fused_passes": {"enable": False, "gemm_epilogue": False, "dropout_add": False},
    "gradient_merge": {"enable": False, "k_steps": 1, "avg": True},
    "pipeline": {"enable": False, "schedule_mode": "1F1B", "micro_batch_size": 1,
                 "accumulate_steps": 1, "vpp_degree": 1},
}


class Strategy:
    """Settings groups ``sharding``, ``fused_passes``, ``gradient_merge`` and ``pipeline``
    with Paddle's names and defaults; ``config`` (a dict of groups) overrides them.

    Example::

        strategy = dt.Strategy()
        strategy.gradient_merge.enable = True
        strategy.gradient_merge.k_steps = 4     # one step = 4 micro-batches
        model = dt.to_static(layer, None, loss_fn, opt, strategy=strategy)
    """

    def __init__(self, config: dict[str, dict[str, Any]] | None = None):
        config = dict(config or {})
        unknown = sorted(set(config) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"Strategy: unknown groups {unknown}; known: {sorted(_DEFAULTS)}")
        for group, defaults in _DEFAULTS.items():
            given = dict(config.get(group) or {})
            bad = sorted(set(given) - set(defaults))
            if bad:
                raise ValueError(f"Strategy: unknown {group} settings {bad}; known: "
                                 f"{sorted(defaults)}")
            setattr(self, group, SimpleNamespace(**{**defaults, **given}))

    def __repr__(self) -> str:
        return "Strategy(" + ", ".join(f"{g}={vars(getattr(self, g))}" for g in _DEFAULTS) + ")"
