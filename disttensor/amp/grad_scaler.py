"""Dynamic loss scaling (Paddle's ``paddle.amp.GradScaler``).

The scale and its counters are 0-d tensors updated by ops, so a captured step (``to_static``)
replays the whole of it. ``scale(loss)`` multiplies the loss by the scale; ``unscale_(opt)``
divides the gradients by it and computes the verdict "every gradient is finite" as a tensor:
each rank adds ``sum(g * 0)`` over its pieces (0, or nan when any element is inf/nan) and one
1-element all-reduce over the world agrees on it, so every rank skips the same steps.
``step(opt)`` reads the verdict on the host once and skips the update (eager mode); inside a
capture it runs the update and puts back the old value of everything the update wrote
(parameters, states, masters) where the verdict says skip, with no host read. ``update()``
adapts the scale by ops: times ``decr_ratio`` after ``decr_every_n_nan_or_inf`` bad steps in a
row, times ``incr_ratio`` after ``incr_every_n_steps`` good ones.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, ReduceType

from .. import dispatch
from ..distributed import api
from ..dtype import float32
from ..layout.mesh_groups import get_world_size
from ..ops import assign, cast, copy_, logical_and, to_tensor, where, zeros
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
        self._incr_ratio, self._decr_ratio = float(incr_ratio), float(decr_ratio)
        self._incr_every_n_steps = incr_every_n_steps
        self._decr_every_n_nan_or_inf = decr_every_n_nan_or_inf
        self._dynamic = bool(use_dynamic_loss_scaling)
        # 0-d float32 state tensors (a captured step reads and updates them in place)
        self._scale = to_tensor(np.float32(init_loss_scaling))
        self._incr_count = to_tensor(np.float32(0))
        self._decr_count = to_tensor(np.float32(0))
        self._finite: Tensor | None = None  # bool 0-d: this step's gradients are all finite
        self._unscaled: set[int] = set()  # ids of the optimizers unscaled this step

    # -- queries ----------------------------------------------------------------------------
    def is_enable(self) -> bool:
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        return self._dynamic

    def get_loss_scaling(self) -> float:
        """The current scale (read on the host)."""
        return float(self._scale.numpy())

    @property
    def found_inf(self) -> bool:
        """Whether the gradients unscaled this step held inf/nan on any rank (a host read)."""
        return self._finite is not None and not bool(self._finite.numpy())

    # -- the step ---------------------------------------------------------------------------
    def scale(self, var: Tensor) -> Tensor:
        """``var`` times the current scale, in ``var``'s dtype (``var`` itself when
        disabled)."""
        if not isinstance(var, Tensor):
            raise TypeError(f"GradScaler.scale: argument 'var' must be a Tensor, got "
                            f"{type(var).__name__}")
        if not self._enable:
            return var
        return var * (self._scale if var.dtype == float32 else cast(self._scale, var.dtype))

    @no_grad()
    def unscale_(self, optimizer: Any) -> None:
        """Divide ``optimizer``'s gradients by the scale (float32 master gradients under O2)
        and agree across ranks whether any holds inf/nan. Once per step and optimizer."""
        if not self._enable:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("GradScaler.unscale_: unscale_() was already called on this "
                               "optimizer since the last update()")
        inv = 1.0 / self._scale
        share = zeros([], "float32")   # sum(g * 0) over this rank's pieces: 0 or nan
        for _, holder in optimizer_grads(optimizer):
            g = holder.grad = holder.grad * cast(inv, holder.grad.dtype)
            piece = api._to_local(g) if g.is_dist() else g
            share = share + cast((piece * 0).sum(), "float32")
        finite = _sum_over_world(share) == 0
        self._finite = finite if self._finite is None else logical_and(self._finite, finite)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> None:
        """Unscale (unless done) and run ``optimizer.step()`` unless a gradient held inf/nan
        on any rank (then every rank skips it): eagerly by one host read of the verdict;
        inside a capture by keeping the old values of what the update wrote."""
        if not self._enable:
            optimizer.step()
            return
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if dispatch.host_reads_refused():   # capturing: no host read
            self._masked_step(optimizer)
        elif not self.found_inf:
            optimizer.step()

    def _masked_step(self, optimizer: Any) -> None:
        """``optimizer.step()``, then every tensor it wrote takes back its old value unless
        the gradients were finite (a copy of each, made just before its first write)."""
        old: dict[int, tuple[Tensor, Tensor]] = {}

        def keep(plan, inputs) -> None:
            for i in plan.writes:
                t = inputs[i]
                if id(t) not in old:
                    with no_grad():
                        old[id(t)] = (t, assign(t))
        watcher = dispatch.Observer()
        watcher.before_write = keep
        dispatch.add_observer(watcher)
        try:
            optimizer.step()
        finally:
            dispatch.remove_observer(watcher)
        with no_grad():
            for t, before in old.values():
                copy_(t, where(self._finite, t, before))

    @no_grad()
    def update(self) -> None:
        """Adapt the scale to the step just taken (dynamic scaling) and start a new step."""
        if self._enable and self._dynamic and self._finite is not None:
            ok, zero = self._finite, zeros([], "float32")
            decr = where(ok, zero, self._decr_count + 1)
            incr = where(ok, self._incr_count + 1, zero)
            shrink = decr >= float(self._decr_every_n_nan_or_inf)
            grow = incr >= float(self._incr_every_n_steps)
            copy_(self._scale, where(shrink, self._scale * self._decr_ratio,
                                     where(grow, self._scale * self._incr_ratio, self._scale)))
            copy_(self._decr_count, where(shrink, zero, decr))
            copy_(self._incr_count, where(grow, zero, incr))
        self._finite = None
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
        return {"scale": self.get_loss_scaling(), "incr_ratio": self._incr_ratio,
                "decr_ratio": self._decr_ratio, "incr_every_n_steps": self._incr_every_n_steps,
                "decr_every_n_nan_or_inf": self._decr_every_n_nan_or_inf,
                "incr_count": int(self._incr_count.numpy()),
                "decr_count": int(self._decr_count.numpy()),
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
        counts = int(state_dict["incr_count"]), int(state_dict["decr_count"])
        with no_grad():
            for t, v in ((self._scale, scale), (self._incr_count, counts[0]),
                         (self._decr_count, counts[1])):
                copy_(t, to_tensor(np.float32(v)))
        for k in ("incr_ratio", "decr_ratio"):
            if k in state_dict:
                setattr(self, "_" + k, float(state_dict[k]))
        for k in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
            if k in state_dict:
                setattr(self, "_" + k, int(state_dict[k]))
        if "use_dynamic_loss_scaling" in state_dict:
            self._dynamic = bool(state_dict["use_dynamic_loss_scaling"])

    set_state_dict = load_state_dict


def _sum_over_world(share: Tensor) -> Tensor:
    """The sum of every rank's dense 0-d ``share``: one 1-element all-reduce over the world
    (through the seam, so a capture records it)."""
    flat = ProcessMesh(list(range(get_world_size())), dim_names=["world"])
    summed = api._from_local(share, flat, DistAttr(flat.shape, (), ((0, ReduceType.SUM),)), ())
    return api._to_local(api.reshard_to(summed, flat, DistAttr.replicated(0, flat.shape)))


#: Paddle's older name
AmpScaler = GradScaler
