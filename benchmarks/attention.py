"""Fused attention forward + backward against PyTorch CPU's ``scaled_dot_product_attention``.

    python benchmarks/attention.py [--rounds 5] [--shape 4,512,8,64] [--causal]

At [batch, seq, heads, head_dim] (default [4, 512, 8, 64], float32) times one forward and
backward through ``dt.nn.functional.scaled_dot_product_attention`` (the blocked kernel with its
online softmax; the backward recomputes each key block's probabilities) and the same through
``torch.nn.functional.scaled_dot_product_attention`` (its layout [b, h, s, d]), both with one
thread (OMP/OpenBLAS/MKL and torch's intra-op threads set to 1). Rounds alternate; prints JSON
with the median milliseconds per step (thread CPU time and wall) and ``ratio_over_torch``
(target: <= 1.5).
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
import disttensor as dt  # noqa: E402

try:
    import torch
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


def _time(step, rounds: int) -> dict:
    step()  # warm up
    cpu, wall = [], []
    for _ in range(rounds):
        c0, w0 = time.thread_time(), time.perf_counter()
        step()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"cpu_ms": 1e3 * statistics.median(cpu), "wall_ms": 1e3 * statistics.median(wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="4,512,8,64")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, s, h, d = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(4)]

    def ours():
        q, k, v = (dt.to_tensor(a, stop_gradient=False) for a in arrays[:3])
        out = dt.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(dt.to_tensor(arrays[3]))

    def theirs():
        q, k, v = (torch.from_numpy(a).transpose(1, 2).requires_grad_() for a in arrays[:3])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        out.backward(torch.from_numpy(arrays[3]).transpose(1, 2))

    result = {"shape": [b, s, h, d], "dtype": "float32", "causal": args.causal, "threads": 1}
    rows = {"disttensor": [], "torch": []}
    for _ in range(args.rounds):  # alternate, so both see the same machine load
        rows["disttensor"].append(_time(ours, 1))
        if torch is not None:
            rows["torch"].append(_time(theirs, 1))
    for name, rs in rows.items():
        if rs:
            result[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    if torch is not None:
        result["ratio_over_torch"] = {
            k: result["disttensor"][k] / result["torch"][k] for k in ("cpu_ms", "wall_ms")}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
