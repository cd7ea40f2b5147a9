"""Eager pipeline schedules: ``sched.step(x, y)`` runs forward and backward of every
micro-batch through this rank's stage in the order of the schedule's action table.

A stage's forward of micro-batch i starts from the activation received from the previous stage
(a detached leaf that wants a gradient) and its backward from its output with the gradient
received from the next stage (:func:`disttensor.autograd.backward`); the input's gradient then
goes back. The last chunk computes ``loss_fn(output, y_i) / m``, so the parameters' gradients
are those of the mean loss over the micro-batches, as the un-pipelined run over the same
micro-batches. Parameter gradients accumulate into ``.grad`` over the micro-batches; their
data-parallel sync runs once per step and chunk, in the chunk's last backward on the stage
(the earlier ones run inside :func:`disttensor.no_sync`). Random ops draw the seeds the
un-pipelined run draws (:mod:`.draws`). ``opt.step()`` follows as usual.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import numpy as np

from spmd_rules import Replicate, Shard

from ..autograd import backward
from ..distributed.api import reshard, shard_tensor
from ..grad_sync import no_sync
from ..layout.mesh_groups import get_rank, world
from ..ops import to_tensor
from ..parallel.pipeline import StageOutput, pipeline_info, run_chunk
from ..tensor import Tensor
from .draws import StepDraws
from .schedules import Action, first_forwards_first, schedule_actions
from .transfer import TAG_BASE, recv_tensor, send_tensor

__all__ = ["PipelineSchedule", "ScheduleFThenB", "Schedule1F1B", "ScheduleVPP"]


class PipelineSchedule:
    """The eager schedule ``schedule`` over a model :func:`disttensor.parallelize` cut into
    stages (``pp_config``), with ``n_microbatches`` micro-batches (default: pp_config's
    ``micro_batches``) and ``loss_fn(output, label)``
    (a scalar: the mean over its micro-batch). ``timeline`` holds the last step's actions of
    this rank as (label, start, end) ``time.perf_counter`` seconds (the wait of a receive
    not included)."""

    schedule = ""

    def __init__(self, model: Any, n_microbatches: int | None = None,
                 loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None, vpp_degree: int = 1):
        fn = type(self).__name__
        info = pipeline_info(fn, model)
        if n_microbatches is None:
            n_microbatches = info.micro_batches
        schedule_actions(self.schedule, info.pp, n_microbatches, vpp_degree)  # checks m, v
        if vpp_degree != info.vpp_degree:
            raise ValueError(f"{fn}: vpp_degree={vpp_degree} but the model was cut into "
                             f"{info.vpp_degree} chunk(s) per stage (pp_config vpp_degree)")
        if not callable(loss_fn):
            raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
        self.model, self.info, self.loss_fn = model, info, loss_fn
        self.n_microbatches, self.vpp_degree = n_microbatches, vpp_degree
        self.stage = info.stage_of(get_rank())
        self.actions = ([] if self.stage is None else
                        schedule_actions(self.schedule, info.pp, n_microbatches,
                                         vpp_degree)[self.stage])
        self.timeline: list[tuple[str, float, float]] = []  # last step: (action, start, end)
        self._per_mb: int | None = None  # random draws per micro-batch forward (N)
        self._pre: dict[int, int | None] = {}  # chunk -> draws of the layers before the list

    # -- micro-batches -------------------------------------------------------------------------
    def _split(self, name: str, t: Any) -> list[Tensor]:
        fn = f"{type(self).__name__}.step"
        t = t if isinstance(t, Tensor) else to_tensor(np.asarray(t))
        if t.is_dist():
            raise ValueError(f"{fn}: {name} must be the dense global batch (every rank passes "
                             f"it), got a distributed tensor on {t._value.mesh}")
        m, mesh = self.n_microbatches, self.info.stage_meshes[0]
        dp = mesh.get_dim_size("dp") if "dp" in mesh.dim_names else 1
        if t.ndim == 0 or t.shape[0] % (m * dp):
            raise ValueError(f"{fn}: {name} of shape {t.shape}: {m} micro-batches x dp={dp} "
                             f"do not divide its batch dim")
        b = t.shape[0] // m
        return [t[i * b:(i + 1) * b] for i in range(m)]

    def _label_on_last(self, y: Tensor) -> Tensor:
        mesh = self.info.stage_meshes[-1]
        pl = [Replicate()] * mesh.ndim
        if "dp" in mesh.dim_names:
            pl[mesh.dim_names.index("dp")] = Shard(0)
        return shard_tensor(y, mesh, pl)

    # -- one step ------------------------------------------------------------------------------
    def step(self, x: Any, y: Any) -> Tensor:
        """Forward and backward of every micro-batch of ``(x, y)`` (dense global batches, split
        along dim 0) in schedule order; the mean loss, a dense scalar on every rank.
        Gradients accumulate into the parameters' ``.grad``.

        Example::

            sched = dt.pipelining.Schedule1F1B(model, n_microbatches=4, loss_fn=loss_fn)
            loss = sched.step(x, y); opt.step(); opt.clear_grad()
        """
        xs, ys = self._split("x", x), self._split("y", y)
        draws = StepDraws(self._per_mb)
        run = self._runner(xs, ys, draws)
        self.timeline = run.timeline
        actions = self.actions
        if self._per_mb is None:  # learn N: micro-batch 0 through every stage first
            actions = first_forwards_first(actions)
        try:
            for a in actions:
                if draws.per_mb is None and not (a.kind == "F" and a.mb == 0):
                    draws.per_mb = self._share_draws(run)
                (run.forward if a.kind == "F" else run.backward)(a)
            if draws.per_mb is None:  # (no action after micro-batch 0's forwards here)
                draws.per_mb = self._share_draws(run)
        finally:
            for h in run.pending:
                h.wait()
        return self._finish(run, draws)

    def _runner(self, xs: list, ys: list, draws: StepDraws) -> "_StepState":
        return _StepState(self, xs, ys, draws)

    def _last_rank(self) -> int:
        info = self.info
        return info.mesh.rank_at([info.pp - 1 if d == info.pp_dim else 0
                                  for d in range(info.mesh.ndim)])

    def _share_draws(self, run: "_StepState") -> int:
        """N, the random draws of one micro-batch's forward, from the last stage (its forward
        of micro-batch 0 has run) to every rank."""
        n = np.array([max(run.draw_counts, default=0)], dtype=np.int64)
        self._per_mb = int(world().broadcast(n, src=self._last_rank())[0])
        return self._per_mb

    def _finish(self, run: "_StepState", draws: StepDraws) -> Tensor:
        """The mean loss on every rank (broadcast from the last stage with the draws counted
        there); the generator put where the un-pipelined step leaves it."""
        value = np.zeros(2, dtype=np.float64)
        losses = run.losses
        if losses:
            total = losses[0]
            for t in losses[1:]:
                total = total + t
            last = self.info.stage_meshes[-1]
            full = reshard(total, last, [Replicate()] * last.ndim)
            value[0] = float(np.asarray(full._value.local.array).reshape(-1)[0])
            counts = set(run.draw_counts)
            value[1] = counts.pop() if len(counts) == 1 else -1
        value = world().broadcast(value, src=self._last_rank())
        per_mb = int(value[1])
        draws.finish(self.n_microbatches * max(per_mb, 0))
        if per_mb != draws.per_mb:
            self._per_mb = None
            raise RuntimeError(
                f"{type(self).__name__}.step: the model's forward drew {per_mb} random seeds per "
                f"micro-batch (-1: a different number per micro-batch) where the schedule "
                f"planned {draws.per_mb}: this step's random masks differ from the un-pipelined "
                "run's (the next step counts again)")
        dtype = losses[0].dtype if losses else "float32"
        return to_tensor(value[0] / self.n_microbatches, dtype=dtype)


class _StepState:
    """What one step keeps between actions: stage inputs/outputs per (micro-batch, chunk),
    the losses, the random draws per micro-batch counted on the last stage and the pending
    sends. :meth:`forward` and :meth:`backward` run one action eagerly."""

    def __init__(self, sched: PipelineSchedule, xs: list, ys: list, draws: StepDraws):
        self.s, self.info, self.xs, self.ys, self.draws = sched, sched.info, xs, ys, draws
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.losses: list[Tensor] = []
        self.draw_counts: list[int] = []
        self.pending: list = []
        self.timeline: list[tuple[str, float, float]] = []
        self.last_backward = {}  # chunk -> micro-batch of its last backward on this stage
        for a in sched.actions:
            if a.kind == "B":
                self.last_backward[a.chunk] = a.mb

    def _done(self, a: Action, start: float) -> None:
        self.timeline.append((a.label(self.s.vpp_degree), start, time.perf_counter()))

    def _virtual(self, a: Action) -> int:
        return a.chunk * self.info.pp + self.s.stage

    def _tag(self, k: int, mb: int, backward: bool) -> int:
        return TAG_BASE + 2 * (k * self.s.n_microbatches + mb) + backward

    def _peer(self, k: int) -> int:
        return self.info.peer(get_rank(), k % self.info.pp)

    def _receive(self, k: int, mb: int, backward: bool) -> tuple[Tensor, int]:
        src = self._peer(k + 1 if backward else k - 1)
        return recv_tensor(self.info.stage_meshes[self.s.stage], src,
                           self._tag(k, mb, backward))

    def _is_last(self, k: int) -> bool:
        return k == len(self.info.chunks) - 1

    def _sync_context(self, a: Action):
        """No data-parallel gradient sync except in the chunk's last backward on the stage."""
        if self.last_backward[a.chunk] == a.mb:
            return contextlib.nullcontext()
        return no_sync(self.s.model)

    def forward(self, a: Action) -> None:
        k = self._virtual(a)
        received, base = self._receive(k, a.mb, False) if k > 0 else (None, None)
        if received is not None:
            self.inputs[a.mb, a.chunk] = received
        start = time.perf_counter()
        with self.draws.chunk(a.mb, None, base) as cd, \
                run_chunk(self.info, k, received, cd.start):
            out = chunk_output(self.s.model, self.xs[a.mb])
            if self._is_last(k):
                loss = self.s.loss_fn(out, self.s._label_on_last(self.ys[a.mb]))
        self.s._pre[k] = cd.pre
        if self._is_last(k):
            self.losses.append(loss.detach())
            self.draw_counts.append(cd.position())
            out = loss * (1.0 / self.s.n_microbatches)
        else:
            self.pending += send_tensor(out, self._peer(k + 1), self._tag(k + 1, a.mb, False),
                                        note=cd.position())
        self.outputs[a.mb, a.chunk] = out
        self._done(a, start)

    def backward(self, a: Action) -> None:
        k = self._virtual(a)
        out = self.outputs.pop((a.mb, a.chunk))
        grad = None if self._is_last(k) else self._receive(k, a.mb, True)[0]
        start = time.perf_counter()
        with self._sync_context(a):
            backward([out], [grad])
        if k > 0:
            inp = self.inputs.pop((a.mb, a.chunk))
            self.pending += send_tensor(inp.grad, self._peer(k - 1), self._tag(k - 1, a.mb, True))
        self._done(a, start)


def chunk_output(model: Any, tokens: Tensor) -> Tensor:
    """The output of the chunk :func:`run_chunk` selected, from a call of ``model``."""
    try:
        return model(tokens)
    except StageOutput as done:
        return done.output


class ScheduleFThenB(PipelineSchedule):
    """GPipe: all forwards, then all backwards (every micro-batch's activations held)."""
    schedule = "FThenB"


class Schedule1F1B(PipelineSchedule):
    """One forward, one backward: stage s holds at most pp - s micro-batches of activations."""
    schedule = "1F1B"


class ScheduleVPP(PipelineSchedule):
    """Interleaved 1F1B over ``vpp_degree`` chunks per stage (``pp_config`` cut the model into
    pp x vpp_degree chunks); needs ``n_microbatches % pp == 0``."""
    schedule = "VPP"

    def __init__(self, model: Any, n_microbatches: int | None = None,
                 loss_fn: Callable | None = None, vpp_degree: int = 2):
        super().__init__(model, n_microbatches, loss_fn, vpp_degree)
