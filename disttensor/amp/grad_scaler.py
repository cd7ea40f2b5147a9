"""Dynamic loss scaling (Paddle's ``paddle.amp.GradScaler``).

``scale(loss)`` multiplies the loss by the current scale; ``unscale_(opt)`` divides the
gradients by it and decides whether any is inf/nan. That decision is agreed by every rank with
one 1-element max all-reduce over the world (every rank that holds a piece of any gradient
takes part), after one read of the local flags, so every rank skips the same steps.
``update()`` then adapts the scale: times ``decr_ratio`` after ``decr_every_n_nan_or_inf``
bad steps in a row, times ``incr_ratio`` after ``incr_every_n_steps`` good ones.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dispatch import xp_of
from ..layout.mesh_groups import world
from ..ops import scale as scale_op
from ..tape import no_grad
from ..tensor import Tensor
from .master_weights import optimizer_grads

__all__ = ["GradScaler", "AmpScaler"]


def _positive(name: str, v: Any, integer: bool = False) -> Any:
    ok = (isinstance(v, int) if integer else isinstance(v, (int, float))) and \
        not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok:
        kind = "a positive integer" if integer else "a finite positive number"
        raise ValueError(f"GradScaler: argument '{name}' must be {kind}, got {v!r}")
    return v


class GradScaler:
    """Loss scaling for float16 training (Paddle's ``GradScaler``; bfloat16 seldom needs it).

    Example::

        scaler = dt.amp.GradScaler(init_loss_scaling=1024)
        with dt.amp.auto_cast():
            loss = model(x).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)          # skipped on every rank when a gradient holds inf/nan
        scaler.update()
        opt.clear_grad()
    """

    def __init__(self, enable: bool = True, init_loss_scaling: float = 65536.0,
                 incr_ratio: float = 2.0, decr_ratio: float = 0.5,
                 incr_every_n_steps: int = 2000, decr_every_n_nan_or_inf: int = 1,
                 use_dynamic_loss_scaling: bool = True):
        _positive("init_loss_scaling", init_loss_scaling)
        if _positive("incr_ratio", incr_ratio) <= 1:
            raise ValueError(f"GradScaler: argument 'incr_ratio' must be > 1, got {incr_ratio!r}")
        if not _positive("decr_ratio", decr_ratio) < 1:
            raise ValueError(f"GradScaler: argument 'decr_ratio' must be < 1, got {decr_ratio!r}")
        _positive("incr_every_n_steps", incr_every_n_steps, integer=True)
        _positive("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf, integer=True)
        self._enable = bool(enable)
        self._scale = float(init_loss_scaling)
        self._incr_ratio, self._decr_ratio = float(incr_ratio), float(decr_ratio)
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._dynamic = bool(use_dynamic_loss_scaling)
        self._incr_count = self._decr_count = 0
        self._found_inf = False
        self._unscaled: set[int] = set()  # ids of the optimizers unscaled this step

    # -- queries ----------------------------------------------------------------------------
    def is_enable(self) -> bool:
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        return self._dynamic

    def get_loss_scaling(self) -> float:
        """The current scale."""
        return self._scale

    @property
    def found_inf(self) -> bool:
        """Whether the last unscaled gradients held inf/nan on any rank."""
        return self._found_inf

    # -- the step ---------------------------------------------------------------------------
    def scale(self, var: Tensor) -> Tensor:
        """``var`` times the current scale (``var`` itself when disabled)."""
        if not isinstance(var, Tensor):
            raise TypeError(f"GradScaler.scale: argument 'var' must be a Tensor, got "
                            f"{type(var).__name__}")
        return scale_op(var, self._scale) if self._enable else var

    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale (float32 master gradients under O2)
        and agree across ranks whether any holds inf/nan. Once per step and optimizer."""
        if not self._enable:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("GradScaler.unscale_: unscale_() was already called on this "
                               "optimizer since the last update()")
        inv = 1.0 / self._scale
        flags, xp = [], None
        with no_grad():
            for _, holder in optimizer_grads(optimizer):
                holder.grad = scale_op(holder.grad, inv)
                a = holder.grad._local_array()
                if a.size:
                    xp = xp_of(a)
                    flags.append(xp.isfinite(a).all())
        # one read of the device: every piece's flag at once
        local = 0.0 if not flags else float(not bool(xp.stack(flags).all()))
        agreed = world().all_reduce(np.array([local], np.float32), "max")
        self._found_inf = self._found_inf or bool(agreed[0] > 0)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> None:
        """Unscale (unless done) and run ``optimizer.step()`` unless a gradient held inf/nan
        on any rank (then every rank skips it)."""
        if not self._enable:
            optimizer.step()
            return
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        """Adapt the scale to the step just taken (dynamic scaling) and start a new step."""
        if self._enable and self._dynamic:
            if self._found_inf:
                self._incr_count = 0
                self._decr_count += 1
                if self._decr_count >= self._decr_every_n_nan_or_inf:
                    self._scale *= self._decr_ratio
                    self._decr_count = 0
            else:
                self._decr_count = 0
                self._incr_count += 1
                if self._incr_count >= self._incr_every_n_steps:
                    self._scale *= self._incr_ratio
                    self._incr_count = 0
        self._found_inf = False
        self._unscaled.clear()

    def minimize(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``step(optimizer)`` then ``update()`` (after ``scaled.backward()``)."""
        self.step(optimizer)
        self.update()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scale and counters (Paddle's keys); empty when disabled."""
        if not self._enable:
            return {}
        return {"scale": self._scale, "incr_ratio": self._incr_ratio,
                "decr_ratio": self._decr_ratio, "incr_every_n_steps": self._incr_every_n_steps,
                "decr_every_n_nan_or_inf": self._decr_every_n_nan_or_inf,
                "incr_count": self._incr_count, "decr_count": self._decr_count,
                "use_dynamic_loss_scaling": self._dynamic}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if not self._enable:
            return
        missing = sorted({"scale", "incr_count", "decr_count"} - set(state_dict))
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {missing}")
        scale = state_dict["scale"]
        scale = float(np.asarray(scale.numpy() if isinstance(scale, Tensor) else scale).reshape(()))
        _positive("scale", scale)
        self._scale = scale
        self._incr_count = int(state_dict["incr_count"])
        self._decr_count = int(state_dict["decr_count"])
        for k in ("incr_ratio", "decr_ratio"):
            if k in state_dict:
                setattr(self, "_" + k, float(state_dict[k]))
        for k in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
            if k in state_dict:
                setattr(self, "_" + k, int(state_dict[k]))
        if "use_dynamic_loss_scaling" in state_dict:
            self._dynamic = bool(state_dict["use_dynamic_loss_scaling"])

    set_state_dict = load_state_dict


#: Paddle's older name
AmpScaler = GradScaler
