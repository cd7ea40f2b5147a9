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
  ``loss_max_rel_diff`` checks that both compute the same losses;
* ``vs_dtensor`` (where torch is installed; ``torch_note`` otherwise): PyTorch DTensor's side
  of per-op ``add`` on the same sharded [64, 64] float32 tensors (rank 0 timed, as ``ops``)
  and of a two-layer tensor-parallel MLP training step on a 1-d mesh of all ranks
  (column-parallel [d, 4d] then row-parallel [4d, d] weights, float32, batch 64, relu,
  mean-square loss, SGD; DTensor's ``ColwiseParallel``/``RowwiseParallel`` over gloo) at
  d = 16 (dispatch-bound) and d = 256 (kernel-bound), with ``ratio`` = ours / DTensor
  (targets: add <= 0.3, step <= 0.5).
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

from gpt import _free_port  # noqa: E402
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


def _torch_dist():
    """torch and torch.distributed with gloo over the MPI launcher's ranks, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    torch.set_num_threads(1)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        comm = MPI.COMM_WORLD
        os.environ.setdefault("MASTER_PORT", str(comm.bcast(_free_port() if comm.rank == 0
                                                            else None)))
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    return torch


def _step_times(step, steps: int) -> float:
    """Median wall seconds of ``step()`` over ``steps`` calls, all ranks in step."""
    comm = MPI.COMM_WORLD
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = np.empty(len(times))
    comm.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return float(np.median(slowest))


def bench_vs_dtensor(number: int, repeat: int, steps: int) -> dict:
    """Per-op add and a two-layer TP MLP step, ours against PyTorch DTensor (see the module
    docstring)."""
    torch = _torch_dist()
    if torch is None:
        return {"torch_note": "torch not installed: no DTensor column"}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor
    world = dt.get_world_size()
    tmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("mp",))
    mesh = dt.ProcessMesh(list(range(world)), dim_names=["mp"])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    x, y = dt.shard_tensor(a, mesh, [Shard(0)]), dt.shard_tensor(a, mesh, [Shard(0)])
    tx = distribute_tensor(torch.from_numpy(a), tmesh, [TShard(0)])
    ty = distribute_tensor(torch.from_numpy(a), tmesh, [TShard(0)])

    def per_op() -> dict:
        ours = _median_time(lambda: dt.add(x, y), number, repeat)
        theirs = _median_time(lambda: tx + ty, number, repeat)
        return {"ours_us": round(ours * 1e6, 2), "dtensor_us": round(theirs * 1e6, 2),
                "ratio": round(ours / theirs, 3)}
    add = _sleep_until_rank0_done(per_op)
    return {"add": add, "tp_mlp_step": {f"d{d}": _tp_mlp_steps(torch, tmesh, mesh, d, steps)
                                        for d in (16, 256)}}


def _tp_mlp_steps(torch, tmesh, mesh, d: int, steps: int) -> dict:
    """The two-layer TP MLP step, ours and DTensor's (see the module docstring)."""
    from torch import nn
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    rng = np.random.default_rng(d)
    h, batch, lr = 4 * d, 64, 0.01
    W1, W2 = (rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((d, h), (h, d)))
    X = rng.standard_normal((batch, d)).astype(np.float32)
    w1 = dt.shard_tensor(W1, mesh, [Shard(1)], stop_gradient=False)
    w2 = dt.shard_tensor(W2, mesh, [Shard(0)], stop_gradient=False)
    xs = dt.shard_tensor(X, mesh, [dt.Replicate()])
    opt = dt.optimizer.SGD(learning_rate=lr, parameters=[w1, w2])

    def ours_step():
        out = dt.matmul(dt.relu(dt.matmul(xs, w1)), w2)
        loss = (out * out).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss
    model = nn.Sequential(nn.Linear(d, h, bias=False), nn.ReLU(), nn.Linear(h, d, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(W1.T.copy()))
        model[2].weight.copy_(torch.from_numpy(W2.T.copy()))
    parallelize_module(model, tmesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    topt = torch.optim.SGD(model.parameters(), lr=lr)
    tX = torch.from_numpy(X)

    def torch_step():
        out = model(tX)
        loss = (out * out).mean()
        loss.backward()
        topt.step()
        topt.zero_grad(set_to_none=True)
        return loss
    first_ours, first_torch = float(ours_step().numpy()), float(torch_step())
    loss_diff = abs(first_ours - first_torch) / abs(first_torch)
    t_ours, t_torch = _step_times(ours_step, steps), _step_times(torch_step, steps)
    return {"ours_ms": round(t_ours * 1e3, 3), "dtensor_ms": round(t_torch * 1e3, 3),
            "ratio": round(t_ours / t_torch, 3), "first_loss_rel_diff": float(loss_diff)}


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
                  "compute_bound": bench_mlp(Sizes(1024, 1024, 2048, 256), max(steps // 3, 4))},
              "vs_dtensor": bench_vs_dtensor(number, repeat, steps)}
    if dt.get_rank() == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
