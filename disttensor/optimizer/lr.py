"""Learning-rate schedules (Paddle's ``paddle.optimizer.lr``).

A schedule is passed as ``learning_rate=`` to any optimizer; ``optimizer.get_lr()`` reads its
current value, and ``scheduler.step()`` (once per step or epoch, as the user chooses) advances
it. The optimizer reads the value as a host scalar when each update runs, so a captured step
picks up the new value on replay without recapture. ``state_dict()`` / ``set_state_dict()``
carry ``last_epoch`` and ``last_lr`` (plain values, saved with the optimizer's checkpoint).

Example::

    sched = dt.optimizer.lr.LinearWarmup(
        dt.optimizer.lr.CosineAnnealingDecay(1e-3, T_max=100), warmup_steps=10,
        start_lr=0.0, end_lr=1e-3)
    opt = dt.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())
    ...; opt.step(); sched.step()
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "CosineAnnealingDecay",
    "ExponentialDecay",
    "LRScheduler",
    "LambdaDecay",
    "LinearWarmup",
    "MultiStepDecay",
    "OneCycleLR",
    "PolynomialDecay",
    "StepDecay",
]


def _positive(cls: str, arg: str, value: Any, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ValueError(f"{cls}: {arg} must be a positive {'int' if integer else 'number'}, "
                         f"got {value!r}")


class LRScheduler:
    """Base: ``last_epoch`` counts ``step()`` calls (starting at 0 after construction) and
    ``get_lr()`` gives the learning rate at ``last_epoch``; subclasses define ``get_lr``."""

    def __init__(self, learning_rate: float = 0.1, last_epoch: int = -1, verbose: bool = False):
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
            raise TypeError(f"{type(self).__name__}: learning_rate must be a float, got "
                            f"{type(learning_rate).__name__}")
        self.base_lr = float(learning_rate)
        self.last_epoch = last_epoch
        self.last_lr = self.base_lr
        self.verbose = verbose
        self.step()

    def __call__(self) -> float:
        return self.last_lr

    def step(self, epoch: int | None = None) -> None:
        """Advance one step (or jump to ``epoch``) and recompute ``last_lr``."""
        self.last_epoch = self.last_epoch + 1 if epoch is None else int(epoch)
        self.last_lr = float(self.get_lr())

    def get_lr(self) -> float:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "last_lr": self.last_lr}

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted({"last_epoch", "last_lr"} - set(state_dict))
        if missing:
            raise KeyError(f"{type(self).__name__}.set_state_dict: missing keys {missing}")
        self.last_epoch = int(state_dict["last_epoch"])
        self.last_lr = float(state_dict["last_lr"])

    set_dict = set_state_dict


class LinearWarmup(LRScheduler):
    """``start_lr -> end_lr`` linearly over ``warmup_steps``, then ``learning_rate`` (a float or
    another schedule, stepped from 0 once warmup ends)."""

    def __init__(self, learning_rate: float | LRScheduler, warmup_steps: int, start_lr: float,
                 end_lr: float, last_epoch: int = -1, verbose: bool = False):
        _positive("LinearWarmup", "warmup_steps", warmup_steps, integer=True)
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.start_lr, self.end_lr = float(start_lr), float(end_lr)
        base = learning_rate.base_lr if isinstance(learning_rate, LRScheduler) else learning_rate
        super().__init__(float(base), last_epoch, verbose)

    def get_lr(self) -> float:
        if self.last_epoch < self.warmup_steps:
            return self.start_lr + (self.end_lr - self.start_lr) * self.last_epoch / \
                self.warmup_steps
        if isinstance(self.learning_rate, LRScheduler):
            self.learning_rate.step(self.last_epoch - self.warmup_steps)
            return self.learning_rate()
        return float(self.learning_rate)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if isinstance(self.learning_rate, LRScheduler):
            out["LinearWarmup_LR"] = self.learning_rate.state_dict()
        return out

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().set_state_dict(state_dict)
        if isinstance(self.learning_rate, LRScheduler) and "LinearWarmup_LR" in state_dict:
            self.learning_rate.set_state_dict(state_dict["LinearWarmup_LR"])


class CosineAnnealingDecay(LRScheduler):
    """``eta_min + (base - eta_min) * (1 + cos(pi * epoch / T_max)) / 2`` (closed form)."""

    def __init__(self, learning_rate: float, T_max: int, eta_min: float = 0.0,
                 last_epoch: int = -1, verbose: bool = False):
        _positive("CosineAnnealingDecay", "T_max", T_max, integer=True)
        self.T_max, self.eta_min = T_max, float(eta_min)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        cos = math.cos(math.pi * self.last_epoch / self.T_max)
        return self.eta_min + (self.base_lr - self.eta_min) * (1 + cos) / 2


class StepDecay(LRScheduler):
    """``base * gamma ** (epoch // step_size)``."""

    def __init__(self, learning_rate: float, step_size: int, gamma: float = 0.1,
                 last_epoch: int = -1, verbose: bool = False):
        _positive("StepDecay", "step_size", step_size, integer=True)
        self.step_size, self.gamma = step_size, float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.gamma ** (self.last_epoch // self.step_size)


class MultiStepDecay(LRScheduler):
    """``base * gamma ** (number of milestones <= epoch)``; milestones strictly increasing."""

    def __init__(self, learning_rate: float, milestones: Sequence[int], gamma: float = 0.1,
                 last_epoch: int = -1, verbose: bool = False):
        ms = list(milestones)
        if not ms or any(b <= a for a, b in zip(ms, ms[1:])):
            raise ValueError(f"MultiStepDecay: milestones must be a non-empty increasing list, "
                             f"got {ms}")
        self.milestones, self.gamma = ms, float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.gamma ** sum(m <= self.last_epoch for m in self.milestones)


class ExponentialDecay(LRScheduler):
    """``base * gamma ** epoch``."""

    def __init__(self, learning_rate: float, gamma: float, last_epoch: int = -1,
                 verbose: bool = False):
        _positive("ExponentialDecay", "gamma", gamma)
        self.gamma = float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.gamma ** self.last_epoch


class PolynomialDecay(LRScheduler):
    """``(base - end_lr) * (1 - min(epoch, decay_steps) / decay_steps) ** power + end_lr``
    (``cycle=True``: ``decay_steps`` grows to the next multiple of itself past ``epoch``)."""

    def __init__(self, learning_rate: float, decay_steps: int, end_lr: float = 0.0001,
                 power: float = 1.0, cycle: bool = False, last_epoch: int = -1,
                 verbose: bool = False):
        _positive("PolynomialDecay", "decay_steps", decay_steps, integer=True)
        self.decay_steps, self.end_lr = decay_steps, float(end_lr)
        self.power, self.cycle = float(power), bool(cycle)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        t, steps = self.last_epoch, self.decay_steps
        if self.cycle:
            steps = steps * max(1, math.ceil(t / steps))
        else:
            t = min(t, steps)
        return (self.base_lr - self.end_lr) * (1 - t / steps) ** self.power + self.end_lr


class OneCycleLR(LRScheduler):
    """One cycle (Paddle's): from ``max_learning_rate / divide_factor`` up to
    ``max_learning_rate`` at step ``phase_pct * total_steps - 1``, then down to
    ``end_learning_rate`` at step ``total_steps - 1`` (``three_phase``: back to the initial rate
    first); ``anneal_strategy`` "cos" or "linear"."""

    def __init__(self, max_learning_rate: float, total_steps: int, divide_factor: float = 25.0,
                 end_learning_rate: float = 0.0001, phase_pct: float = 0.3,
                 anneal_strategy: str = "cos", three_phase: bool = False,
                 last_epoch: int = -1, verbose: bool = False):
        _positive("OneCycleLR", "total_steps", total_steps, integer=True)
        _positive("OneCycleLR", "max_learning_rate", max_learning_rate)
        if not 0 < phase_pct < 1:
            raise ValueError(f"OneCycleLR: phase_pct must be in (0, 1), got {phase_pct}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', got "
                             f"{anneal_strategy!r}")
        initial = max_learning_rate / divide_factor
        up = float(phase_pct * total_steps) - 1
        if three_phase:
            self._phases = [(up, initial, max_learning_rate),
                            (2 * up, max_learning_rate, initial),
                            (total_steps - 1, initial, end_learning_rate)]
        else:
            self._phases = [(up, initial, max_learning_rate),
                            (total_steps - 1, max_learning_rate, end_learning_rate)]
        self.anneal_strategy, self.total_steps = anneal_strategy, total_steps
        super().__init__(initial, last_epoch, verbose)

    def get_lr(self) -> float:
        t, start = self.last_epoch, 0.0
        for end, lo, hi in self._phases[:-1]:
            if t <= end:
                break
            start = end
        else:
            end, lo, hi = self._phases[-1]
        pct = min(max((t - start) / max(end - start, 1e-12), 0.0), 1.0)
        if self.anneal_strategy == "cos":
            return hi + (lo - hi) / 2 * (math.cos(math.pi * pct) + 1)
        return (hi - lo) * pct + lo


class LambdaDecay(LRScheduler):
    """``base * lr_lambda(epoch)``."""

    def __init__(self, learning_rate: float, lr_lambda: Callable[[int], float],
                 last_epoch: int = -1, verbose: bool = False):
        if not callable(lr_lambda):
            raise TypeError(f"LambdaDecay: lr_lambda must be callable, got "
                            f"{type(lr_lambda).__name__}")
        self.lr_lambda = lr_lambda
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.lr_lambda(self.last_epoch)
