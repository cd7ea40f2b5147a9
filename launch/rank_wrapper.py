"""Per-rank wrapper started by ``python -m launch`` under mpiexec (one per rank).

    python -m launch.rank_wrapper --log-dir DIR [--gpus] [--quiet-others] -- script.py args...

Runs ``python script.py args...`` as a child that inherits the MPI/PMI environment (so the child
is the MPI rank; this wrapper never initialises MPI). The child's stdout and stderr go straight
into ``DIR/rank_<k>.log`` (complete even if the wrapper is killed by an MPI abort); the wrapper
tails that file to its own stdout with a ``[rank k] `` prefix (so on the console both streams
arrive on stdout), forwards SIGINT/SIGTERM to the child, and exits with the child's status.
It also writes

- ``DIR/rank_<k>.exit``: the child's exit status (128+N for death by signal N), the time, and
  ``stopped`` when the wrapper had forwarded SIGINT/SIGTERM to it (the job was being stopped),
- ``DIR/rank_<k>.traceback``: the time the child first printed a Python traceback,
- ``DIR/rank_<k>.blame``: the rank named by the child's first ``[disttensor] job aborted: rank
  K`` report (the runtime's failure reports name the rank to blame) and the time,

which the launcher uses to find the rank that failed first. While the child runs, the wrapper
notes the MPI library's shared-memory files it maps, and removes them when it ends (an
aborted or killed job would leave them in /dev/shm; after MPI_Finalize they are gone already).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

_BLAME = re.compile(r"\[disttensor\] job aborted: rank (\d+)")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_LOCAL_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def _env_int(names, default=0) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


def _die_with_parent():
    """Child dies if the wrapper is killed (e.g. SIGKILL from mpiexec after an MPI abort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


def _segment_tools():
    """collectives/_watcher.py loaded from its file: importing the collectives package would
    install the rank's failure hooks in this wrapper."""
    import importlib.util

    spec = importlib.util.find_spec("collectives")
    path = os.path.join(os.path.dirname(spec.origin), "_watcher.py")
    mod_spec = importlib.util.spec_from_file_location("_disttensor_watcher", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.rank_wrapper", allow_abbrev=False)
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--gpus", action="store_true")
    ap.add_argument("--quiet-others", action="store_true")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        ap.error("no script given")

    rank = _env_int(_RANK_VARS)
    local_rank = _env_int(_LOCAL_VARS)
    env = dict(os.environ)
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["DISTTENSOR_WATCHER"] = "0"  # this wrapper reports a rank that dies outside Python
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, f"rank_{rank}.log")
    tb_marker = os.path.join(args.log_dir, f"rank_{rank}.traceback")
    console = not (args.quiet_others and rank != 0)
    prefix = f"[rank {rank}] "

    if cmd[0].endswith(".py"):
        cmd = [sys.executable] + cmd
    # The child writes straight into the log file (stdout and stderr, O_APPEND), so the log is
    # complete even if this wrapper is killed (mpiexec kills everything after an MPI abort);
    # the console copy is produced by tailing that file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    # close_fds=False: the PMI connection fd (PMI_FD) must reach the child
    child = subprocess.Popen(cmd, env=env, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL,
                             close_fds=False, preexec_fn=_die_with_parent)
    os.close(fd)

    forwarded = []

    def forward(sig, frame):
        forwarded.append(sig)
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    seen_tb = seen_blame = False
    pending = b""
    # the child's MPI files, read from its maps at growing intervals (MPI's init makes them)
    tools, segments, look_at, interval = _segment_tools(), set(), time.monotonic() + 0.2, 0.2
    with open(log_path, "rb") as f:
        while True:
            chunk = f.read(65536)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if not seen_tb and line.startswith("Traceback (most recent call last)"):
                        seen_tb = True
                        with open(tb_marker, "w") as m:
                            m.write(f"{time.time():.6f}\n")
                    blame = None if seen_blame else _BLAME.match(line)
                    if blame:
                        seen_blame = True
                        with open(os.path.join(args.log_dir, f"rank_{rank}.blame"), "w") as m:
                            m.write(f"{blame.group(1)} {time.time():.6f}\n")
                    if console:
                        sys.stdout.write(prefix + line + "\n")
                if console and lines:
                    sys.stdout.flush()
                continue
            rc = child.poll()
            if rc is not None:
                chunk = f.read()
                if chunk:
                    pending += chunk
                    continue
                break
            if time.monotonic() > look_at:
                segments.update(tools.mpi_segments(child.pid))
                interval = min(2 * interval, 5.0)
                look_at = time.monotonic() + interval
            time.sleep(0.02)
    tools.remove_segments(segments)
    if pending and console:
        sys.stdout.write(prefix + pending.decode(errors="replace") + "\n")
        sys.stdout.flush()
    status = rc if rc >= 0 else 128 - rc
    with open(os.path.join(args.log_dir, f"rank_{rank}.exit"), "w") as f:
        # "stopped": the child's end was asked for from outside (mpiexec tearing the job down)
        f.write(f"{status} {time.time():.6f}{' stopped' if forwarded else ''}\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
