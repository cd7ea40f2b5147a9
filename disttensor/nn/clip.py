"""Gradient clipping (Paddle's ``paddle.nn.ClipGradBy*``, PyTorch's ``clip_grad_norm_``).

An optimizer's ``grad_clip=`` maps the ``(param, grad)`` pairs of a step before the updates.
The global norm of distributed gradients is computed with ordinary ops on the gradients'
own layouts, so each element counts once: a sharded gradient's squared sum is a Partial scalar
(summed across its shards), a replicated one is counted once, a Partial gradient is reduced
before it is squared. The squared sums of one mesh are added while still Partial, so the
total costs one all-reduce per mesh dim, whatever the number of gradients. Low-precision
gradients are squared and summed in float32 (a GradScaler's ``unscale_`` then a clip works as in
PyTorch). With ZeRO-2/3 the gradients are sharded, so the norm comes from the shards.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ..ops import cast, full_like, maximum, sqrt, to_tensor
from ..ops import clip as _clip
from ..tape import no_grad
from ..tensor import Tensor

__all__ = ["ClipGradByGlobalNorm", "ClipGradByNorm", "ClipGradByValue", "clip_grad_norm_",
           "global_norm"]

Pairs = list[tuple[Tensor, Tensor]]


def _check_positive(cls: str, arg: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{cls}: {arg} must be a positive finite number, got {value!r}")
    return float(value)


def _fp32(g: Tensor) -> Tensor:
    """``g`` in at least float32 (the accumulation dtype of a norm)."""
    return g if np.dtype(g.dtype).itemsize >= 4 else cast(g, "float32")


def _sq_sum(g: Tensor) -> Tensor:
    g = _fp32(g)
    return (g * g).sum()


def global_norm(grads: Iterable[Tensor]) -> Tensor:
    """The 2-norm of all ``grads`` together, as a 0-d tensor (each element counted once; one
    all-reduce per mesh dim for the total). Gradients on several meshes: their squared sums are
    combined on the host, read by every rank."""
    by_mesh: dict = {}
    for g in grads:
        key = id(g.process_mesh) if g.is_dist() else None
        by_mesh.setdefault(key, []).append(_sq_sum(g))
    if not by_mesh:
        raise ValueError("global_norm: no gradients")
    totals = []
    for sums in by_mesh.values():
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        totals.append(total)
    if len(totals) == 1:
        return sqrt(totals[0])
    return sqrt(full_like(totals[0], sum(float(t.numpy()) for t in totals)))


class ClipGradByGlobalNorm:
    """Scale every gradient by ``clip_norm / max(global_norm, clip_norm)`` (Paddle's rule), the
    global norm taken over all gradients of the step.

    Example::

        clip = dt.nn.ClipGradByGlobalNorm(clip_norm=1.0)
        opt = dt.optimizer.AdamW(1e-3, parameters=model.parameters(), grad_clip=clip)
    """

    def __init__(self, clip_norm: float):
        self.clip_norm = _check_positive("ClipGradByGlobalNorm", "clip_norm", clip_norm)

    @no_grad()
    def __call__(self, params_grads: Pairs) -> Pairs:
        if not params_grads:
            return params_grads
        norm = global_norm(g for _, g in params_grads)
        scale = self.clip_norm / maximum(norm, full_like(norm, self.clip_norm))
        return [(p, g * cast(scale, g.dtype)) for p, g in params_grads]


class ClipGradByNorm:
    """Scale each gradient on its own by ``clip_norm / max(norm(g), clip_norm)``.

    Example::

        opt = dt.optimizer.SGD(0.1, parameters=model.parameters(),
                               grad_clip=dt.nn.ClipGradByNorm(clip_norm=1.0))
    """

    def __init__(self, clip_norm: float):
        self.clip_norm = _check_positive("ClipGradByNorm", "clip_norm", clip_norm)

    @no_grad()
    def __call__(self, params_grads: Pairs) -> Pairs:
        out = []
        for p, g in params_grads:
            norm = sqrt(_sq_sum(g))
            scale = self.clip_norm / maximum(norm, full_like(norm, self.clip_norm))
            out.append((p, g * cast(scale, g.dtype)))
        return out


class ClipGradByValue:
    """Clamp every gradient element to ``[min, max]`` (``min`` defaults to ``-max``).

    Example::

        opt = dt.optimizer.SGD(0.1, parameters=model.parameters(),
                               grad_clip=dt.nn.ClipGradByValue(max=0.5))
    """

    def __init__(self, max: float, min: float | None = None):
        lo = -max if min is None else min
        if not lo < max:
            raise ValueError(f"ClipGradByValue: min must be < max, got min={lo}, max={max}")
        self.max, self.min = float(max), float(lo)

    @no_grad()
    def __call__(self, params_grads: Pairs) -> Pairs:
        return [(p, _clip(g, self.min, self.max)) for p, g in params_grads]


@no_grad()
def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """PyTorch's ``clip_grad_norm_``: scale the ``.grad`` of ``parameters`` in place of the
    attribute by ``min(1, max_norm / (total_norm + 1e-6))`` and return the total 2-norm. With
    ``error_if_nonfinite`` a non-finite norm raises (on every rank) instead.

    Example::

        total = dt.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    max_norm = _check_positive("clip_grad_norm_", "max_norm", max_norm)
    if float(norm_type) != 2.0:
        raise ValueError(f"clip_grad_norm_: norm_type must be 2.0, got {norm_type!r}")
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    if not params:
        return to_tensor(0.0, dtype="float32")
    norm = global_norm(p.grad for p in params)
    if error_if_nonfinite and not math.isfinite(float(norm.numpy())):
        raise RuntimeError(f"clip_grad_norm_: the total norm of the gradients is "
                           f"{float(norm.numpy())}; pass error_if_nonfinite=False to clip anyway")
    coef = _clip(max_norm / (norm + 1e-6), None, 1.0)
    for p in params:
        p.grad = p.grad * cast(coef, p.grad.dtype)
    return norm
