"""Kernel micro-benchmark: the registered numpy kernels against the kernels they replaced
("before", kept here only) and PyTorch's CPU kernels (when torch is installed), in one run.

    python benchmarks/kernels.py [--rounds 7] [--quick]

For gelu (tanh approximation, as train.py's GPT uses, and exact) and its gradient, layer_norm and
softmax forward and backward at [64, 64] and [1024, 1024] float32, relu_ (in place) and its
gradient, the fused
AdamW update (4.2M parameters), and the batched linear (x [8, 32, d] @ w [d, 4d]: forward and
weight gradient at d = 512 and 1024): the median time per call over ``rounds`` rounds (each round
the mean of enough calls to take ~20 ms), rounds of the three interleaved. Prints JSON with, per
clock (``cpu``: thread CPU time, what the targets are judged on; ``wall``), ``before_us``,
``after_us`` (the registered kernel: compiled when numba is installed, see disttensor.ops.fast),
``numpy_us`` (with compiled kernels: the numpy kernel they replace), ``torch_us`` and the ratios
``after_over_before``, ``after_over_numpy`` and ``after_over_torch`` (the target for the
elementwise/normalization kernels: <= 1.3; benchmarks/ops.py reports those rows).

Single-threaded: OMP/OpenBLAS/MKL threads and torch's intra-op threads are set to 1, so every
column does the same work on one core.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from disttensor.ops import fast  # noqa: E402
from disttensor.schema import OPS  # noqa: E402

try:  # optional: the PyTorch column
    import torch
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


# -- the kernels as they were before (the baseline; not used by the library) ---------------------

def _before_gelu(x, approximate):
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x ** 3)))
    from scipy.special import erf
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _before_gelu_grad(x, g, approximate):
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x))
    from scipy.special import erf
    cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))
    return g * (cdf + x / math.sqrt(2.0 * math.pi) * np.exp(-0.5 * x * x))


def _before_layer_norm(x, w, b, eps=1e-5):
    mean = np.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + eps)
    out = xc * rstd * w + b
    return out.astype(x.dtype, copy=False), mean[..., 0], rstd[..., 0]


def _before_layer_norm_grad(x, w, mean, rstd, dout):
    mean, rstd = mean[:, None], rstd[:, None]
    xhat = (x - mean) * rstd
    dxhat = dout * w
    dx = rstd * (dxhat - np.mean(dxhat, axis=-1, keepdims=True)
                 - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype, copy=False), np.sum(dout * xhat, axis=0), np.sum(dout, axis=0)


def _before_softmax(x):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _before_softmax_grad(y, g):
    return y * (g - np.sum(g * y, axis=-1, keepdims=True))


def _before_adam(p, g, m, v, lr, b1, b2, eps, wd, t):
    lr_t = lr / (1.0 - b1 ** t)
    c2 = 1.0 / (1.0 - b2 ** t) ** 0.5
    p *= 1.0 - lr * wd
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    p -= lr_t * m / (np.sqrt(v) * c2 + eps)


def _before_weight_grad(x, g):
    return np.matmul(np.swapaxes(x, -1, -2), g).sum(axis=0)


# -- timing -------------------------------------------------------------------------------------

def _calls_for(fn, budget_s: float = 0.02) -> int:
    fn()
    t0 = time.thread_time()
    fn()
    one = max(time.thread_time() - t0, 1e-7)
    return max(1, min(2000, int(budget_s / one)))


def _time(fns: dict, rounds: int) -> dict:
    """Median seconds per call of each function on two clocks (``cpu``: this thread's CPU
    time, which a busy shared machine disturbs far less; ``wall``), rounds interleaved."""
    calls = {k: _calls_for(f) for k, f in fns.items()}
    times: dict = {(c, k): [] for k in fns for c in ("cpu", "wall")}
    for _ in range(rounds):
        for k, f in fns.items():
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(calls[k]):
                f()
            times["cpu", k].append((time.thread_time() - c0) / calls[k])
            times["wall", k].append((time.perf_counter() - w0) / calls[k])
    return {c: {k: statistics.median(times[c, k]) for k in fns} for c in ("cpu", "wall")}


def _entry(t: dict) -> dict:
    """Times in microseconds and the ratios, per clock (the targets are judged on ``cpu``)."""
    out = {}
    for clock, tc in t.items():
        e = {f"{k}_us": round(v * 1e6, 2) for k, v in tc.items()}
        if "before" in tc:
            e["after_over_before"] = round(tc["after"] / tc["before"], 3)
        if "torch" in tc:
            e["after_over_torch"] = round(tc["after"] / tc["torch"], 3)
        if "numpy" in tc:
            e["after_over_numpy"] = round(tc["after"] / tc["numpy"], 3)
        out[clock] = e
    return out


def _cases(shape, rng):
    """name -> {"before": fn, "after": fn, "torch": fn} for the elementwise/normalization
    kernels at ``shape`` (float32)."""
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    n = shape[-1]
    w = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    k = {name: OPS[name].kernel for name in ("gelu", "gelu_grad", "layer_norm",
                                              "layer_norm_grad", "softmax", "softmax_grad",
                                              "relu", "relu_grad")}
    _, mean, rstd = k["layer_norm"](np, x, w, b, begin_norm_axis=1, epsilon=1e-5)
    y = k["softmax"](np, x, axis=1)
    relu_buf = x.copy()
    relu_y = np.maximum(x, 0)  # relu's output, which its gradient reads
    cases = {
        "gelu_tanh": {"before": lambda: _before_gelu(x, True),
                      "after": lambda: k["gelu"](np, x, approximate=True)},
        "gelu_tanh_grad": {"before": lambda: _before_gelu_grad(x, g, True),
                           "after": lambda: k["gelu_grad"](np, x, g, approximate=True)},
        "gelu_exact": {"before": lambda: _before_gelu(x, False),
                       "after": lambda: k["gelu"](np, x, approximate=False)},
        "gelu_exact_grad": {"before": lambda: _before_gelu_grad(x, g, False),
                            "after": lambda: k["gelu_grad"](np, x, g, approximate=False)},
        "layer_norm": {"before": lambda: _before_layer_norm(x, w, b),
                       "after": lambda: k["layer_norm"](np, x, w, b, begin_norm_axis=1,
                                                        epsilon=1e-5)},
        "layer_norm_grad": {"before": lambda: _before_layer_norm_grad(x, w, mean, rstd, g),
                            "after": lambda: k["layer_norm_grad"](np, x, w, mean, rstd, g,
                                                                  begin_norm_axis=1,
                                                                  epsilon=1e-5)},
        "softmax": {"before": lambda: _before_softmax(x),
                    "after": lambda: k["softmax"](np, x, axis=1)},
        "softmax_grad": {"before": lambda: _before_softmax_grad(y, g),
                         "after": lambda: k["softmax_grad"](np, y, g, axis=1)},
        # relu_: the result written into x itself (the inplace variant's out= call)
        "relu_": {"before": lambda: relu_buf.__setitem__(Ellipsis, np.maximum(relu_buf, 0)),
                  "after": lambda: k["relu"](np, relu_buf, out=relu_buf)},
        "relu_grad": {"before": lambda: g * (relu_y > 0),
                      "after": lambda: k["relu_grad"](np, relu_y, g)},
    }
    # with compiled kernels (disttensor.ops.fast): the numpy kernels they replace, as "numpy"
    if fast.BACKEND == "numba":
        numpy_k = {name: inspect.unwrap(f) for name, f in k.items()}
        cases["layer_norm"]["numpy"] = lambda: numpy_k["layer_norm"](
            np, x, w, b, begin_norm_axis=1, epsilon=1e-5)
        cases["layer_norm_grad"]["numpy"] = lambda: numpy_k["layer_norm_grad"](
            np, x, w, mean, rstd, g, begin_norm_axis=1, epsilon=1e-5)
        cases["softmax"]["numpy"] = lambda: numpy_k["softmax"](np, x, axis=1)
        cases["softmax_grad"]["numpy"] = lambda: numpy_k["softmax_grad"](np, y, g, axis=1)
        cases["relu_"]["numpy"] = lambda: numpy_k["relu"](np, relu_buf, out=relu_buf)
        cases["relu_grad"]["numpy"] = lambda: numpy_k["relu_grad"](np, relu_y, g)
        for name in ("gelu_tanh", "gelu_exact"):
            approx = name == "gelu_tanh"
            cases[name]["numpy"] = lambda a=approx: numpy_k["gelu"](np, x, approximate=a)
            cases[f"{name}_grad"]["numpy"] = lambda a=approx: numpy_k["gelu_grad"](
                np, x, g, approximate=a)
    if torch is not None:
        tx, tg, tw, tb = (torch.from_numpy(a) for a in (x, g, w, b))
        _, tmean, trstd = torch.ops.aten.native_layer_norm(tx, (n,), tw, tb, 1e-5)
        ty = torch.softmax(tx, -1)
        trelu = tx.clone()
        trelu_y = torch.from_numpy(relu_y)
        fn = torch.nn.functional
        torch_fns = {
            "gelu_tanh": lambda: fn.gelu(tx, approximate="tanh"),
            "gelu_tanh_grad": lambda: torch.ops.aten.gelu_backward(tg, tx, approximate="tanh"),
            "gelu_exact": lambda: fn.gelu(tx),
            "gelu_exact_grad": lambda: torch.ops.aten.gelu_backward(tg, tx),
            "layer_norm": lambda: torch.ops.aten.native_layer_norm(tx, (n,), tw, tb, 1e-5),
            "layer_norm_grad": lambda: torch.ops.aten.native_layer_norm_backward(
                tg, tx, (n,), tmean, trstd, tw, tb, [True, True, True]),
            "softmax": lambda: torch.softmax(tx, -1),
            "softmax_grad": lambda: torch.ops.aten._softmax_backward_data(
                tg, ty, -1, torch.float32),
            "relu_": lambda: trelu.relu_(),
            "relu_grad": lambda: torch.ops.aten.threshold_backward(tg, trelu_y, 0.0),
        }
        for name, f in torch_fns.items():
            cases[name]["torch"] = f
    return cases


def _adam_case(rng, numel: int) -> dict:
    p = rng.standard_normal(numel).astype(np.float32)
    g = rng.standard_normal(numel).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    pb, mb, vb = p.copy(), m.copy(), v.copy()
    b1p, b2p = np.array([1.0], np.float32), np.array([1.0], np.float32)
    lr = np.array(1e-3, np.float32)
    kernel = OPS["adam_update"].kernel
    fns = {"before": lambda: _before_adam(pb, g, mb, vb, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3),
           "after": lambda: kernel(np, p, g, m, v, b1p, b2p, lr, beta1=0.9, beta2=0.999,
                                   epsilon=1e-8, l2=0.0, weight_decay=0.01, lr_scale=1.0)}
    if torch is not None:
        tp = torch.from_numpy(p.copy())
        tp.grad = torch.from_numpy(g)
        opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, foreach=False)
        fns["torch"] = opt.step
    return fns


def _linear_cases(rng, d: int) -> dict:
    """x [8, 32, d] @ w [d, 4d]: the forward, and the weight gradient x^T g summed over the
    batch (before: per-sample GEMMs into [8, d, 4d] then a sum; after: the matmul backward's
    folded GEMM, as the registered kernel runs it)."""
    x = rng.standard_normal((8, 32, d)).astype(np.float32)
    w = rng.standard_normal((d, 4 * d)).astype(np.float32)
    g = rng.standard_normal((8, 32, 4 * d)).astype(np.float32)
    mm = OPS["matmul"].kernel
    fwd = {"before": lambda: np.matmul(x, w), "after": lambda: mm(np, x, w)}
    wgrad = {"before": lambda: _before_weight_grad(x, g),
             "after": lambda: mm(np, x.reshape(-1, d), g.reshape(-1, 4 * d), transpose_x=True)}
    if torch is not None:
        tx, tw, tg = (torch.from_numpy(a) for a in (x, w, g))
        fwd["torch"] = lambda: torch.matmul(tx, tw)
        wgrad["torch"] = lambda: tx.reshape(-1, d).t() @ tg.reshape(-1, 4 * d)
    return {f"linear_forward_d{d}": fwd, f"linear_weight_grad_d{d}": wgrad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 rounds, smaller AdamW")
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    results: dict = {}
    for shape in ((64, 64), (1024, 1024)):
        for name, fns in _cases(shape, rng).items():
            results.setdefault(name, {})[f"{shape[0]}x{shape[1]}"] = _entry(_time(fns, rounds))
    numel = 1 << 20 if args.quick else 4_200_000
    results["adamw"] = {str(numel): _entry(_time(_adam_case(rng, numel), rounds))}
    for d in (512, 1024):
        for name, fns in _linear_cases(rng, d).items():
            results[name] = _entry(_time(fns, rounds))
    print(json.dumps({
        "benchmark": "kernels", "dtype": "float32", "threads": 1, "rounds": rounds,
        "kernels": fast.BACKEND,
        "numpy": np.__version__, "torch": None if torch is None else torch.__version__,
        "note": None if torch is not None else "torch not installed: no torch column",
        "before": {"relu_": "np.maximum out of place, then copied into x (the target's "
                             "description; relu_ already wrote through out= at this branch's "
                             "base)",
                   "others": "the kernels replaced in this change, kept in this file"},
        "results": results}, indent=1))


if __name__ == "__main__":
    main()
