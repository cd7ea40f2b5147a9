"""Memory planning: peak bytes and step time of captured steps in their planned arena, against
eager and against replay without a plan; and the planner's own speed.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/memory.py [--quick]   # also -n 1, -n 2

Prints JSON on rank 0:

* ``steps``: for train.py's MLP and GPT at the default and the larger size, the most any rank
  holds at once during one step (tracemalloc, which sees numpy's buffers; bytes above what was
  allocated before the step): ``eager_peak``, ``unplanned_peak`` (captured, each kernel
  allocating as eager mode does), ``planned_peak`` (the default plan: what kernels write through
  ``out=`` in the arena; the arena's bytes plus what the step allocates besides) and
  ``planned_all_peak`` (every temporary in the arena, the others copied in), and the same two
  with ``recompute=True`` (``recompute_peak``, ``recompute_all_peak``: cheap forward ops run
  again in the backward, :mod:`disttensor.jit.remat`); ``*_vs_eager`` ratios (target <= 0.75
  at the larger GPT); the arenas against the lower bound, the no-reuse total (of every
  temporary); median step times (the modes timed in turn, step by step) and
  ``time_*_vs_unplanned`` (target <= 1.0);
* ``liveness_4000_ops_ms``: worklist liveness of a synthetic program shaped like the
  memory-planning example's se-resnext (residual blocks, a backward that reads the saved
  activations), median (target <= 20 ms);
* ``plan_8000_buffers_ms``: the arena planner on 8000 buffers of a training step's shape (half
  of the forward activations saved for backward), median (target <= 250 ms), and
  ``plan_8000_until_the_bound_ms``: the strategies tried until one reaches the bound exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
from mpi4py import MPI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples")]

import train  # noqa: E402

import disttensor as dt  # noqa: E402
from disttensor.jit import peak_bytes  # noqa: E402
from disttensor.jit.memory import STRATEGIES, Block, Buffer, aligned, live_ranges, plan_arena  # noqa: E402


def _max_over_ranks(x: int) -> int:
    return int(MPI.COMM_WORLD.allreduce(x, op=MPI.MAX))


def bench_step(model_name: str, size: str, steps: int, plot: str | None = None) -> dict:
    mesh = train.default_mesh(dt.get_world_size())
    batch = 16 if size == "default" else 32
    out: dict = {"mesh": list(mesh.shape), "batch": batch}
    runs = {}
    for mode, scope in MODES.items():
        model, opt, batches = train.build(model_name, 3, mesh, batch=batch, size=size)
        def step(x, y, model=model, opt=opt):
            return train.train_step(model, opt, x, y)
        step.__name__ = f"{model_name}_{size}_step"
        if mode != "eager":
            step = dt.jit.to_static(step, plan_memory=scope,
                                    recompute=mode.startswith("recompute"))
        data = [train.to_tensors(*b, mesh) for b in batches]
        for k in range(3):  # the captures, and warm caches
            step(*data[k % 4])
        runs[mode] = step, data
    times: dict = {mode: [] for mode in MODES}
    for k in range(steps):  # the modes in turn, so that a change of load hits them alike
        for mode, (step, data) in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            step(*data[k % 4]).numpy()
            times[mode].append(time.perf_counter() - t0)
    for mode, scope in MODES.items():
        step, data = runs[mode]
        peaks = []
        for k in range(3):  # peaks apart from timing: tracemalloc slows allocations down
            _, peak = peak_bytes(step, *data[k % 4])
            peaks.append(peak)
        arena = 0
        if scope:
            report = step.program.memory_report()
            arena = report["arena_bytes"]
            out[f"{mode}_arena_bytes"] = arena
            out[f"{mode}_arena_vs_lower_bound"] = report["vs_lower_bound"]
        if scope == "all":  # every temporary: the whole step's bound
            out[f"{mode}_lower_bound_bytes"] = report["lower_bound_bytes"]
            out[f"{mode}_no_reuse_bytes"] = report["no_reuse_bytes"]
            out[f"{mode}_strategy"] = report["strategy"]
            if plot and mode == "planned_all" and dt.get_rank() == 0:
                step.program.plot_memory(plot)
        if mode.startswith("recompute"):
            out[f"{mode}_values"] = len(step.program.recomputed)
        out[f"{mode}_peak"] = _max_over_ranks(max(peaks) + arena)
        out[f"{mode}_ms"] = round(float(np.median(times[mode])) * 1e3, 3)
    for mode in MODES:
        if mode != "eager":
            out[f"{mode}_vs_eager"] = round(out[f"{mode}_peak"] / out["eager_peak"], 3)
        if mode not in ("eager", "unplanned"):
            out[f"time_{mode}_vs_unplanned"] = round(out[f"{mode}_ms"] / out["unplanned_ms"], 3)
    return out


#: the runs of :func:`bench_step`: mode -> plan_memory scope (recompute modes also recompute)
MODES = {"eager": None, "unplanned": False, "planned": "kernels", "planned_all": "all",
         "recompute": "kernels", "recompute_all": "all"}


def example_program(n_ops: int = 4000) -> tuple[list[Block], int]:
    """A straight-line training program like the memory-planning example's se-resnext:
    forward residual blocks of three ops and an add, then a backward op per forward op reading
    the gradient, the op's input and its output."""
    instrs, fwd, n = [], [], 1
    x = 0
    while len(instrs) < n_ops // 2:
        block_in = x
        for k in range(4):
            y = n
            n += 1
            uses = (1 << x) | ((1 << block_in) if k == 3 else 0)
            instrs.append((uses, 1 << y))
            fwd.append((x, y))
            x = y
    g = n
    n += 1
    instrs.append((1 << x, 1 << g))
    for a, y in reversed(fwd):
        if len(instrs) >= n_ops:
            break
        instrs.append(((1 << g) | (1 << a) | (1 << y), 1 << n))
        g, n = n, n + 1
    return [Block(instrs)], n


def training_buffers(n: int = 8000, seed: int = 0) -> list[Buffer]:
    """``n`` buffers of a training step's shape: ``n / 2`` forward activations (half saved until
    the mirrored backward op), then ``n / 2`` short-lived backward temporaries."""
    rng = random.Random(seed)
    half, out = n // 2, []
    for i in range(half):
        size = aligned(4096 * rng.choice([1, 2, 4, 8]) * rng.randint(1, 4))
        last = 2 * half - 1 - i if rng.random() < 0.5 else i + rng.randint(1, 3)
        out.append(Buffer(len(out), size, i, last))
    for i in range(half):
        t = half + i
        out.append(Buffer(len(out), aligned(4096 * rng.choice([1, 2, 4])), t,
                          min(2 * half - 1, t + rng.randint(1, 3))))
    return out


def bench_planner(repeat: int) -> dict:
    blocks, n_values = example_program()
    t_live = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        live_ranges(blocks, n_values)
        t_live.append(time.perf_counter() - t0)
    buffers = training_buffers()
    t_plan, t_all, plan = [], [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = plan_arena(buffers)
        t_plan.append(time.perf_counter() - t0)
    for _ in range(max(1, repeat // 3)):
        t0 = time.perf_counter()
        full = plan_arena(buffers, list(STRATEGIES), tolerance=0.0)
        t_all.append(time.perf_counter() - t0)
    return {"liveness_4000_ops_ms": round(float(np.median(t_live)) * 1e3, 2),
            "liveness_values": n_values,
            "plan_8000_buffers_ms": round(float(np.median(t_plan)) * 1e3, 1),
            "plan_8000_strategy": plan.strategy, "plan_8000_tried": plan.tried,
            "plan_8000_vs_lower_bound": round(plan.size / plan.lower_bound, 5),
            "plan_8000_until_the_bound_ms": round(float(np.median(t_all)) * 1e3, 1),
            "plan_8000_until_the_bound_tried": full.tried}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    p.add_argument("--plot", metavar="PATH", help="also draw the larger GPT's arena (rank 0)")
    args = p.parse_args()
    dt.init_parallel_env()
    steps = 5 if args.quick else 20
    result: dict = {"world_size": dt.get_world_size(), "steps": {}}
    for name in ("mlp", "gpt"):
        for size in ("default", "large"):
            plot = args.plot if (name, size) == ("gpt", "large") else None
            result["steps"][f"{name}_{size}"] = bench_step(name, size, steps, plot)
    if dt.get_rank() == 0:
        result["planner"] = bench_planner(3 if args.quick else 9)
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
