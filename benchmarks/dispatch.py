"""Distributed dispatch overhead and a training step against hand-written mpi4py.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/dispatch.py [--quick]

Prints JSON on rank 0:

* ``ops``: steady-state latency of ``add`` (S(0)+S(0)), ``relu``, ``reshape`` (zero
  communication) and ``add_`` on a [64, 64] float32 DistTensor on a 1-d mesh of all ranks, each
  beside the raw numpy call on the local piece: ``overhead_us`` = ours - numpy, ``ratio`` =
  ours / numpy (target: overhead <= 8 us). These ops need no communication, so rank 0 times
  them while the other ranks sleep (4 ranks may share fewer cores);
* ``cache_miss_us``: the first call of an op/layout/shape combination (rule + plans), minus the
  steady-state call;
* ``mlp_step``: one training step (forward, backward, SGD) of the train.py MLP shape on a
  [dp, mp] = [2, 2] mesh (or [world, 1]) written with disttensor, beside the same sharding
  written by hand with numpy and raw mpi4py calls, and ``ratio`` = ours / hand (target <= 1.1);
  ``loss_max_rel_diff`` checks that both compute the same losses.
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
# the repository first (benchmarks/collectives.py must not shadow the collectives package)
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples"),
                 os.path.dirname(os.path.abspath(__file__))]

from mlp_step import Sizes, bench_mlp  # noqa: E402

import disttensor as dt  # noqa: E402
from disttensor import Shard  # noqa: E402
from disttensor.dispatch import plan_cache_info  # noqa: E402


def _median_time(fn, number: int, repeat: int) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return float(np.median(times))


def _sleep_until_rank0_done(timed) -> dict | None:
    """Rank 0 runs ``timed()``; the others wait without spinning on the CPU."""
    comm = MPI.COMM_WORLD
    result = timed() if comm.rank == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
    return result


def bench_ops(number: int, repeat: int) -> dict:
    world = dt.get_world_size()
    mesh = dt.ProcessMesh(list(range(world)))
    a = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    x = dt.shard_tensor(a, mesh, [Shard(0)])
    y = dt.shard_tensor(a, mesh, [Shard(0)])
    la, lb = x._value.local.array, y._value.local.array
    cases = {
        "add": (lambda: dt.add(x, y), lambda: np.add(la, lb)),
        "relu": (lambda: dt.relu(x), lambda: np.maximum(la, 0)),
        "reshape": (lambda: dt.reshape(x, [64 * 64]), lambda: la.reshape(-1)),
        "add_": (lambda: x.add_(y), lambda: np.add(la, lb, out=la)),
    }
    # placed by every rank (shard_tensor checks that the ranks agree): a fresh shape each forces
    # rule evaluation and planning on its first op
    fresh = [dt.shard_tensor(np.ones((64 + i, 8), np.float32), mesh, [Shard(0)])
             for i in range(1, 41)]
    return _sleep_until_rank0_done(lambda: _time_ops(cases, fresh, number, repeat))


def _time_ops(cases: dict, fresh: list, number: int, repeat: int) -> dict:
    out = {}
    for name, (ours, raw) in cases.items():
        t_raw = _median_time(raw, number, repeat)
        t_ours = _median_time(ours, number, repeat)
        out[name] = {"ours_us": round(t_ours * 1e6, 2), "numpy_us": round(t_raw * 1e6, 2),
                     "overhead_us": round((t_ours - t_raw) * 1e6, 2),
                     "ratio": round(t_ours / t_raw, 2)}
    misses = []
    for b in fresh:
        t0 = time.perf_counter()
        dt.relu(b)
        misses.append(time.perf_counter() - t0)
    out["cache_miss_us"] = round((float(np.median(misses)) - out["relu"]["ours_us"] * 1e-6)
                                 * 1e6, 2)
    out["plans_cached"] = plan_cache_info()["size"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = p.parse_args()
    dt.init_parallel_env()
    number, repeat, steps = (200, 3, 6) if args.quick else (2000, 7, 30)
    result = {"world_size": dt.get_world_size(), "ops": bench_ops(number, repeat),
              "mlp_step": {
                  "train_py_shape": bench_mlp(Sizes(16, 16, 32, 8), steps),
                  "larger": bench_mlp(Sizes(256, 256, 512, 64), steps),
                  "compute_bound": bench_mlp(Sizes(1024, 1024, 2048, 256), max(steps // 3, 4))}}
    if dt.get_rank() == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
