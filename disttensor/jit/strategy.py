"""``dt.Strategy``: Paddle's configuration object of ``to_static(layer, loader, loss, optimizer,
strategy=...)``. Each section is a plain attribute holder with Paddle's field names and
defaults; ``Strategy(config)`` takes a dict of sections (``{"pipeline": {"enable": True}}``)."""
from __future__ import annotations

from typing import Any

__all__ = ["Strategy", "PipelineConfig"]


class _Section:
    """Fields with defaults; setting an unknown field raises (a misspelt option fails)."""

    _defaults: dict[str, Any] = {}

    def __init__(self, values: dict[str, Any] | None = None):
        for k, v in self._defaults.items():
            object.__setattr__(self, k, v)
        for k, v in (values or {}).items():
            setattr(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._defaults:
            raise AttributeError(f"Strategy.{self._name}: no option {name!r} "
                                 f"(options: {sorted(self._defaults)})")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._defaults)
        return f"{self._name}({fields})"


class PipelineConfig(_Section):
    """``strategy.pipeline``: ``enable`` (False), ``schedule_mode`` ("1F1B", "FThenB" or
    "VPP"), ``accumulate_steps`` (micro-batches per step, 1), ``micro_batch_size`` (1; not
    read: a micro-batch is the batch over ``accumulate_steps``), ``vpp_degree`` (1)."""
    _name = "pipeline"
    _defaults = {"enable": False, "schedule_mode": "1F1B", "micro_batch_size": 1,
                 "accumulate_steps": 1, "vpp_degree": 1}


class Strategy:
    """Paddle's ``paddle.distributed.Strategy`` (the sections built so far: ``pipeline``).

    Example::

        strategy = dt.Strategy()
        strategy.pipeline.enable = True
        strategy.pipeline.schedule_mode = "1F1B"
        strategy.pipeline.accumulate_steps = 4
        dist_model = dt.to_static(model, loader, loss_fn, opt, strategy=strategy)
    """

    def __init__(self, config: dict[str, dict[str, Any]] | None = None):
        config = dict(config or {})
        self.pipeline = PipelineConfig(config.pop("pipeline", None))
        if config:
            raise ValueError(f"Strategy: unknown sections {sorted(config)} (built: pipeline)")

    def __repr__(self) -> str:
        return f"Strategy({self.pipeline!r})"
