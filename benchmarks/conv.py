"""conv2d forward + backward against PyTorch's CPU convolution, in one process with the same
number of threads; and a spatially sharded ResNet step against a data-parallel one.

    OMP_NUM_THREADS=1 python benchmarks/conv.py [--quick] [--threads 1]
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/conv.py --resnet [--quick]

Prints JSON (rank 0). ``--resnet``: examples/resnet.py's model at the same global batch with
the batch sharded over the ranks (data parallel) and with the images' H sharded (spatial):
the median step time and, per rank, the peak bytes numpy allocated during one step beyond
what was live before it (tracemalloc: activations, gradients, temporaries), the largest over
the ranks. Without ``--resnet``: for each case (default ``[32, 64, 56, 56]`` float32, 64 output
channels, 3x3, padding 1; ``--quick``: batch 4) the median times in ms of disttensor's forward,
backward (``dt.autograd.backward`` with a given output gradient: the input and weight gradients) and
their sum, the same for ``torch.nn.functional.conv2d``, and ``ratio`` = disttensor / torch
(target <= 1.5). Each side is timed alternately, ``--repeat`` times, after one warm-up run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import disttensor as dt  # noqa: E402


def _dt_step(x, w, g):
    xt = dt.to_tensor(x, stop_gradient=False)
    wt = dt.to_tensor(w, stop_gradient=False)
    t0 = time.perf_counter()
    y = dt.nn.functional.conv2d(xt, wt, padding=1)
    t1 = time.perf_counter()
    dt.autograd.backward([y], [dt.to_tensor(g)])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def _torch_step(torch, x, w, g):
    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(w).requires_grad_()
    gt = torch.from_numpy(g)
    t0 = time.perf_counter()
    y = torch.nn.functional.conv2d(xt, wt, padding=1)
    t1 = time.perf_counter()
    y.backward(gt)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def bench(shape, out_channels: int, repeat: int) -> dict:
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    n, c, h, w_ = shape
    x = rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal((out_channels, c, 3, 3), dtype=np.float32) * 0.1
    g = rng.standard_normal((n, out_channels, h, w_), dtype=np.float32)
    sides = {"disttensor": lambda: _dt_step(x, w, g)}
    if torch is not None:
        sides["torch"] = lambda: _torch_step(torch, x, w, g)
    times: dict = {k: [] for k in sides}
    for k, fn in sides.items():  # warm-up
        fn()
    for _ in range(repeat):
        for k, fn in sides.items():
            times[k].append(fn())
    res: dict = {"shape": list(shape), "out_channels": out_channels, "kernel": [3, 3]}
    for k, ts in times.items():
        fwd = float(np.median([t[0] for t in ts])) * 1e3
        bwd = float(np.median([t[1] for t in ts])) * 1e3
        res[k] = {"forward_ms": round(fwd, 2), "backward_ms": round(bwd, 2),
                  "total_ms": round(fwd + bwd, 2)}
    if torch is not None:
        res["ratio"] = round(res["disttensor"]["total_ms"] / res["torch"]["total_ms"], 3)
        res["ratio_forward"] = round(res["disttensor"]["forward_ms"] /
                                     res["torch"]["forward_ms"], 3)
        res["ratio_backward"] = round(res["disttensor"]["backward_ms"] /
                                      res["torch"]["backward_ms"], 3)
    else:
        res["ratio"] = None
        res["note"] = "torch is not importable: no baseline"
    return res


def bench_resnet(quick: bool, steps: int) -> dict:
    import tracemalloc
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    import resnet
    world = dt.get_world_size()
    size = 64 if quick else 128
    argv = ["--width", "8", "--image-size", str(size), "--batch", str(2 * world),
            "--steps", "1", "--log-interval", "1000000"]
    out = {"world": world, "image_size": size, "global_batch": 2 * world}
    for name, extra in (("data_parallel", []), ("spatial", ["--spatial"])):
        ns = resnet.parse_args(argv + extra)
        mesh = dt.ProcessMesh(list(range(world)), dim_names=["h" if ns.spatial else "dp"])
        model, opt, batches = resnet.build(ns, mesh)

        def step(x, y):
            loss = dt.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            return loss
        x, y = resnet.to_tensors(*batches[0], mesh, ns.spatial)
        step(x, y).numpy()  # warm-up (optimizer states)
        times = []
        for _ in range(steps):
            dt.barrier()
            t0 = time.perf_counter()
            step(x, y).numpy()
            times.append(time.perf_counter() - t0)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        step(x, y).numpy()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        peaks = _comm().allgather(peak)
        out[name] = {"step_ms": round(float(np.median(times)) * 1e3, 1),
                     "peak_step_bytes_max_rank": int(max(peaks)),
                     "peak_step_bytes_per_rank": [int(p) for p in peaks]}
    out["memory_ratio_spatial_to_dp"] = round(out["spatial"]["peak_step_bytes_max_rank"] /
                                              out["data_parallel"]["peak_step_bytes_max_rank"],
                                              3)
    out["time_ratio_spatial_to_dp"] = round(out["spatial"]["step_ms"] /
                                            out["data_parallel"]["step_ms"], 3)
    return out


def _comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 4 instead of 32")
    p.add_argument("--threads", type=int, default=1, help="threads for both sides")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--resnet", action="store_true",
                   help="spatial against data-parallel ResNet steps (run under mpiexec)")
    args = p.parse_args(argv)
    if args.resnet:
        dt.init_parallel_env()
        out = {"resnet": bench_resnet(args.quick, args.repeat)}
        if dt.get_rank() == 0:
            print(json.dumps(out, indent=1))
        return out
    try:
        import torch
        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    shape = (4 if args.quick else 32, 64, 56, 56)
    out = {"threads": args.threads, "conv2d": bench(shape, 64, args.repeat)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
