"""Collectives throughput vs raw mpi4py, measured in the same run.

    mpiexec -n 4 python benchmarks/collectives.py [--sizes-mb 1,64] [--reps 15,5]

For each per-rank input size (float32) and each case, times our call and the raw mpi4py call on
buffers of the same size (warm-up first, barrier-aligned, a call's time is the slowest rank's,
median over repeats; ours and raw alternate, and alternate which goes first, so drift and
order effects hit both). The raw
baseline is the plain contiguous MPI collective (Allgather, Allreduce, Reduce_scatter_block,
Alltoall) including allocation of its output, which is what our call does; for a non-zero axis
the baseline moves the same bytes, so the ratio includes our cost of handling the axis.
``ratio`` = raw time / our time (throughput ratio; 1.0 = as fast as raw). Rank 0 prints JSON.

``small_4KB`` (always measured): the per-call cost of Python around a 4 KB call — our
``all_reduce`` / ``all_gather`` and ``disttensor.reshard`` S(0) -> R against the bare MPI call
(best of several batches, alternating, so load on the machine hits both; plus the number of
Python function calls each makes, which load does not change), and, timed alone in a
loop on one process, what the failure policy adds to every collective (the watchdog's entry and
exit bookkeeping; the collective header: posting it and checking the members' headers when
they have posted theirs, on a table of ``world_size`` members) and to a steady-state
``reshard`` (a cached rank-agreement lookup). Ops between the entry points
(``dispatch.apply``) run no agreement code: there is none on that path. Measured twice: wall
time (``failure_policy_us_per_call``) and this thread's CPU time
(``failure_policy_cpu_us_per_call``: what the code costs, whatever the load on the machine).
``headers``: the 4 KB all_reduce and all_gather with the group's header table against the same
calls without it (every rank toggles it together, alternating batches), the end-to-end price of
the check.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from array import array

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

import collectives  # noqa: E402


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX)


def bench_case(comm, ours, raw, reps):
    ours()
    raw()  # warm-up
    t_ours, t_raw = [], []
    for i in range(reps):  # alternate who goes first so order effects cancel
        if i % 2 == 0:
            t_ours.append(timed(comm, ours))
            t_raw.append(timed(comm, raw))
        else:
            t_raw.append(timed(comm, raw))
            t_ours.append(timed(comm, ours))
    mo, mr = statistics.median(t_ours), statistics.median(t_raw)
    return {"ours_s": round(mo, 6), "raw_s": round(mr, 6), "ratio": round(mr / mo, 3)}


def cases(g, comm, nbytes):
    k = g.size
    n = nbytes // 4
    inner = 256
    rows = max(k, n // inner) // k * k  # divisible by k so raw *_block calls apply
    x0 = np.random.default_rng(comm.rank).standard_normal((rows, inner)).astype(np.float32)
    # non-zero axis: the same bytes as (16, rows/16, inner) on axis 1
    d0 = 16
    x1 = x0.reshape(d0, rows // d0, inner) if rows % d0 == 0 else x0.reshape(1, rows, inner)
    flat = x0.reshape(-1)
    sizes0 = [rows] * k
    sizes1 = [x1.shape[1]] * k
    out = {}

    def raw_allgather():
        o = np.empty(flat.size * k, np.float32)
        comm.Allgather(flat, o)

    def raw_allreduce():
        o = np.empty_like(flat)
        comm.Allreduce(flat, o, op=MPI.SUM)

    def raw_reduce_scatter():
        o = np.empty(flat.size // k, np.float32)
        comm.Reduce_scatter_block(flat, o, op=MPI.SUM)

    def raw_alltoall():
        o = np.empty_like(flat)
        comm.Alltoall(flat, o)

    out["all_gather axis=0"] = (lambda: g.all_gather(x0, 0, sizes=sizes0), raw_allgather)
    out["all_gather axis=1"] = (lambda: g.all_gather(x1, 1, sizes=sizes1), raw_allgather)
    out["all_gather axis=0 (sizes exchanged)"] = (lambda: g.all_gather(x0, 0), raw_allgather)
    out["all_reduce"] = (lambda: g.all_reduce(x0, "sum"), raw_allreduce)
    out["reduce_scatter axis=0"] = (lambda: g.reduce_scatter(x0, "sum", 0), raw_reduce_scatter)
    out["reduce_scatter axis=1"] = (lambda: g.reduce_scatter(x1, "sum", 1), raw_reduce_scatter)
    rs0 = [rows // k] * k
    rs1 = [x1.shape[1] // k] * k if x1.shape[1] % k == 0 else None
    out["all_to_all split=0 concat=0"] = (lambda: g.all_to_all(x0, 0, 0, recv_sizes=rs0),
                                          raw_alltoall)
    out["all_to_all split=1 concat=1"] = (lambda: g.all_to_all(x1, 1, 1, recv_sizes=rs1),
                                          raw_alltoall)
    out["all_to_all split=0 concat=1 (recv sizes exchanged)"] = (lambda: g.all_to_all(x0, 0, 1),
                                                                 raw_alltoall)
    return out


def best_per_call(comm, fn, calls: int, batches: int) -> float:
    """Seconds per call: the best batch of ``calls`` calls (the slowest rank's time)."""
    best = float("inf")
    for _ in range(batches):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / calls)
    return best


def loop_cost(fn, calls: int = 200_000, clock=time.perf_counter) -> float:
    """Seconds per call of ``fn`` in a tight loop on this process, minus the empty loop's
    (``clock``: wall time, or ``time.thread_time``, which a loaded machine's waits for a core
    do not inflate)."""
    def run(f):
        t0 = clock()
        for _ in range(calls):
            f()
        return clock() - t0
    empty = min(run(lambda: None) for _ in range(3))
    return max(0.0, min(run(fn) for _ in range(3)) - empty) / calls


def python_calls(fn, calls: int = 200) -> float:
    """Python function calls per call of ``fn`` (cProfile's count: independent of machine load,
    unlike the timings; the same number on every rank for these symmetric calls)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return round(pstats.Stats(prof).total_calls / calls, 1)


def header_check_cost(g, size: int, clock=time.perf_counter) -> float:
    """Seconds per call that the header adds to a collective whose members have all posted
    theirs (the common case): ``g._begin`` with a table whose every word holds the next call's
    header (kept so by rewinding the call index) against ``g._begin`` without a table."""
    import mmap

    from collectives._headers import SLOTS, Board, header, with_seq
    from collectives.failure import Watch
    board = Board(mmap.mmap(-1, SLOTS * size * 8), size, 0)
    head = header("barrier", None, 0)
    index = g._call_index
    for row in board.rows:
        row[:] = array("Q", [with_seq(head, index)] * size)

    def enter_and_leave():
        g._call_index = index
        g._begin("barrier", (), head)
        Watch.now = None
    without = loop_cost(enter_and_leave, clock=clock)
    g._board = board
    with_ = loop_cost(enter_and_leave, clock=clock)
    g._board = None
    board.close()
    return with_ - without


def header_cost(g, comm, cases: dict, calls: int, batches: int) -> dict:
    """Our 4 KB calls with the group's header table and without, alternating batches (every
    rank switches together: a call must see the same setting on every member)."""
    board = g._board
    if board is None:
        return {"table": "none (the group's members cannot share one)"}
    out = {}
    for name, (ours, _) in cases.items():
        t_on = t_off = float("inf")
        for _ in range(batches):
            g._board = None
            t_off = min(t_off, best_per_call(comm, ours, calls, 1))
            g._board = board
            t_on = min(t_on, best_per_call(comm, ours, calls, 1))
        out[name] = {"with_header_us": round(t_on * 1e6, 2),
                     "without_header_us": round(t_off * 1e6, 2),
                     "header_us": round((t_on - t_off) * 1e6, 2)}
    return out


def small_calls(g, comm, calls: int, batches: int) -> dict:
    """4 KB per rank: our calls and reshard against the bare MPI calls, plus the failure
    policy's per-call costs."""
    import disttensor as dt
    from collectives.failure import Watch
    from disttensor.distributed.agreement import check_reshard
    from disttensor.distributed.api import _check_placements

    k = g.size
    n = 4096 // 8
    x = np.ones(n)
    gathered = np.empty(n * k)
    reduced = np.empty(n)
    mesh = dt.ProcessMesh(list(range(k)))
    xs = dt.shard_tensor(np.ones(n * k), mesh, [dt.Shard(0)])  # 4 KB piece per rank
    cases = {
        "all_reduce": (lambda: g.all_reduce(x), lambda: comm.Allreduce(x, reduced)),
        "all_gather": (lambda: g.all_gather(x, 0, sizes=[n] * k),
                       lambda: comm.Allgather(x, gathered)),
        "reshard S(0)->R": (lambda: dt.reshard(xs, mesh, [dt.Replicate()]),
                            lambda: comm.Allgather(x, gathered)),
    }
    out = {}
    for name, (ours, raw) in cases.items():
        for _ in range(20):
            ours()
            raw()
        t_ours = t_raw = float("inf")
        for i in range(batches):  # alternate: load on the machine hits both
            t_ours = min(t_ours, best_per_call(comm, ours, calls, 1))
            t_raw = min(t_raw, best_per_call(comm, raw, calls, 1))
        out[name] = {"ours_us": round(t_ours * 1e6, 2), "bare_mpi_us": round(t_raw * 1e6, 2),
                     "python_us": round((t_ours - t_raw) * 1e6, 2),
                     "ratio_to_bare": round(t_ours / t_raw, 2),
                     "python_function_calls": python_calls(ours)}

    out["headers"] = header_cost(g, comm, {n: cases[n] for n in ("all_reduce", "all_gather")},
                                 calls, batches)
    board, g._board = g._board, None  # (rank-local loops: no peer posts headers)

    def enter_and_leave():  # what every collective runs besides its checks and the MPI call
        g._begin("barrier", (), 0)  # call index, the watchdog's record, count
        Watch.now = None
    saved = g._call_index
    attr = _check_placements("reshard", mesh, [dt.Replicate()], 1, (n * k,), False)
    for key, clock in (("failure_policy_us_per_call", time.perf_counter),
                       ("failure_policy_cpu_us_per_call", time.thread_time)):
        out[key] = {
            "collective_bookkeeping": round(loop_cost(enter_and_leave, clock=clock) * 1e6, 3),
            "collective_header": round(header_check_cost(g, k, clock) * 1e6, 3),
            "reshard_agreement_cached": round(loop_cost(
                lambda: check_reshard(xs._value, mesh, attr), clock=clock) * 1e6, 3),
        }
    g._call_index, g._board = saved, board  # the bookkeeping loop ran on this rank only
    collectives.reset_collective_counts()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,64")
    ap.add_argument("--small-only", action="store_true", help="only the 4 KB per-call costs")
    ap.add_argument("--small-calls", default="200,15", help="calls per batch, batches (4 KB)")
    ap.add_argument("--reps", default="15,5", help="repeats per size")
    a = ap.parse_args()
    g = collectives.init()
    comm = MPI.COMM_WORLD
    sizes = [float(v) for v in a.sizes_mb.split(",")]
    reps = [int(v) for v in a.reps.split(",")]
    reps += [reps[-1]] * (len(sizes) - len(reps))
    result = {"world_size": g.size, "dtype": "float32",
              "mpi": MPI.Get_library_version().splitlines()[0],
              "native_large_count":
                  __import__("collectives._mpi_types", fromlist=["x"]).NATIVE_LARGE_COUNT,
              "results": {}}
    t_start = time.perf_counter()
    calls, batches = (int(v) for v in a.small_calls.split(","))
    result["small_4KB"] = small_calls(g, comm, calls, batches)
    for mb, r in ([] if a.small_only else zip(sizes, reps)):
        key = f"{mb:g}MB_per_rank"
        result["results"][key] = {}
        for name, (ours, raw) in cases(g, comm, int(mb * 2**20)).items():
            result["results"][key][name] = bench_case(comm, ours, raw, r)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    if comm.rank == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
