"""Mixed precision against PyTorch on CPU: train.py's GPT for 20 steps, the same weights and
batches, disttensor's bfloat16 O1 against ``torch.autocast("cpu", dtype=torch.bfloat16)``,
O2 (float32 master weights) against disttensor's own float32 run, and O1 dense vs on the
[dp, mp] mesh vs captured.

    python benchmarks/amp_torch.py                                   # one process
    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/amp_torch.py    # + the 2 x 2 mesh

Prints JSON on rank 0: each run's losses and the largest relative difference per step of
``O1_vs_torch_bf16`` (target <= 2e-2), ``O2_vs_fp32`` (target <= 1e-2; absolute, on the loss)
and ``O1_mesh_vs_dense`` / ``O1_captured_vs_mesh``; ``fp32_vs_torch_fp32`` checks that both sides
run the same model. The torch columns are absent, with a
note, when torch is not installed.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "benchmarks")]

import train  # noqa: E402

import disttensor as dt  # noqa: E402

STEPS, INIT = 20, 5  # steps; the generator state train.build starts from


def run(level: str | None, mesh=None, captured: bool = False) -> tuple[list[float], dict]:
    """The losses of STEPS AdamW steps of train.py's GPT at ``level`` (None: float32)."""
    model, opt, batches = train.build("gpt", INIT, mesh)
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    args = SimpleNamespace(amp=level, amp_dtype="bfloat16", to_static=captured)
    model, opt, amp = train.amp_setup(args, model, opt)

    def step(x, y):
        return train.train_step(model, opt, x, y, amp)
    f = dt.jit.to_static(step) if captured else step
    losses = [float(f(*train.to_tensors(*batches[k % 4], mesh)).numpy()) for k in range(STEPS)]
    return losses, params


def torch_run(params: dict, bf16: bool) -> list[float] | str:
    """torch's losses from the same weights and batches (under bfloat16 autocast or not)."""
    try:
        import torch
        from gpt import torch_step_fn
    except ImportError as e:
        return f"torch not importable: {e}"
    vocab, seq, d, heads, layers = train.SIZES["default"]["gpt"]
    step = torch_step_fn({k: v for k, v in params.items()}, (vocab, seq, d, heads, layers, 16))
    _, _, batches = train.build("gpt", INIT, None)
    out = []
    for k in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out.append(step(*batches[k % 4]))
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def main() -> None:
    dt.init_parallel_env()
    res: dict = {"steps": STEPS, "world": dt.get_world_size()}
    fp32, params = run(None)
    o1, _ = run("O1")
    o2, _ = run("O2")
    res.update(fp32=fp32, O1=o1, O2=o2,
               O2_vs_fp32=float(np.max(np.abs(np.subtract(o2, fp32)))),
               O1_vs_fp32=rel(o1, fp32))
    if dt.get_world_size() > 1:
        mesh = train.default_mesh(dt.get_world_size())
        o1_mesh, _ = run("O1", mesh)
        o1_cap, _ = run("O1", mesh, captured=True)
        res.update(O1_mesh=o1_mesh, O1_mesh_vs_dense=rel(o1_mesh, o1),
                   O1_captured_vs_mesh=rel(o1_cap, o1_mesh))
    if dt.get_rank() == 0:
        tb, t32 = torch_run(params, True), torch_run(params, False)
        if isinstance(tb, str):
            res["torch_note"] = tb
        else:
            res.update(torch_bf16=tb, O1_vs_torch_bf16=rel(o1, tb), fp32_vs_torch_fp32=rel(
                fp32, t32), torch_bf16_vs_torch_fp32=rel(tb, t32))
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
