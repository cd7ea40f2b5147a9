"""Reshard time against the bare mpi4py collective that moves the same bytes, per size.

    mpiexec -n 4 python benchmarks/reshard.py [--sizes 4KB 64KB 1MB 16MB 64MB] [--cases ...]

Float32, a square local piece of each size per rank (the piece, or each Partial addend). Cases on
a 1-d mesh of every rank: S(0)->R, S(1)->R, P->R, P->S(0), S(0)->S(1); with 4 ranks also the two
pairwise exchanges of a 2x2 mesh, [S(0),R]->[R,S(0)] and [R,S(0)]->[S(0),R], and the gather of a
2-d sharded matrix on it, [S(0),S(1)]->[R,R]. Bare baselines:
Allgather for S->R (for S(1) the bare Allgather of the contiguous local buffer, so the layout
change counts against us), Allreduce for P->R, Reduce_scatter for P->S(0), Alltoall of the
contiguous buffer for S(0)->S(1), Sendrecv with the transposed rank for the 2x2 exchanges, the
Allgather of the four contiguous pieces (blocks, not the matrix) for the 2-d gather. Like
``reshard``, which returns a new tensor, every baseline writes into a freshly allocated output.
Both read the same buffer (the distributed tensor shares the dense tensor's): a copy of the piece
in other pages ran up to 25% faster or slower through the same MPI call (16 MB, 2x2 exchange).

Timing: our call and the bare call alternate within each round (so load from other processes hits
both alike); a sample is the slowest rank's barrier-aligned time of ``inner`` calls; the figure is
the median sample (31 rounds up to 1 MB, 15 above). ``ratio_raw_over_ours`` is bare time / our
time: 1.0 = no overhead, 0.5 = twice the bare time. Prints one JSON object on rank 0.

S(0)->S(1) from 1 MB: only the send side is strided; each receiver's result lives in memory
every rank of the node maps (pooled memfd segments) and each sender copies its strided rows
straight there with streaming stores (one copy, as the bare Alltoall's; packing into a kept
buffer and one Alltoallv where that is unavailable). Send-side MPI vector datatypes ran 3-8x
slower than the bare Alltoall with MPICH ch4:ucx, see benchmarks/README.md for what was
measured.
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

CASES_1D = ("S(0)->R", "S(1)->R", "P->R", "P->S(0)", "S(0)->S(1)")
CASES_2X2 = ("[S(0),R]->[R,S(0)]", "[R,S(0)]->[S(0),R]", "[S(0),S(1)]->[R,R]")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mul in (("KB", 2**10), ("MB", 2**20), ("GB", 2**30), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mul)
    return int(s)


def swap_with(comm, local: np.ndarray, peer: int) -> np.ndarray:
    """The bare pairwise exchange: ``local`` sent to and received from ``peer`` by one MPI
    Sendrecv (a copy when the peer is this rank)."""
    out = np.empty_like(local)
    if peer == comm.Get_rank():
        out[...] = local
    else:
        comm.Sendrecv(local, peer, recvbuf=out, source=peer)
    return out


def interleaved(comm, fns: dict, rounds: int, inner: int) -> dict:
    """Median over ``rounds`` of the slowest rank's time per call of each fn, alternating fns
    inside every round (one warm-up call each first)."""
    from mpi4py import MPI

    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(fns.items())[::-1]
        for k, fn in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            t = (time.perf_counter() - t0) / inner
            samples[k].append(comm.allreduce(t, op=MPI.MAX))
    return {k: float(np.median(v)) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["4KB", "64KB", "1MB", "16MB", "64MB"],
                    help="bytes of the local piece per rank")
    ap.add_argument("--cases", nargs="+", default=None, help="subset of the case names")
    ap.add_argument("--rounds", type=int, default=None, help="samples per figure (default by size)")
    args = ap.parse_args()

    from mpi4py import MPI

    dt.init_parallel_env()
    comm = MPI.COMM_WORLD.Dup()
    n, rank = comm.Get_size(), comm.Get_rank()
    mesh = ProcessMesh(list(range(n)))
    cases = list(CASES_1D) + (list(CASES_2X2) if n == 4 else [])
    if args.cases:
        cases = [c for c in cases if c in args.cases]
    mesh2 = ProcessMesh([[0, 1], [2, 3]]) if n == 4 else None
    results: dict = {}
    for size in args.sizes:
        nbytes = parse_size(size)
        side = max(n, int(round((nbytes / 4) ** 0.5)))
        rows = cols = side - side % n  # divisible by n: the bare calls need equal pieces
        piece = dt.to_tensor(np.random.default_rng(rank).standard_normal((rows, cols),
                                                                         dtype=np.float32))
        piece_bytes = rows * cols * 4
        rounds = args.rounds or (31 if piece_bytes <= 2**20 else 15)
        inner = 50 if piece_bytes <= 2**16 else (5 if piece_bytes <= 2**20 else 1)
        row = results.setdefault(size, {"local_shape": [rows, cols], "bytes": piece_bytes})
        for name in cases:
            ours, raw = _case(name, comm, mesh, mesh2, piece, n, rank)
            t = interleaved(comm, {"ours": ours, "raw": raw}, rounds, inner)
            row[name] = {"ours_us": round(t["ours"] * 1e6, 1), "raw_us": round(t["raw"] * 1e6, 1),
                         "ratio_raw_over_ours": round(t["raw"] / t["ours"], 3), "raw": raw.__doc__}
    if rank == 0:
        print(json.dumps({"world_size": n, "dtype": "float32", "results": results}, indent=1),
              flush=True)


def _case(name, comm, mesh, mesh2, piece, n, rank):
    """(our reshard, the bare collective) for case ``name``; both read ``piece``'s buffer."""
    from mpi4py import MPI

    local = piece._local_array()
    rows, cols = local.shape
    S, R, P = Shard, Replicate(), Partial()

    def ours_of(m, src, dst, shape):
        x = dt.dtensor_from_local(piece, m, src, shape=shape)
        return lambda: dt.reshard(x, m, dst)

    def allgather():
        """Allgather"""
        out = np.empty((n * rows, cols), dtype=np.float32)
        comm.Allgather(local, out)
        return out

    def allreduce():
        """Allreduce"""
        out = np.empty_like(local)
        comm.Allreduce(local, out, op=MPI.SUM)
        return out

    def reduce_scatter():
        """Reduce_scatter_block"""
        out = np.empty((rows // n, cols), dtype=np.float32)
        comm.Reduce_scatter_block(local, out, op=MPI.SUM)
        return out

    def alltoall():
        """Alltoall"""
        out = np.empty_like(local)
        comm.Alltoall(local, out)
        return out

    if name == "S(0)->R":
        return ours_of(mesh, [S(0)], [R], (n * rows, cols)), allgather
    if name == "S(1)->R":
        return ours_of(mesh, [S(1)], [R], (rows, n * cols)), allgather
    if name == "P->R":
        return ours_of(mesh, [P], [R], (rows, cols)), allreduce
    if name == "P->S(0)":
        return ours_of(mesh, [P], [S(0)], (rows, cols)), reduce_scatter
    if name == "S(0)->S(1)":
        return ours_of(mesh, [S(0)], [S(1)], (n * rows, cols)), alltoall
    i, j = mesh2.get_coord(rank)
    peer = mesh2.rank_at((j, i))

    def sendrecv():
        return swap_with(comm, local, peer)

    if name == "[S(0),R]->[R,S(0)]":
        return ours_of(mesh2, [S(0), R], [R, S(0)], (2 * rows, cols)), sendrecv
    if name == "[R,S(0)]->[S(0),R]":
        return ours_of(mesh2, [R, S(0)], [S(0), R], (2 * rows, cols)), sendrecv
    if name == "[S(0),S(1)]->[R,R]":
        return ours_of(mesh2, [S(0), S(1)], [R, R], (2 * rows, 2 * cols)), allgather
    raise ValueError(name)


if __name__ == "__main__":
    main()
