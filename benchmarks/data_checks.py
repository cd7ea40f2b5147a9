"""What the data checks cost: a batch-sharded call checked against the same call unchecked.

    mpiexec -n 4 python benchmarks/data_checks.py [--rows 64] [--calls 200] [--rounds 15]

Cases: ``embedding`` (ids [rows] sharded on a 1-d mesh of every rank, weight [1000, 64]
replicated) and ``cross_entropy`` with ``reduction="none"`` (logits [rows, 1000] and labels
batch-sharded), each eager (``calls`` calls, then the agreement the checks leave pending) and
captured (``dt.jit.to_static`` of one call, ``calls`` replays, each agreeing once at the step's
end). Unchecked: the same kernels with ``check_index_range`` replaced by a function returning
the values (patched in the op modules for this measurement only; the library has no switch to
turn the checks off). Checked and unchecked alternate within each round; a sample is the slowest
rank's barrier-aligned time per call, the final agreement included; the figure is the median
sample. ``ratio`` = checked / unchecked (1.0: free); ``*_calls_only`` leave the final agreement
out (what one call costs while the agreement waits for a collective the program makes anyway);
``final_agreement_us`` is that agreement after the eager calls (a captured step agrees inside
each replay, after its forward). Every figure is the slowest rank's, so the agreement includes
waiting for the last rank to finish its calls. Prints one JSON object on rank 0.
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
import disttensor.nn.functional as F  # noqa: E402
from disttensor import ProcessMesh, Replicate, Shard  # noqa: E402
from disttensor.distributed.agreement import flush_data_checks  # noqa: E402

_CHECKED_MODULES = ("disttensor.ops.embedding", "disttensor.ops.loss")


def set_checks(on: bool) -> None:
    """Patch the kernels' module-level ``check_index_range`` (restored with ``on=True``)."""
    from disttensor.ops.common import check_index_range
    fn = check_index_range if on else (lambda xp, ctx, op, what, values, *a, **k: values)
    for name in _CHECKED_MODULES:
        sys.modules[name].check_index_range = fn


def slowest(value: float) -> float:
    t = dt.to_tensor(np.array([value]))
    dt.all_reduce(t, op=dt.ReduceOp.MAX)
    return float(t.numpy()[0])


def timed(fn, calls: int) -> tuple[float, float, float]:
    """The slowest rank's µs per call for ``calls`` calls of ``fn`` followed by the agreement
    they leave pending, the same without the agreement, and the agreement alone (µs)."""
    dt.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    flush_data_checks()
    t2 = time.perf_counter()
    return (slowest((t2 - t0) / calls * 1e6), slowest((t1 - t0) / calls * 1e6),
            slowest((t2 - t1) * 1e6))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    dt.init_parallel_env()
    n = dt.get_world_size()
    mesh = ProcessMesh(list(range(n)), dim_names=["x"])
    rng = np.random.default_rng(0)
    vocab, width = 1000, 64
    w = dt.shard_tensor(rng.standard_normal((vocab, width)).astype(np.float32), mesh,
                        [Replicate()])
    ids = dt.shard_tensor(rng.integers(0, vocab, (args.rows,)), mesh, [Shard(0)])
    logits = dt.shard_tensor(rng.standard_normal((args.rows, vocab)).astype(np.float32), mesh,
                             [Shard(0)])

    def emb():
        return F.embedding(ids, w)

    def ce():
        return F.cross_entropy(logits, ids, reduction="none")

    cases = {}
    for name, fn in (("embedding", emb), ("cross_entropy_none", ce)):
        step = dt.jit.to_static(fn)
        for mode, call in (("eager", fn), ("captured", step)):
            samples: dict = {True: [], False: []}
            for on in (True, False):  # warm both (plans, captures)
                set_checks(on)
                timed(call, 5)
            for _ in range(args.rounds):
                for on in (True, False):
                    set_checks(on)
                    samples[on].append(timed(call, args.calls))
            set_checks(True)
            def med(on: bool, i: int) -> float:
                return float(np.median([s[i] for s in samples[on]]))
            cases[f"{name}_{mode}"] = {
                "checked_us": round(med(True, 0), 2), "unchecked_us": round(med(False, 0), 2),
                "ratio": round(med(True, 0) / med(False, 0), 3),
                "checked_calls_only_us": round(med(True, 1), 2),
                "unchecked_calls_only_us": round(med(False, 1), 2),
                "ratio_calls_only": round(med(True, 1) / med(False, 1), 3),
                "final_agreement_us": round(med(True, 2), 1)}
    if dt.get_rank() == 0:
        print(json.dumps({"ranks": n, "rows": args.rows, "calls": args.calls,
                          "rounds": args.rounds, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
