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
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives  # noqa: E402
from mpi4py import MPI  # noqa: E402


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
    out["all_to_all split=0 concat=0"] = (lambda: g.all_to_all(x0, 0, 0, recv_sizes=rs0), raw_alltoall)
    out["all_to_all split=1 concat=1"] = (lambda: g.all_to_all(x1, 1, 1, recv_sizes=rs1), raw_alltoall)
    out["all_to_all split=0 concat=1 (recv sizes exchanged)"] = (lambda: g.all_to_all(x0, 0, 1), raw_alltoall)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,64")
    ap.add_argument("--reps", default="15,5", help="repeats per size")
    a = ap.parse_args()
    g = collectives.init()
    comm = MPI.COMM_WORLD
    sizes = [float(v) for v in a.sizes_mb.split(",")]
    reps = [int(v) for v in a.reps.split(",")]
    reps += [reps[-1]] * (len(sizes) - len(reps))
    result = {"world_size": g.size, "dtype": "float32", "mpi": MPI.Get_library_version().splitlines()[0],
              "native_large_count": __import__("collectives._mpi", fromlist=["x"]).NATIVE_LARGE_COUNT,
              "results": {}}
    t_start = time.perf_counter()
    for mb, r in zip(sizes, reps):
        key = f"{mb:g}MB_per_rank"
        result["results"][key] = {}
        for name, (ours, raw) in cases(g, comm, int(mb * 2**20)).items():
            result["results"][key][name] = bench_case(comm, ours, raw, r)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    if comm.rank == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
