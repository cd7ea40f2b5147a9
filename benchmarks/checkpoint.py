"""Distributed checkpoint throughput per rank vs numpy alone, measured in the same run.

    mpiexec -n 4 python benchmarks/checkpoint.py [--mb 64] [--reps 3] [--dir /tmp/...]

Each rank holds ``--mb`` MB of float32 state (four tensors sharded on dim 0 over all ranks, so
every rank writes distinct pieces). Figures, per rank, median over ``--reps``:

* ``save``: ``dt.save_state_dict`` (safetensors per rank, metadata, atomic commit) against the
  baseline that writes the same local arrays with numpy (``ndarray.tofile`` into one file per
  rank, then fsync), barrier-aligned;
* ``load``: ``dt.load_state_dict`` into the same layout against ``numpy.fromfile`` of the
  baseline file;
* ``load_resharded``: loading into the transposed layout (``Shard(1)``), where every rank
  reads a slice of every other rank's file.

MB/s = local bytes / seconds (the slowest rank's time); ``ratio`` = ours / numpy (1.0 = as fast
as numpy). Reads right after writes come from the page cache for both. Rank 0 prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collectives  # noqa: E402
import disttensor as dt  # noqa: E402
from disttensor import Shard  # noqa: E402


def timed(world, fn) -> float:
    world.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = np.array([time.perf_counter() - t0])
    return float(world.all_reduce(elapsed, "max")[0])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="MB of state per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/disttensor-bench-checkpoint")
    args = ap.parse_args(argv)

    world = collectives.init()
    n, rank = world.size, world.rank
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["x"])
    cols = 1024
    rows_local = max(1, int(args.mb * 2**20 / 4 / cols / 4))    # four tensors per rank
    shape = (rows_local * n, cols)
    state = {f"t{i}": dt.dtensor_from_local(
        np.random.default_rng(rank * 10 + i).standard_normal((rows_local, cols))
        .astype(np.float32), mesh, [Shard(0)]) for i in range(4)}
    local = [t.to_local().numpy() for t in state.values()]
    nbytes = sum(a.nbytes for a in local)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    world.barrier()
    ck = os.path.join(args.dir, "ckpt")
    raw = os.path.join(args.dir, f"numpy_{rank}.bin")

    def numpy_write():
        with open(raw, "wb") as f:
            for a in local:
                a.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def numpy_read():
        out = np.fromfile(raw, dtype=np.float32)
        assert out.size * 4 == nbytes

    target = {k: dt.dtensor_from_local(np.zeros((rows_local, cols), np.float32), mesh,
                                       [Shard(0)]) for k in state}
    resharded = {k: dt.dtensor_from_fn(dt.zeros, mesh, [Shard(1)], list(shape))
                 for k in state}

    times: dict[str, list[float]] = {k: [] for k in
                                     ("save", "numpy_write", "load", "numpy_read",
                                      "load_resharded")}
    for i in range(args.reps):
        order = [("save", lambda: dt.save_state_dict(state, ck)),
                 ("numpy_write", numpy_write)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            times[name].append(timed(world, fn))
        order = [("load", lambda: dt.load_state_dict(target, ck)), ("numpy_read", numpy_read)]
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            times[name].append(timed(world, fn))
        times["load_resharded"].append(timed(world, lambda: dt.load_state_dict(resharded, ck)))
    for k in state:   # the loads really read the values
        np.testing.assert_array_equal(target[k].to_local().numpy(), state[k].to_local().numpy())

    med = {k: statistics.median(v) for k, v in times.items()}
    mbps = {k: round(nbytes / 2**20 / s, 1) for k, s in med.items()}
    out = {
        "world_size": n, "bytes_per_rank": nbytes, "reps": args.reps,
        "save_MBps": mbps["save"], "numpy_write_MBps": mbps["numpy_write"],
        "save_ratio": round(med["numpy_write"] / med["save"], 3),
        "load_MBps": mbps["load"], "numpy_read_MBps": mbps["numpy_read"],
        "load_ratio": round(med["numpy_read"] / med["load"], 3),
        "load_resharded_MBps": mbps["load_resharded"],
        "load_resharded_ratio": round(med["numpy_read"] / med["load_resharded"], 3),
    }
    world.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
