"""Random seeds of a pipelined step, independent of the stage split and the schedule's order.

Random kernels without an explicit seed (dropout, attention dropout, multinomial) take one
``default_generator.next_seed()`` each when they run. The un-pipelined run over the same
micro-batches (forward of micro-batch 0, then 1, ...) takes draw ``i * N + j`` of the step for
the j-th random op of micro-batch i's forward, N being the draws of one micro-batch's forward
(loss included). A pipelined step runs the micro-batches' chunks in another order, on other
ranks, so here every draw is made by its position instead: draw j of chunk k for micro-batch i
is ``i * N + c_k + j``, where ``c_k`` (the draws of the layers before chunk k) travels with the
activation from the previous chunk. Positions are reached by jumping the step's starting PCG64
state (``advance``; one ``next_seed`` is one 64-bit output), so the masks equal the un-pipelined
run's bit for bit; at the end of the step every rank's generator stands at ``m * N`` draws,
where the un-pipelined run leaves it.

N is learnt on a schedule's first step (its forwards of micro-batch 0 run first, then the last
stage broadcasts N) and checked at the end of every step.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ..generator import default_generator

__all__ = ["StepDraws"]


class StepDraws:
    """The seed positions of one step: ``per_mb`` (N) draws per micro-batch forward (None
    while unknown: then only micro-batch 0 may draw)."""

    def __init__(self, per_mb: int | None):
        bg = default_generator.rng.bit_generator
        if not isinstance(bg, np.random.PCG64):
            raise TypeError("pipeline schedule: the global generator must be numpy's PCG64 "
                            f"(dt.seed makes one), got {type(bg).__name__}")
        self.start = bg.state
        self.per_mb = per_mb

    def seed_at(self, pos: int) -> int:
        """``next_seed()`` of the un-pipelined step's draw number ``pos``."""
        bg = np.random.PCG64()
        bg.state = self.start
        bg.advance(pos)
        return int(np.random.Generator(bg).integers(0, 2**62))

    @contextmanager
    def chunk(self, mb: int, pre: int | None, base: int | None) -> Iterator["ChunkDraws"]:
        """Within this block ``next_seed()`` gives the draws of micro-batch ``mb`` through one
        chunk: its first ``pre`` draws (the layers before the split list, run again by every
        chunk's call of the model) by their own position, the later ones from ``base`` on
        (``base`` None: at the chunk's own ``pre``, as for chunk 0). ``pre`` None: told by
        :meth:`ChunkDraws.start` when the chunk's first layer starts."""
        if mb and self.per_mb is None:
            raise RuntimeError("pipeline schedule: micro-batch > 0 drew before the draws per "
                               "micro-batch were known")
        cd = ChunkDraws(self, mb * (self.per_mb or 0), pre, base)
        default_generator.next_seed = cd.draw
        try:
            yield cd
        finally:
            del default_generator.next_seed

    def finish(self, total: int) -> None:
        """Put the generator where the un-pipelined step leaves it: ``total`` draws on."""
        bg = default_generator.rng.bit_generator
        bg.state = self.start
        bg.advance(total)


class ChunkDraws:
    """The draw counter of one chunk run (see :meth:`StepDraws.chunk`)."""

    def __init__(self, step: StepDraws, offset: int, pre: int | None, base: int | None):
        self.step, self.offset, self.pre, self.base = step, offset, pre, base
        self.count = 0

    def start(self) -> None:
        """The chunk's first layer starts: the draws so far were the outer layers'."""
        if self.pre is None:
            self.pre = self.count

    def position(self) -> int:
        """The position (within the micro-batch) of the next draw."""
        if self.pre is None or self.count < self.pre:
            return self.count
        return (self.pre if self.base is None else self.base) + self.count - self.pre

    def draw(self) -> int:
        pos = self.position()
        self.count += 1
        return self.step.seed_at(self.offset + pos)
