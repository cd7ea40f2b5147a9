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
out (what one call costs while the agreement waits for a collective the program makes anyway;
``_best``: the ratio of the fastest samples, less moved by other processes' load);
``*_check_alone_us`` is the best time of one call's check by itself (rank 0; no
communication); ``final_agreement_us`` is that agreement after the eager calls (a captured step
agrees inside each replay, after its forward). Every other figure is the slowest rank's, so the
agreement includes waiting for the last rank to finish its calls. Prints one JSON object on
rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor import ProcessMesh, Replicate, Shard  # noqa: E402
from disttensor.ops.data_checks import flush_data_checks  # noqa: E402

_CHECKED_MODULES = ("disttensor.ops.embedding", "disttensor.ops.loss")


def set_checks(on: bool | Callable) -> None:
    """Patch the kernels' module-level ``check_index_range``: the library's (True), one that
    returns the values unchecked (False), or a given function."""
    from disttensor.ops.common import check_index_range
    fn = on if callable(on) else (
        check_index_range if on else (lambda xp, ctx, op, what, values, *a, **k: values))
    for name in _CHECKED_MODULES:
        sys.modules[name].check_index_range = fn


def check_alone_us(fn) -> float:
    """The best time (µs, this rank) of the check that one call of ``fn`` makes, called alone
    with that call's arguments (every rank runs it equally often: the notes stay in step)."""
    from disttensor.ops.common import check_index_range
    seen: list = []
    set_checks(lambda *a, **k: seen.append((a, k)) or check_index_range(*a, **k))
    fn()
    set_checks(True)
    a, k = seen[0]
    best = min(timeit.repeat(lambda: check_index_range(*a, **k), number=1000, repeat=9)) / 1000
    flush_data_checks()
    return best * 1e6


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
            if mode == "eager":
                cases[f"{name}_check_alone_us"] = round(check_alone_us(fn), 2)
            cases[f"{name}_{mode}"] = {
                "checked_us": round(med(True, 0), 2), "unchecked_us": round(med(False, 0), 2),
                "ratio": round(med(True, 0) / med(False, 0), 3),
                "checked_calls_only_us": round(med(True, 1), 2),
                "unchecked_calls_only_us": round(med(False, 1), 2),
                "ratio_calls_only": round(med(True, 1) / med(False, 1), 3),
                "ratio_calls_only_best": round(min(s[1] for s in samples[True])
                                               / min(s[1] for s in samples[False]), 3),
                "final_agreement_us": round(med(True, 2), 1)}
    if dt.get_rank() == 0:
        print(json.dumps({"ranks": n, "rows": args.rows, "calls": args.calls,
                          "rounds": args.rounds, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
