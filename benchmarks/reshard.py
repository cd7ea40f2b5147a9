"""Reshard throughput against the raw mpi4py collective that moves the same bytes.

    mpiexec -n 4 python benchmarks/reshard.py [--mb 64] [--repeats 5] [--warmup 2]

Cases on a 1-d mesh of every rank, float32, ``--mb`` MB per rank (the local piece, or each
Partial addend): S(0)->R, S(1)->R, P->R, P->S(0), S(0)->S(1). For each: our ``reshard`` time,
the raw mpi4py baseline in the same run (Allgather for S->R — for S(1) the bare Allgather of the
contiguous local buffer, so our layout change counts against us — Allreduce for P->R,
Reduce_scatter for P->S, Alltoall for S->S'), and ratio = raw / ours (1.0 = no overhead). Like
``reshard``, which returns a new tensor, every baseline writes into a freshly allocated output
(first-touch page faults included); for S->R the time into a reused buffer is shown too. Each
time is the slowest rank's, barrier-aligned; the figure is the median over repeats after warm-up.
Prints one JSON object on rank 0.
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
from disttensor import Partial, ProcessMesh, Replicate, Shard  # noqa: E402


def timed(comm, fn, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``fn()`` (after ``warmup`` calls)."""
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        t = time.perf_counter() - t0
        del out
        times.append(comm.allreduce(t, op=MPI.MAX))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0, help="MB per rank (default 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    from mpi4py import MPI

    dt.init_parallel_env()
    comm = MPI.COMM_WORLD.Dup()
    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = ProcessMesh(list(range(n)))
    cols = 4096
    rows = max(1, int(args.mb * 2**20 / 4 / cols))  # local piece: rows x cols float32
    rng = np.random.default_rng(rank)
    local = rng.standard_normal((rows, cols), dtype=np.float32)
    nbytes = local.nbytes

    def dist(placements, shape):
        return dt.dtensor_from_local(local, mesh, placements, shape=shape)

    results = {}

    def case(name, x, placements, raw, extra=None):
        ours = timed(comm, lambda: dt.reshard(x, mesh, placements), args.repeats, args.warmup)
        base = timed(comm, raw, args.repeats, args.warmup)
        results[name] = {"ours_s": round(ours, 5), "raw_s": round(base, 5),
                         "ratio_raw_over_ours": round(base / ours, 3),
                         "raw": raw.__doc__}
        if extra is not None:  # a variant, for attribution
            t = timed(comm, extra, args.repeats, args.warmup)
            results[name].update({f"raw_{extra.__doc__}_s": round(t, 5),
                                  f"ratio_raw_{extra.__doc__}_over_ours": round(t / ours, 3)})

    gather_buf = np.empty((n * rows, cols), dtype=np.float32)

    def raw_allgather():
        """Allgather"""
        out = np.empty((n * rows, cols), dtype=np.float32)
        comm.Allgather(local, out)
        return out

    def raw_allgather_prealloc():
        """Allgather_into_a_reused_buffer"""
        comm.Allgather(local, gather_buf)
        return gather_buf

    case("S(0)->R", dist([Shard(0)], (n * rows, cols)), [Replicate()], raw_allgather,
         raw_allgather_prealloc)
    case("S(1)->R", dist([Shard(1)], (rows, n * cols)), [Replicate()], raw_allgather,
         raw_allgather_prealloc)

    def raw_allreduce():
        """Allreduce"""
        out = np.empty_like(local)
        comm.Allreduce(local, out, op=MPI.SUM)
        return out

    case("P->R", dist([Partial()], (rows, cols)), [Replicate()], raw_allreduce)

    counts = [len(r) * cols for r in np.array_split(np.arange(rows), n)]

    def raw_reduce_scatter():
        """Reduce_scatter"""
        out = np.empty(counts[rank], dtype=np.float32)
        comm.Reduce_scatter(local, out, recvcounts=counts, op=MPI.SUM)
        return out

    case("P->S(0)", dist([Partial()], (rows, cols)), [Shard(0)], raw_reduce_scatter)

    def raw_alltoall():
        """Alltoall"""
        out = np.empty_like(local)
        comm.Alltoall(local, out)
        return out

    case("S(0)->S(1)", dist([Shard(0)], (n * rows, cols)), [Shard(1)], raw_alltoall)

    if rank == 0:
        print(json.dumps({"world_size": n, "dtype": "float32", "bytes_per_rank": nbytes,
                          "local_shape": [rows, cols], "repeats": args.repeats,
                          "warmup": args.warmup, "cases": results}, indent=2), flush=True)


if __name__ == "__main__":
    main()
