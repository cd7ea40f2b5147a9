"""Mixed precision: train.py's GPT step in float32 against O1 and O2 autocast, time and memory.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/amp.py [--quick] [--size large]
    python benchmarks/amp.py --device gpu --amp-dtype float16       # on a GPU (cupy)

Prints JSON on rank 0: per mode (``fp32``, ``O1``, ``O2``) the median step time over the
timed steps (``step_ms``, eager, modes timed in turn step by step), the most bytes any rank
allocates at once during one step above what it held before (``peak_bytes``, tracemalloc: it
sees numpy's buffers; on a GPU cupy's pool high-water mark instead) and the bytes of the
model's parameters, optimizer states and masters (``state_bytes``); and the ratios
``O1_vs_fp32`` / ``O2_vs_fp32`` of each, measured in the same run. ``O1_per_rank`` and
``O2_per_rank`` run with ``dt.amp.set_round_after_reduction(False)`` (each rank rounds its
partial sums: no float32 saved inputs, weight gradients synced in the overlapped buckets).

On CPU numpy has no bfloat16 arithmetic: disttensor computes bfloat16 kernels in float32 and
rounds, so O1/O2 pay for their casts and gain nothing in speed there; the memory of the saved
low-precision activations and parameters is what shrinks. The speed of low precision is the
GPU's (tensor cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

from mpi4py import MPI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples")]

import train  # noqa: E402

import disttensor as dt  # noqa: E402
from disttensor.jit import peak_bytes  # noqa: E402

#: mode -> (amp level, partial sums rounded once after the reduction)
MODES = {"fp32": (None, True), "O1": ("O1", True), "O2": ("O2", True),
         "O1_per_rank": ("O1", False), "O2_per_rank": ("O2", False)}


def _max_over_ranks(x: float) -> float:
    return MPI.COMM_WORLD.allreduce(x, op=MPI.MAX)


def _state_bytes(model, opt) -> int:
    tensors = list(model.parameters()) + list(opt.state_dict().values())
    return sum(t._local_array().nbytes for t in tensors if isinstance(t, dt.Tensor))


def _gpu_peak(step, *args) -> int:
    import cupy
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    base = pool.used_bytes()
    high = base

    def run():
        nonlocal high
        res = step(*args)
        cupy.cuda.Device().synchronize()
        high = max(high, pool.total_bytes())
        return res
    run()
    return high - base


def bench(size: str, steps: int, warmup: int, amp_dtype: str, device: str) -> dict:
    mesh = None if dt.get_world_size() == 1 else train.default_mesh(dt.get_world_size())
    batch = 16 if size == "default" else 32
    runs = {}
    for mode, (level, once) in MODES.items():
        model, opt, batches = train.build("gpt", 3, mesh, batch=batch, size=size, device=device)
        args = SimpleNamespace(amp=level, amp_dtype=amp_dtype, to_static=False)
        model, opt, amp = train.amp_setup(args, model, opt)
        data = [train.to_tensors(*b, mesh, device) for b in batches]

        def step(x, y, model=model, opt=opt, amp=amp, once=once):
            prev = dt.amp.set_round_after_reduction(once)
            try:
                return float(train.train_step(model, opt, x, y, amp).numpy())
            finally:
                dt.amp.set_round_after_reduction(prev)
        for k in range(warmup):
            step(*data[k % 4])
        peak = _gpu_peak(step, *data[0]) if device == "gpu" else peak_bytes(step, *data[0])[1]
        runs[mode] = {"step": step, "data": data, "times": [], "peak": peak,
                      "state": _state_bytes(model, opt)}
    for k in range(steps):          # the modes in turn, step by step (same machine load)
        for mode, r in runs.items():
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            r["step"](*r["data"][k % 4])
            r["times"].append(_max_over_ranks(time.perf_counter() - t0))
    out: dict = {"size": size, "batch": batch, "amp_dtype": amp_dtype, "device": device,
                 "mesh": None if mesh is None else list(mesh.shape),
                 "world": dt.get_world_size()}
    for mode, r in runs.items():
        out[mode] = {"step_ms": round(statistics.median(r["times"]) * 1e3, 3),
                     "peak_bytes": int(_max_over_ranks(r["peak"])),
                     "state_bytes": int(_max_over_ranks(r["state"]))}
    for mode in [m for m in MODES if m != "fp32"]:
        out[f"{mode}_vs_fp32"] = {k: round(out[mode][k] / out["fp32"][k], 3)
                                  for k in ("step_ms", "peak_bytes", "state_bytes")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few steps (a smoke run)")
    p.add_argument("--size", default="large", choices=["default", "large"])
    p.add_argument("--amp-dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    args = p.parse_args()
    dt.init_parallel_env()
    steps, warmup = (3, 1) if args.quick else (15, 3)
    res = bench(args.size, steps, warmup, args.amp_dtype, args.device)
    if dt.get_rank() == 0:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
