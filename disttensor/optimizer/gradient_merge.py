"""Gradient merge (Paddle's ``strategy.gradient_merge``): one optimizer step over ``k_steps``
micro-batches of the batch a step is given.

Each rank cuts its own piece of the batch into ``k_steps`` equal parts (no communication):
micro-batch ``i`` is part ``i`` of every rank's piece, laid out as the batch. The backwards of
all but the last micro-batch run inside :func:`disttensor.no_sync`, so the gradients
accumulate locally and are synced once, with the last backward (one all-reduce per bucket
under data parallelism, one reduce-scatter under ZeRO-2); then the optimizer steps once. With
``avg`` (Paddle's default) each micro-batch loss is divided by ``k_steps``, so the gradient is
the batch mean's. Everything is an op, so a captured step (``to_static``, ``DistModel``)
consumes the K micro-batches in one call and replays exactly what eager mode runs.
"""
from __future__ import annotations

import contextlib
from math import prod
from typing import Any, Callable

from ..distributed.api import _from_local, _to_local
from ..grad_sync import no_sync
from ..ops import split
from ..tensor import Tensor

__all__ = ["micro_batches", "merged_step", "gradient_merge_config"]


def micro_batches(x: Tensor, k_steps: int) -> list[Tensor]:
    """``x`` cut along dim 0 into ``k_steps`` micro-batches, each rank cutting its own piece
    (part ``i`` of every piece forms micro-batch ``i``, in ``x``'s layout). The batch must
    split evenly: its size a multiple of ``k_steps`` times the ranks sharding dim 0."""
    if not isinstance(x, Tensor) or x.ndim == 0:
        raise TypeError(f"gradient_merge: the batch must be a Tensor with a batch dim, got "
                        f"{type(x).__name__} {getattr(x, 'shape', '')}")
    if k_steps == 1:
        return [x]
    if not x.is_dist():
        if x.shape[0] % k_steps:
            raise ValueError(f"gradient_merge: the batch of shape {x.shape} does not split into "
                             f"k_steps={k_steps} equal micro-batches")
        return list(split(x, k_steps, axis=0))
    v = x._value
    ranks = prod(v.mesh.shape[m] for m in v.dist_attr.dims_mapping[0])
    if x.shape[0] % (ranks * k_steps):
        raise ValueError(f"gradient_merge: the batch of shape {x.shape} (placements "
                         f"{x.placements}) does not split into k_steps={k_steps} equal "
                         f"micro-batches on each of the {ranks} ranks sharding its dim 0")
    shape = (x.shape[0] // k_steps, *x.shape[1:])
    return [_from_local(p, v.mesh, v.dist_attr, shape)
            for p in split(_to_local(x), k_steps, axis=0)]


def merged_step(model: Any, optimizer: Any, forward: Callable[[Any, Any], Tensor], inputs: Any,
                labels: Any, k_steps: int = 1, avg: bool = True, scaler: Any = None) -> Tensor:
    """One training step over ``k_steps`` micro-batches of ``(inputs, labels)``:
    ``forward(x, y)`` returns a micro-batch's loss; its backward accumulates (synced once, on
    the last); then ``optimizer.step()`` (through ``scaler`` when given: unscale, skip a
    non-finite step on every rank, update the scale) and ``clear_grad``. Returns the step's
    loss: the mean of the micro-batch losses with ``avg``, else their sum.

    Example::

        loss = merged_step(model, opt, lambda x, y: F.cross_entropy(model(x), y), x, y,
                           k_steps=4)
    """
    xs, ys = micro_batches(inputs, k_steps), micro_batches(labels, k_steps)
    total = None
    for i, (x, y) in enumerate(zip(xs, ys)):
        with no_sync(model) if i < k_steps - 1 else contextlib.nullcontext():
            loss = forward(x, y)
            if avg and k_steps > 1:
                loss = loss / k_steps
            (loss if scaler is None else scaler.scale(loss)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.clear_grad(set_to_zero=False)
    return loss if k_steps == 1 else total


def gradient_merge_config(strategy: Any) -> tuple[int, bool]:
    """``(k_steps, avg)`` of ``strategy.gradient_merge`` (a :class:`disttensor.Strategy`, or a
    dict ``{"gradient_merge": {...}}``); ``(1, True)`` when absent or not enabled."""
    gm = strategy.get("gradient_merge") if isinstance(strategy, dict) else \
        getattr(strategy, "gradient_merge", None)
    get = (gm.get if isinstance(gm, dict) else lambda k, d: getattr(gm, k, d))
    if gm is None or not get("enable", False):
        return 1, True
    k, avg = get("k_steps", 1), get("avg", True)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"gradient_merge: k_steps must be a positive integer, got {k!r}")
    return k, bool(avg)
