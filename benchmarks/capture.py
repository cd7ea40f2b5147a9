"""Captured programs against eager execution and against hand-written numpy + mpi4py.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/capture.py [--quick]   # also -n 1, -n 2

Prints JSON on rank 0:

* ``steps``: for train.py's MLP (BatchNorm1D, dropout) and GPT at their default sizes and at a
  larger size (``train.SIZES``), the median step time eager and captured (``dt.jit.to_static``)
  on the default [dp, mp] mesh, ``speedup`` = eager / captured (target >= 1.5 at the default
  sizes on 4 ranks), and ``capture_ms``: the time of the capturing calls (the first step makes
  the optimizer's states, so the second call captures once more);
* ``vs_hand``: the train.py MLP step with SGD (no dropout) captured, beside the same sharding
  written by hand with numpy and raw mpi4py collectives (``benchmarks/mlp_step.py``):
  ``ratio`` = captured / hand (targets: <= 2 at the default size, <= 1.1 at the larger), and
  the collectives of one step on each side (the hand-written step issues what a careful hand
  would: one all-reduce each for the batch statistics, the logits, the loss, batch_norm's
  gradient sums and the bucket of data-parallel gradients);
* ``replay_overhead_us_per_op``: a captured chain of small elementwise ops ([64, 64] float32)
  replayed, minus the same numpy calls made directly, per op (target <= 2 us), timed on rank 0
  while the other ranks sleep in a barrier;
* ``union_find``: the inplace-chain union-find (``InplaceChains``) over one chain of 10 000
  and of 100 000 values (every value joined to the next, then every root found), on rank 0:
  ``ms`` per size, ``ratio_to_loop`` = its time / a bare Python loop assigning one parent per
  value (the same run), and ``scaling`` = time at 100 000 / time at 10 000 (10 when linear).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples"),
                 os.path.dirname(os.path.abspath(__file__))]

import train  # noqa: E402
from mlp_step import Sizes, bench_mlp  # noqa: E402

import disttensor as dt  # noqa: E402


def _median(ts: list[float]) -> float:
    return float(np.median(ts))


def bench_step(model_name: str, size: str, steps: int) -> dict:
    """Eager and captured steps of the same model, built twice from one seed, timed alternately
    (so that load on the machine hits both alike)."""
    world = dt.get_world_size()
    mesh = train.default_mesh(world)
    batch = 16 if size == "default" else 32
    out = {"mesh": list(mesh.shape), "batch": batch}
    runs = {}
    for mode in ("eager", "captured"):
        model, opt, batches = train.build(model_name, 3, mesh, batch=batch, size=size)
        step = (lambda x, y, m=model, o=opt: train.train_step(m, o, x, y))
        if mode == "captured":
            step = dt.jit.to_static(step)
        runs[mode] = (step, [train.to_tensors(*b, mesh) for b in batches], [])
    for k in range(steps):
        for mode, (step, data, times) in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            step(*data[k % 4]).numpy()
            times.append(time.perf_counter() - t0)
    captured = runs["captured"][0]
    for mode, (_, _, times) in runs.items():
        out[f"{mode}_ms"] = round(_median(times[3:]) * 1e3, 3)
    out["capture_ms"] = round(sum(runs["captured"][2][:captured.captures]) * 1e3, 1)
    out["program_ops"] = len(captured.program.ops)
    out["speedup"] = round(out["eager_ms"] / out["captured_ms"], 2)
    return out


def bench_replay_overhead(n_ops: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    c = rng.standard_normal((64, 64)).astype(np.float32)
    x, ct = dt.to_tensor(a), dt.to_tensor(c)

    def chain(x):
        for _ in range(n_ops // 2):
            x = dt.relu(x + ct)
        return x
    f = dt.jit.to_static(chain)
    f(x)

    def raw():
        y = a
        for _ in range(n_ops // 2):
            y = np.maximum(np.add(y, c), 0).astype(np.float32, copy=False)
        return y
    t_replay, t_raw = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f(x)
        t_replay.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        raw()
        t_raw.append(time.perf_counter() - t0)
    r, n = _median(t_replay), _median(t_raw)
    return {"ops": n_ops, "replay_us": round(r * 1e6, 1), "numpy_us": round(n * 1e6, 1),
            "overhead_us_per_op": round((r - n) / n_ops * 1e6, 3)}


def _best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_union_find(sizes: tuple[int, ...], repeat: int) -> dict:
    """Union along a chain, then a find of every value: against a loop of bare assignments."""
    from disttensor.jit.program import InplaceChains

    def chain(n: int) -> None:
        chains = InplaceChains(n + 1, lambda v: v == 0)
        for i in range(n):
            chains.union(i, i + 1)
        for i in range(n + 1):
            chains.find(i)

    def loop(n: int) -> None:
        parent = list(range(n + 1))
        for i in range(n):
            parent[i + 1] = i

    out = {}
    for n in sizes:
        t, base = _best_of(lambda: chain(n), repeat), _best_of(lambda: loop(n), repeat)
        out[str(n)] = {"ms": round(t * 1e3, 3), "loop_ms": round(base * 1e3, 3),
                       "ratio_to_loop": round(t / base, 1)}
    out["scaling"] = round(out[str(sizes[-1])]["ms"] / out[str(sizes[0])]["ms"], 2)
    return out


def _sleeping_barrier(comm) -> None:
    """A barrier whose waiting ranks sleep instead of polling: rank 0 times the replay alone,
    and ranks spinning in MPI's wait would take its cores on an oversubscribed machine."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    args = p.parse_args()
    dt.init_parallel_env()
    steps = 8 if args.quick else 30
    result = {"world_size": dt.get_world_size(), "steps": {}}
    for name in ("mlp", "gpt"):
        for size in ("default", "large"):
            result["steps"][f"{name}_{size}"] = bench_step(name, size, steps)
    result["vs_hand"] = {
        "default": bench_mlp(Sizes(16, 16, 32, 8), steps, captured=True),
        "larger": bench_mlp(Sizes(256, 256, 512, 64), steps, captured=True)}
    if dt.get_rank() == 0:
        result["replay_overhead"] = bench_replay_overhead(400, 5 if args.quick else 30)
        result["union_find"] = bench_union_find((10_000, 100_000), 3 if args.quick else 7)
    _sleeping_barrier(MPI.COMM_WORLD)
    if dt.get_rank() == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
