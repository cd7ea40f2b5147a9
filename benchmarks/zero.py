"""ZeRO memory and step time per stage, and bucketed vs per-parameter gradient sync.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/zero.py [--width 512] [--reps 5]

An MLP of four ``Linear(width, width)`` layers (float32, AdamW, data parallel on a "dp" mesh of
the first N ranks, N = 1, 2, 4 up to the world size) trains one step per repetition at ZeRO
stages 0-3 (``shard_optimizer`` with ``ShardingStage1/2/3``). For each (N, stage), measured on
the rank holding the most:

* ``bytes``: parameters, gradients (after backward) and optimizer states (AdamW's moments and
  beta powers) held by one rank;
* ``paper``: the ZeRO paper's accounting for Ψ parameters on N ranks — parameters 4Ψ, gradients
  4Ψ, moments 8Ψ; stage 0: 16Ψ, stage 1: 8Ψ + 8Ψ/N, stage 2: 4Ψ + 12Ψ/N, stage 3: 16Ψ/N —
  with Ψ/N taken per tensor as its largest piece (uneven splits rounded up);
* ``ratio_to_paper`` per kind and ``total_ratio_to_paper`` (target within 1 ± 0.05) and
  ``step_ms`` (median, slowest rank; the four stages' steps interleaved) with
  ``step_ratio_to_stage0``. Ranks outside a smaller mesh wait in a barrier, which on an
  oversubscribed machine takes CPU from the ones working.

``grad_sync``: backward (where the sync runs) and whole-step times, medians, of one
data-parallel model on every rank with 25 MB gradient buckets against one all-reduce per
parameter (``grad_sync.set_bucket_bytes(0)``), alternating step by step so the machine's noise
hits both alike, and the all-reduces each backward issues.
Rank 0 prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives  # noqa: E402
import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor import Shard, grad_sync, nn  # noqa: E402
from spmd_rules import local_shape  # noqa: E402

STAGES = (None, dt.ShardingStage1, dt.ShardingStage2, dt.ShardingStage3)


class MLP(nn.Layer):
    def __init__(self, width: int, depth: int = 4):
        super().__init__()
        self.layers = nn.LayerList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


def _local_bytes(t) -> int:
    if t is None:
        return 0
    return int(t._value.local.array.nbytes if t.is_dist() else t._value.array.nbytes)


def _max_piece(shape, attr, mesh) -> int:
    """Elements of the largest piece of a tensor laid out as ``attr`` (uneven: rounded up)."""
    return max(int(np.prod(local_shape(shape, attr, mesh.get_coord(r)), dtype=np.int64))
               for r in mesh.process_ids)


def _paper(model, mesh, stage: int) -> dict:
    """The ZeRO accounting for float32 AdamW, Ψ/N per tensor as its largest dp piece."""
    psi, psi_n = 0, 0
    for p in model.parameters():
        v = p._value
        psi += p.size
        psi_n += _max_piece(tuple(v.shape),
                            dt.parallel.sharding.dp_layout(tuple(v.shape), v.dist_attr, 0), mesh)
    return {"params": 4 * (psi_n if stage >= 3 else psi),
            "grads": 4 * (psi_n if stage >= 2 else psi),
            "states": 8 * (psi_n if stage >= 1 else psi)}


def _stages(world, n: int, args) -> dict:
    """Stages 0-3 on a "dp" mesh of the first ``n`` ranks: one model and optimizer each, their
    steps interleaved round-robin (the machine's noise hits every stage alike)."""
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["dp"])
    rng = np.random.default_rng(1)
    x, y = (dt.shard_tensor(rng.standard_normal((args.batch, args.width)).astype(np.float32),
                            mesh, [Shard(0)]) for _ in range(2))
    runs = []
    for stage in range(4):
        dt.seed(0)
        model = MLP(args.width)
        dt.shard_layer(model, mesh)
        opt = dt.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        if stage:
            opt = dt.shard_optimizer(opt, STAGES[stage]("dp", mesh))
        runs.append({"model": model, "opt": opt, "times": [], "held": None})
    for rep in range(args.reps + 1):
        for r in runs:
            world.barrier()
            t0 = time.perf_counter()
            loss = F.mse_loss(r["model"](x), y)
            loss.backward()
            if r["held"] is None:
                r["held"] = [sum(_local_bytes(p) for p in r["model"].parameters()),
                             sum(_local_bytes(p.grad) for p in r["model"].parameters())]
            r["opt"].step()
            r["opt"].clear_grad(set_to_zero=False)
            elapsed = np.array([time.perf_counter() - t0])
            if rep:  # the first step creates the optimizer states
                r["times"].append(float(world.all_reduce(elapsed, "max")[0]))
    out = {}
    for stage, r in enumerate(runs):
        held = r["held"] + [sum(_local_bytes(t) for t in r["opt"].state_dict().values())]
        held = world.all_reduce(np.array(held, dtype=np.int64), "max").tolist()
        paper = _paper(r["model"], mesh, stage)
        out[f"stage{stage}"] = {
            "bytes": dict(zip(("params", "grads", "states"), held)), "paper": paper,
            "ratio_to_paper": {k: round(held[i] / paper[k], 4) for i, k in enumerate(paper)},
            "total_ratio_to_paper": round(sum(held) / sum(paper.values()), 4),
            "step_ms": 1e3 * statistics.median(r["times"])}
    base = out["stage0"]["step_ms"]
    for r in out.values():
        r["step_ratio_to_stage0"] = round(r["step_ms"] / base, 3)
    return out


def _sync(world, args, steps: int = 30) -> dict:
    """Backward (where the sync runs) and whole-step times of one data-parallel model on all
    ranks, alternating 25 MB buckets and one all-reduce per parameter step by step."""
    n = world.size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["dp"])
    dt.seed(0)
    model = MLP(args.width)
    dt.shard_layer(model, mesh)
    opt = dt.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    x = dt.shard_tensor(np.random.default_rng(1).standard_normal(
        (args.batch, args.width)).astype(np.float32), mesh, [Shard(0)])
    times: dict = {"bucketed": ([], []), "per_parameter": ([], [])}
    counts = {}
    for step in range(steps + 2):
        kind = "bucketed" if step % 2 else "per_parameter"
        grad_sync.set_bucket_bytes(25 * 2 ** 20 if kind == "bucketed" else 0)
        world.barrier()
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), x)
        t1 = time.perf_counter()
        before = collectives.collective_counts()["all_reduce"]
        loss.backward()
        t2 = time.perf_counter()
        counts[kind] = collectives.collective_counts()["all_reduce"] - before
        opt.step()
        opt.clear_grad(set_to_zero=False)
        t3 = time.perf_counter()
        spans = world.all_reduce(np.array([t2 - t1, t3 - t0]), "max")
        if step >= 2:  # the first two create states and plans
            times[kind][0].append(float(spans[0]))
            times[kind][1].append(float(spans[1]))
    grad_sync.set_bucket_bytes(25 * 2 ** 20)
    out = {"dp": n, "bucket_mb": 25}
    for kind, (bwd, whole) in times.items():
        out[kind] = {"backward_ms": 1e3 * statistics.median(bwd),
                     "step_ms": 1e3 * statistics.median(whole),
                     "all_reduces_in_backward": counts[kind]}
    out["backward_ratio_bucketed_to_per_parameter"] = round(
        out["bucketed"]["backward_ms"] / out["per_parameter"]["backward_ms"], 3)
    out["step_ratio_bucketed_to_per_parameter"] = round(
        out["bucketed"]["step_ms"] / out["per_parameter"]["step_ms"], 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    world = collectives.init()
    result: dict = {"world": world.size, "width": args.width, "batch": args.batch,
                    "zero": {}, "grad_sync": {}}
    for n in (1, 2, 4):
        if n <= world.size:
            result["zero"][f"dp{n}"] = _stages(world, n, args)
    result["grad_sync"] = _sync(world, args)
    if world.rank == 0:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
