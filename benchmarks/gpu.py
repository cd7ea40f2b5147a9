"""train.py's GPT training step on one GPU: disttensor on cupy (eager and captured) against the
same model in PyTorch on CUDA and against disttensor on the CPU, all in one run.

    python benchmarks/gpu.py [--sizes medium,large,xl] [--cpu-sizes medium,large]
                             [--steps 10] [--warmup 3]

Sizes as in ``benchmarks/gpt.py`` (vocab, seq, d, heads, layers, batch) plus ``xl`` (vocab
1024, seq 128, d 1024, 16 heads, 4 layers, batch 16), where the GPU's arithmetic starts to
matter. One process, float32 (no TF32 on either side: cupy's and torch's defaults). The runs take
turns step by step (``gpt._median_steps``); a step ends when its loss is read on the host, which
waits for the GPU. Prints one JSON object: per size the median ``step_ms`` of each run, the
ratios ``disttensor_gpu_vs_torch_cuda`` (< 1 is faster than torch), ``captured_gpu_vs_torch_cuda``
and ``gpu_speedup_over_cpu`` (the CPU run, one BLAS thread, only for ``--cpu-sizes``), and
``loss_max_rel_diff`` of each run against the first of CPU, torch (they start from the same
weights and see the same batches). Without cupy and a CUDA device it prints a note and
exits 0; the torch column is absent, with a note, without torch's CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (sets single-threaded BLAS, puts the repository and examples/ first)
import numpy as np  # noqa: E402

SIZES = {**gpt.SIZES, "xl": (1024, 128, 1024, 16, 4, 16)}


def _gpu_note() -> str | None:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, no driver, no device
        return f"no GPU run: cupy with a CUDA device is not available ({type(e).__name__})"
    return None


def _dt_step(cfg: tuple, device: str, captured: bool, params: dict):
    """(step(tokens, labels) -> loss, global weights by name) for disttensor on ``device``."""
    import train

    import disttensor as dt
    vocab, seq, d, heads, layers, _ = cfg
    dt.seed(2026)
    model = train.GPT(vocab, seq, d, heads, layers)
    if not params:
        params.update({n: t.numpy().copy() for n, t in model.named_parameters()})
    model.to(device=device)
    opt = dt.optimizer.AdamW(learning_rate=gpt.LR, parameters=model.parameters(),
                             weight_decay=gpt.WD)

    def step(x, y):
        return train.train_step(model, opt, x, y)
    run = dt.jit.to_static(step) if captured else step

    def timed(xb, yb):
        return float(run(*train.to_tensors(xb, yb, None, device)).numpy())
    return timed


def _own_batches(step, batches):
    """``step`` fed its own walk through ``batches`` (the runs take turns, so the batch that
    ``_median_steps`` passes depends on how many runs there are)."""
    count = [0]

    def fed(*_):
        count[0] += 1
        return step(*batches[(count[0] - 1) % len(batches)])
    return fed


def bench(size: str, warmup: int, steps: int, cpu: bool) -> dict:
    import train
    cfg = SIZES[size]
    vocab, seq, _, _, _, batch = cfg
    x_all, y_all = train.gpt_data(np.random.default_rng(2026), batch * 4, seq, vocab)
    batches = [(x_all[k * batch:(k + 1) * batch], y_all[k * batch:(k + 1) * batch])
               for k in range(4)]
    params: dict = {}
    named = {"disttensor_gpu": _dt_step(cfg, "gpu", False, params),
             "captured_gpu": _dt_step(cfg, "gpu", True, params)}
    if cpu:
        named["disttensor_cpu"] = _dt_step(cfg, "cpu", False, params)
    out: dict = {}
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("torch has no CUDA device")
        named["torch_cuda"] = gpt.torch_step_fn(params, cfg, device="cuda")
    except ImportError as e:
        out["torch_note"] = f"no torch column: {e}"
    runs = gpt._median_steps({k: _own_batches(f, batches) for k, f in named.items()},
                             batches, warmup, steps, lambda: None)
    out.update({k: {"step_ms": round(r["step_ms"], 3)} for k, r in runs.items()})
    ms = {k: r["step_ms"] for k, r in runs.items()}
    if "torch_cuda" in ms:
        out["disttensor_gpu_vs_torch_cuda"] = round(ms["disttensor_gpu"] / ms["torch_cuda"], 3)
        out["captured_gpu_vs_torch_cuda"] = round(ms["captured_gpu"] / ms["torch_cuda"], 3)
    if cpu:
        out["gpu_speedup_over_cpu"] = round(ms["disttensor_cpu"] / ms["disttensor_gpu"], 2)
    out["captured_speedup_over_eager_gpu"] = round(ms["disttensor_gpu"] / ms["captured_gpu"], 2)
    ref_name = next((k for k in ("disttensor_cpu", "torch_cuda") if k in runs), None)
    if ref_name is not None:
        ref = np.array(runs[ref_name]["losses"])
        out[f"loss_max_rel_diff_vs_{ref_name}"] = {
            k: float(np.max(np.abs(np.array(r["losses"]) - ref) / np.abs(ref)))
            for k, r in runs.items() if k != ref_name}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="medium,large,xl")
    ap.add_argument("--cpu-sizes", default="medium,large")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    note = _gpu_note()
    if note:
        print(json.dumps({"benchmark": "gpu", "note": note}))
        return
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    res = {"benchmark": "gpu", "device": props["name"].decode(),
           "cupy": cupy.__version__, "steps": args.steps, "warmup": args.warmup,
           "results": {}}
    for size in args.sizes.split(","):
        res["results"][size] = bench(size, args.warmup, args.steps,
                                     size in args.cpu_sizes.split(","))
        print(json.dumps({size: res["results"][size]}), file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
