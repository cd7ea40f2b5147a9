"""``[Shard(0), Replicate()] -> [Replicate(), Shard(0)]`` on a 2x2 mesh: our plan (one pairwise
exchange) against the plan it replaces (all-gather on mesh dim 0, then a local slice on mesh dim
1, run as two reshards) and the bare mpi4py ``Sendrecv`` of the same piece, in the same run.

    mpiexec -n 4 python benchmarks/reshard_pairwise.py [--mb 1 16 64] [--repeats 5]

Float32, ``--mb`` MB per rank (the local piece). Each time is the slowest rank's,
barrier-aligned, the median over repeats after one warm-up. Prints one JSON object on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from reshard import swap_with  # noqa: E402  (benchmarks/reshard.py, beside this script)

import disttensor as dt  # noqa: E402
from disttensor import ProcessMesh, Replicate, Shard  # noqa: E402


def timed(comm, fn, repeats: int) -> float:
    from mpi4py import MPI

    fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, nargs="+", default=[1.0, 16.0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from mpi4py import MPI

    dt.init_parallel_env()
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() != 4:
        raise SystemExit("run with 4 ranks")
    rank = comm.Get_rank()
    mesh = ProcessMesh([[0, 1], [2, 3]])
    i, j = mesh.get_coord(rank)
    peer = mesh.rank_at((j, i))
    src, dst, rep = [Shard(0), Replicate()], [Replicate(), Shard(0)], [Replicate(), Replicate()]
    results = {}
    for mb in args.mb:
        cols = 1024
        rows = max(1, int(mb * 2**20 / 4 / cols))
        local = np.random.default_rng(rank).standard_normal((rows, cols), dtype=np.float32)
        x = dt.dtensor_from_local(local, mesh, src, shape=(2 * rows, cols))
        plan = dt.reshard_plan(x, mesh, dst)

        def raw():
            return swap_with(comm, local, peer)

        ours = timed(comm, lambda: dt.reshard(x, mesh, dst), args.repeats)
        old = timed(comm, lambda: dt.reshard(dt.reshard(x, mesh, rep), mesh, dst), args.repeats)
        base = timed(comm, raw, args.repeats)
        results[f"{mb}MB"] = {"plan": [s.kind for s in plan.steps], "ours_s": round(ours, 5),
                              "allgather_slice_s": round(old, 5), "raw_sendrecv_s": round(base, 5),
                              "ratio_old_over_ours": round(old / ours, 3),
                              "ratio_raw_over_ours": round(base / ours, 3)}
    if rank == 0:
        print(json.dumps({"case": "[S(0),R]->[R,S(0)] on 2x2, float32", "results": results},
                         indent=1))


if __name__ == "__main__":
    main()
