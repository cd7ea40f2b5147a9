"""Pipeline schedules: peak activation memory on stage 0, bubble fractions, step times.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/pipeline.py [--quick] [--plot out.png]

A GPT-like model (examples/train.py's GPT) cut into stages on a [pp] mesh (pp = world size)
is trained one step per schedule (FThenB, 1F1B, VPP with v = 2, and 1F1B with every chunk's
work a captured program, as ``to_static`` with ``strategy.pipeline`` runs it) with m
micro-batches. Prints
JSON on rank 0: per schedule the median step time (``step_ms``), the most bytes stage 0
allocates at once during a step above what it held before (``stage0_peak_bytes``,
tracemalloc: activations kept for pending backwards dominate), the measured bubble fraction
(``bubble``: 1 - busy / (ranks x span) from every rank's action timeline, receive waits
counted as idle) beside the theoretical ``(pp - 1) / (v m + pp - 1)``, and the ratio
``1F1B_vs_FThenB_peak`` measured in the same run, and the captured 1F1B's step time and peak
against the eager 1F1B's (``captured_vs_eager_1F1B_*``). ``--plot`` draws the timelines of the
last step of each schedule (matplotlib, the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tracemalloc

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples")]

import train  # noqa: E402

import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor.layout.mesh_groups import world  # noqa: E402
from disttensor.pipelining.captured import CapturedSchedule  # noqa: E402

SCHEDULES = {"FThenB": (dt.pipelining.ScheduleFThenB, 1),
             "1F1B": (dt.pipelining.Schedule1F1B, 1),
             "VPP": (dt.pipelining.ScheduleVPP, 2),
             "1F1B captured": (None, 1)}


def _build(name: str, pp: int, size: dict, m: int):
    dt.seed(0)
    model = train.GPT(size["vocab"], size["seq"], size["d"], size["heads"], size["layers"])
    cls, v = SCHEDULES[name]
    schedule = name.split()[0]
    mesh = dt.ProcessMesh(list(range(pp)), dim_names=["pp"])
    model, _ = dt.parallelize(model, None, mesh, {"pp_config": {
        "split_spec": "blocks", "schedule": schedule, "vpp_degree": v}})
    vocab = size["vocab"]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape([-1, vocab]), y.reshape([-1]))
    if cls is None:  # the captured step's schedule (to_static with strategy.pipeline)
        return model, CapturedSchedule(model, schedule, m, loss_fn, v)
    kw = {"vpp_degree": v} if v > 1 else {}
    return model, cls(model, n_microbatches=m, loss_fn=loss_fn, **kw)


def _bubble(timeline: list, pp: int) -> float:
    every = world().exchange_metadata(timeline)
    start = min(t0 for tl in every for _, t0, _ in tl)
    end = max(t1 for tl in every for _, _, t1 in tl)
    busy = sum(t1 - t0 for tl in every for _, t0, t1 in tl)
    return 1.0 - busy / (pp * (end - start))


def measure(name: str, pp: int, size: dict, m: int, steps: int) -> dict:
    model, sched = _build(name, pp, size, m)
    rng = np.random.default_rng(0)
    x = rng.integers(0, size["vocab"], (size["batch"], size["seq"]))
    y = rng.integers(0, size["vocab"], (size["batch"], size["seq"]))
    for _ in range(2):  # warm-up: caches, first gradients (captured: every program)
        sched.step(x, y)
        model.clear_gradients(set_to_zero=False)
    times, bubbles = [], []
    for _ in range(steps):
        world().barrier()
        t0 = time.perf_counter()
        sched.step(x, y)
        times.append(time.perf_counter() - t0)
        model.clear_gradients(set_to_zero=False)
        bubbles.append(_bubble(sched.timeline, pp))
    timeline = world().exchange_metadata(sched.timeline)  # an untraced step's
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    sched.step(x, y)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    model.clear_gradients(set_to_zero=False)
    peaks = world().exchange_metadata(peak)
    v = SCHEDULES[name][1]
    schedule = name.split()[0]
    return {"step_ms": 1e3 * statistics.median(times), "stage0_peak_bytes": int(peaks[0]),
            "peak_bytes_per_rank": [int(p) for p in peaks],
            "bubble": statistics.median(bubbles),
            "bubble_theoretical": dt.pipelining.theoretical_bubble(pp, m, v),
            "bubble_table": dt.pipelining.bubble_fraction(
                dt.pipelining.schedule_actions(schedule, pp, m, v), v),
            "timeline": timeline}


def _plot(path: str, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 * len(results)), squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        t0 = min(s for tl in r["timeline"] for _, s, _ in tl)
        for rank, tl in enumerate(r["timeline"]):
            for label, s, e in tl:
                ax.barh(rank, (e - s) * 1e3, left=(s - t0) * 1e3,
                        color="tab:blue" if label[0] == "F" else "tab:orange")
        ax.set_title(f"{name}: bubble {r['bubble']:.2f} (theory {r['bubble_theoretical']:.2f})")
        ax.set_ylabel("stage")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, 2 timed steps")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the timelines here")
    args = p.parse_args()
    dt.init_parallel_env()
    pp, m = world().size, args.micro_batches
    size = ({"vocab": 64, "seq": 16, "d": 32, "heads": 2, "layers": 2 * pp, "batch": 4 * m}
            if args.quick else
            {"vocab": 128, "seq": 64, "d": 64, "heads": 4, "layers": 2 * pp, "batch": 8 * m})
    steps = 2 if args.quick else 5
    results = {name: measure(name, pp, size, m, steps) for name in SCHEDULES
               if name != "VPP" or m % pp == 0}
    report = {"pp": pp, "micro_batches": m, "model": size,
              "schedules": {k: {f: v for f, v in r.items() if f != "timeline"}
                            for k, r in results.items()},
              "1F1B_vs_FThenB_peak": results["1F1B"]["stage0_peak_bytes"]
              / results["FThenB"]["stage0_peak_bytes"],
              "captured_vs_eager_1F1B_step": results["1F1B captured"]["step_ms"]
              / results["1F1B"]["step_ms"],
              "captured_vs_eager_1F1B_peak": results["1F1B captured"]["stage0_peak_bytes"]
              / results["1F1B"]["stage0_peak_bytes"],
              "pp_over_m": pp / m}
    if dt.get_rank() == 0:
        print(json.dumps(report, indent=1))
        if args.plot:
            _plot(args.plot, results)


if __name__ == "__main__":
    main()
