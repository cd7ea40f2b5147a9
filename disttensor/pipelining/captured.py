"""Captured pipeline steps: ``dt.to_static(model, loader, loss_fn, opt, strategy=strategy)``
with ``strategy.pipeline.enable``.

The step runs the schedule's action table as the eager schedule does (same sends and receives,
same draw positions, same gradient sync once per chunk and step), but each chunk's work is a
captured program (:func:`disttensor.jit.to_static`, used as a black box) replayed per
micro-batch:

- a chunk before the last: its forward under ``no_grad`` at ``F`` (the output goes to the next
  stage), and at ``B`` a program that runs the forward again and back-propagates the received
  gradient (recomputation: between F and B a stage keeps only the chunk's input, as activation
  checkpointing does);
- the last chunk: forward, loss and backward in one program at ``F`` (nothing it needs comes
  later); ``B`` sends the input's gradient on.

A program is captured per (chunk, kind, whether the backward syncs, which of the stage's
parameters hold a gradient at entry): those decide what the program does, so every later step
replays programs already captured. The optimizer update (``opt.step(); opt.clear_grad()``) is
one more program. The values are those of the eager schedule bit for bit (the same kernels on
the same inputs; the recomputed forward is the forward).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ..autograd import backward
from ..jit.capture import STEP_BUILDERS, StaticFunction
from ..layout.mesh_groups import get_rank
from ..parallel.pipeline import pipeline_info, run_chunk
from ..tape import no_grad
from ..tensor import Tensor
from .eager import PipelineSchedule, _StepState, chunk_output
from .schedules import SCHEDULES, Action
from .transfer import send_tensor

__all__ = ["CapturedPipeline", "CapturedSchedule", "captured_pipeline"]


class CapturedSchedule(PipelineSchedule):
    """A schedule whose chunks run as captured programs (see the module notes)."""

    def __init__(self, model: Any, schedule: str, m: int, loss_fn: Callable, v: int):
        self.schedule = schedule
        super().__init__(model, m, loss_fn, v)
        me = get_rank()
        self.params = [p for p in model.parameters()
                       if p.is_dist() and p._value.mesh.contains(me)]
        self.programs: dict[tuple, StaticFunction] = {}
        self.draw_counter = None  # the draw counter of the running chunk

    def _runner(self, xs: list, ys: list, draws) -> "_CapturedStep":
        return _CapturedStep(self, xs, ys, draws)

    def program(self, key: tuple, make: Callable[[int], Callable]) -> StaticFunction:
        """The captured program of ``key`` (chunk, kind, sync), per gradient state; ``make``
        gives the chunk's function to capture."""
        key = key + (tuple(p.grad is None for p in self.params),)
        prog = self.programs.get(key)
        if prog is None:
            prog = self.programs[key] = StaticFunction(make(key[0]),
                                                       f"pipeline_{key[1]}_chunk{key[0]}")
        return prog


    def _run(self, k: int, received: Tensor | None, tokens: Tensor) -> Tensor:
        """The chunk's output, eagerly (while a program is captured)."""
        with run_chunk(self.info, k, received, lambda: self.draw_counter.start()):
            return chunk_output(self.model, tokens)

    def forward_fn(self, k: int) -> Callable:
        def forward(received, tokens):
            return self._run(k, received, tokens)
        return forward

    def backward_fn(self, k: int) -> Callable:
        def forward_backward(received, tokens, grad):
            backward([self._run(k, received, tokens)], [grad])
            return None if received is None else received.grad
        return forward_backward

    def last_fn(self, k: int) -> Callable:
        scale = 1.0 / self.n_microbatches

        def forward_loss_backward(received, tokens, label):
            loss = self.loss_fn(self._run(k, received, tokens), label)
            backward([loss * scale])
            return loss, None if received is None else received.grad
        return forward_loss_backward


class _CapturedStep(_StepState):
    """One captured step's actions (the eager step's bookkeeping, programs for the work)."""

    def _call(self, a: Action, kind: str, make: Callable, base: int | None, *args):
        k = self._virtual(a)
        sync = kind == "forward" or self.last_backward[a.chunk] == a.mb
        prog = self.s.program((k, kind, sync), make)
        with self.draws.chunk(a.mb, self.s._pre.get(k), base) as cd:
            self.s.draw_counter = cd
            if kind == "forward":
                with no_grad():
                    out = prog(*args)
            else:
                with self._sync_context(a):
                    out = prog(*args)
        self.s._pre[k] = cd.pre
        return out, cd.position()

    def forward(self, a: Action) -> None:
        k = self._virtual(a)
        received, base = self._receive(k, a.mb, False) if k > 0 else (None, None)
        start = time.perf_counter()
        tokens = self.xs[a.mb]
        if self._is_last(k):
            label = self.s._label_on_last(self.ys[a.mb])
            (loss, grad_in), end = self._call(a, "last", self.s.last_fn, base, received, tokens,
                                              label)
            self.losses.append(loss)
            self.draw_counts.append(end)
            self.inputs[a.mb, a.chunk] = grad_in
        else:
            out, end = self._call(a, "forward", self.s.forward_fn, base, received, tokens)
            self.pending += send_tensor(out, self._peer(k + 1), self._tag(k + 1, a.mb, False),
                                        note=end)
            self.inputs[a.mb, a.chunk] = (received, base)
        self._done(a, start)

    def backward(self, a: Action) -> None:
        k = self._virtual(a)
        if self._is_last(k):
            grad_in = self.inputs.pop((a.mb, a.chunk))
            start = time.perf_counter()
        else:
            received, base = self.inputs.pop((a.mb, a.chunk))
            grad = self._receive(k, a.mb, True)[0]
            start = time.perf_counter()
            grad_in, _ = self._call(a, "backward", self.s.backward_fn, base, received,
                                    self.xs[a.mb], grad)
        if k > 0:
            self.pending += send_tensor(grad_in, self._peer(k - 1), self._tag(k - 1, a.mb, True))
        self._done(a, start)


class CapturedPipeline:
    """A :class:`~disttensor.jit.DistModel`'s pipelined training step: the schedule of
    ``strategy.pipeline`` over the captured chunk programs, then the captured update."""

    def __init__(self, layer: Any, loss: Callable, optimizer: Any, cfg: Any):
        fn = "to_static (strategy.pipeline)"
        pipeline_info(fn, layer)
        if loss is None or optimizer is None:
            raise ValueError(f"{fn}: a pipelined step needs both loss and optimizer")
        if cfg.schedule_mode not in SCHEDULES:
            raise ValueError(f"{fn}: schedule_mode must be one of {list(SCHEDULES)}, got "
                             f"{cfg.schedule_mode!r}")
        self.schedule = CapturedSchedule(layer, cfg.schedule_mode, cfg.accumulate_steps, loss,
                                          cfg.vpp_degree)
        self.optimizer = optimizer
        self.update = StaticFunction(self._update, "pipeline_update")

    def _update(self) -> None:
        self.optimizer.step()
        self.optimizer.clear_grad(set_to_zero=False)

    def __call__(self, inputs: Any, labels: Any) -> Tensor:
        loss = self.schedule.step(inputs, labels)
        self.update()
        return loss


def captured_pipeline(layer: Any, loss: Callable | None, optimizer: Any,
                      strategy: Any) -> CapturedPipeline | None:
    """The pipelined step of ``to_static(layer, loader, loss, optimizer, strategy)``, or None
    when ``strategy`` does not enable the pipeline."""
    cfg = getattr(strategy, "pipeline", None)
    if cfg is None or not cfg.enable:
        return None
    merge = getattr(strategy, "gradient_merge", None)
    if merge is not None and merge.enable:
        raise ValueError("to_static (strategy.pipeline): gradient_merge cannot be enabled "
                         "beside the pipeline; its micro-batches are pipeline.accumulate_steps")
    return CapturedPipeline(layer, loss, optimizer, cfg)


STEP_BUILDERS.append(captured_pipeline)
