"""Per-op dispatch overhead of dense ops against the raw numpy call, and the kernels of
softmax, layer_norm, relu_, gelu and their gradients against PyTorch's CPU kernels, in one run.

    python benchmarks/ops.py [--repeats 2000] [--rounds 7] [--kernel-rounds 7]

For ``add``, ``matmul`` and ``relu`` on [64, 64] float32 tensors, prints JSON with, per op and
per mode (``no_grad_recording``: inputs with stop_gradient=True; ``grad_recording``: one input
with stop_gradient=False, so a grad node is recorded): the time per call of the disttensor op
and of the numpy call (median over rounds of the mean over ``repeats`` calls, after warm-up;
op and numpy rounds interleaved), their difference in microseconds and their ratio.

Kernels (``kernels``): at [64, 64] and [1024, 1024] float32, the registered kernel
(``disttensor_us``: compiled by numba when installed, see disttensor.ops.fast; ``numpy_us``: the
numpy kernel it replaces, when compiled) against PyTorch's CPU kernel (``torch_us``, when torch is
installed: extra ``bench``) as benchmarks/kernels.py times them (rounds interleaved), with
``over_torch`` and ``within_target`` (<= 1.3). One thread each: OMP/OpenBLAS/MKL
threads 1, ``torch.set_num_threads(1)``, and the compiled loops are single-threaded — as ranks
run (``OMP_NUM_THREADS=1``).

Two clocks: ``wall`` (perf_counter) and ``cpu`` (this thread's CPU time, which a busy shared
machine disturbs far less); the targets are judged on ``cpu``. Single-threaded BLAS is requested
so that the thread clock sees all of numpy's work.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402  (benchmarks/kernels.py, beside this script: cases and timing)

import disttensor as dt  # noqa: E402
from disttensor.ops import fast  # noqa: E402

TARGET_US = {"no_grad_recording": 3.0, "grad_recording": 6.0}
KERNEL_TARGET = 1.3  # kernel time over PyTorch's
KERNEL_ROWS = ("softmax", "softmax_grad", "layer_norm", "layer_norm_grad", "relu_", "relu_grad",
               "gelu_tanh", "gelu_tanh_grad", "gelu_exact", "gelu_exact_grad")


def _time_pair(fn_op, fn_np, repeats: int, rounds: int, clock) -> tuple[float, float]:
    """Median seconds per call of ``fn_op`` and ``fn_np``, rounds interleaved."""
    for _ in range(max(repeats // 10, 10)):  # warm-up
        fn_op()
        fn_np()
    t_op, t_np = [], []
    for _ in range(rounds):
        for fn, out in ((fn_op, t_op), (fn_np, t_np)):
            t0 = clock()
            for _ in range(repeats):
                fn()
            out.append((clock() - t0) / repeats)
    return statistics.median(t_op), statistics.median(t_np)


def kernel_rows(rounds: int) -> dict:
    """name -> shape -> per clock the kernel times and ratios (see the module docstring)."""
    rng = np.random.default_rng(0)
    rows: dict = {}
    for shape in ((64, 64), (1024, 1024)):
        cases = kernels._cases(shape, rng)
        for name in KERNEL_ROWS:
            fns = {"disttensor": cases[name]["after"]}
            fns.update((k, f) for k, f in cases[name].items() if k in ("numpy", "torch"))
            entry: dict = {}
            for clock, t in kernels._time(fns, rounds).items():
                e = {f"{k}_us": round(v * 1e6, 2) for k, v in t.items()}
                if "torch" in t:
                    e["over_torch"] = round(t["disttensor"] / t["torch"], 3)
                entry[clock] = e
            if "torch" in fns:
                entry["within_target"] = entry["cpu"]["over_torch"] <= KERNEL_TARGET
            rows.setdefault(name, {})[f"{shape[0]}x{shape[1]}"] = entry
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel-rounds", type=int, default=7)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    raw = {"add": lambda: np.add(a, b), "matmul": lambda: np.matmul(a, b),
           "relu": lambda: np.maximum(a, 0).astype(a.dtype, copy=False)}
    results = {}
    for mode in ("no_grad_recording", "grad_recording"):
        x = dt.to_tensor(a, stop_gradient=(mode == "no_grad_recording"))
        y = dt.to_tensor(b)
        ops = {"add": lambda: dt.add(x, y), "matmul": lambda: dt.matmul(x, y),
               "relu": lambda: dt.nn.functional.relu(x)}
        for name in ops:
            entry = {}
            for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.thread_time)):
                t_op, t_np = _time_pair(ops[name], raw[name], args.repeats, args.rounds, clock)
                entry[clock_name] = {"disttensor_us": round(t_op * 1e6, 3),
                                     "numpy_us": round(t_np * 1e6, 3),
                                     "overhead_us": round((t_op - t_np) * 1e6, 3),
                                     "ratio": round(t_op / t_np, 3)}
            entry["target_overhead_us"] = TARGET_US[mode]
            entry["within_target"] = entry["cpu"]["overhead_us"] <= TARGET_US[mode]
            results.setdefault(name, {})[mode] = entry
    torch = kernels.torch
    print(json.dumps({"benchmark": "dense_dispatch_overhead", "shape": [64, 64],
                      "dtype": "float32", "repeats": args.repeats, "rounds": args.rounds,
                      "python": sys.version.split()[0], "numpy": np.__version__,
                      "results": results,
                      "kernels": {
                          "compiled": fast.BACKEND, "dtype": "float32", "threads": 1,
                          "torch": None if torch is None else torch.__version__,
                          "torch_threads": None if torch is None else torch.get_num_threads(),
                          "target_over_torch": KERNEL_TARGET, "rounds": args.kernel_rounds,
                          "results": kernel_rows(args.kernel_rounds)}}, indent=2))


if __name__ == "__main__":
    main()
