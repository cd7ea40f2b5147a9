"""What the per-rank death watcher (collectives/_watcher.py) costs a normal job, same run.

    python benchmarks/watcher.py [--np 4] [--reps 10]

Runs a short clean job (``import collectives``, ``init()``, one ``all_reduce``, exit) under
``mpiexec -n NP`` with the watcher (default) and without it (``DISTTENSOR_WATCHER=0``),
alternating which goes first, and reports the median wall time of each and their ratio
(``ratio`` = with / without; 1.0 = no cost). While a rank runs its watcher sleeps in ``read``,
so this start-and-exit cost is all it adds. Also counts watcher processes left afterwards
(must be 0). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launch import find_mpiexec  # noqa: E402

JOB = ("import numpy as np, collectives as C; g = C.init(); "
       "assert g.all_reduce(np.ones(4), 'sum')[0] == g.size")


MARK = f"DISTTENSOR_BENCH_WATCHER={os.getpid()}"  # in our jobs' environment, so their watchers'


def watchers() -> int:
    """Watcher processes of this benchmark's jobs still running."""
    script = os.path.join(ROOT, "collectives", "_watcher.py").encode()
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f, \
                        open(f"/proc/{name}/environ", "rb") as e:
                    n += script in f.read() and MARK.encode() in e.read().split(b"\0")
            except OSError:
                pass
    return n


def one(mpiexec: str, nproc: int, watcher: bool) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", **dict([MARK.split("=")]),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not watcher:
        env["DISTTENSOR_WATCHER"] = "0"
    t0 = time.perf_counter()
    subprocess.run([mpiexec, "-n", str(nproc), sys.executable, "-c", JOB], env=env, check=True,
                   timeout=120)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    mpiexec = find_mpiexec()
    one(mpiexec, args.np, True)  # warm-up (page cache)
    times = {True: [], False: []}
    for i in range(args.reps):
        for w in ((True, False) if i % 2 else (False, True)):
            times[w].append(one(mpiexec, args.np, w))
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    print(json.dumps({
        "np": args.np, "reps": args.reps,
        "job_s_with_watcher": round(with_, 4), "job_s_without": round(without, 4),
        "ratio": round(with_ / without, 4), "watchers_left": watchers(),
    }, indent=2))


if __name__ == "__main__":
    main()
