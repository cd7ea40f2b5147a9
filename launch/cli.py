"""The launcher: mpiexec over launch.rank_wrapper, then failure reporting (see launch/__init__)."""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

DEFAULT_LOG_DIR = "log"
ABORT_STATUS = 1  # what collectives' excepthook passes to MPI_Abort


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launch",
        description="Run a script on N MPI ranks with per-rank logs and failure reporting.",
        allow_abbrev=False,
    )
    ap.add_argument("--nproc", "-n", type=int, required=True, help="number of ranks")
    ap.add_argument("--log-dir", default=DEFAULT_LOG_DIR,
                    help="per-rank logs go here (default ./log)")
    ap.add_argument("--gpus", action="store_true", help="CUDA_VISIBLE_DEVICES = local rank")
    ap.add_argument("--quiet-others", action="store_true", help="only rank 0 prints to the console")
    ap.add_argument("--mpiexec", default=None, help="mpiexec executable (default: found on PATH)")
    ap.add_argument("--hosts", default=None,
                    help="comma-separated hosts to run on (passed to mpiexec; ranks fill hosts "
                         "in order, GPUs are bound by local rank)")
    ap.add_argument("--hostfile", default=None, help="hostfile passed to mpiexec")
    ap.add_argument("script", help="python script (or executable) to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap


def _read_pair(path: str):
    """(int, time, stopped) from a wrapper's ``<int> <time> [stopped]`` file, or None."""
    try:
        with open(path) as f:
            parts = f.read().split()
        return int(parts[0]), float(parts[1]) if len(parts) > 1 else 0.0, "stopped" in parts
    except (OSError, ValueError, IndexError):
        return None


def _status_of(log_dir: str, rank: int):
    got = _read_pair(os.path.join(log_dir, f"rank_{rank}.exit"))
    return None if got is None else got[0]


def first_nonzero_exit(log_dir: str, nproc: int):
    """(rank, status) of the rank whose recorded non-zero exit came first (ranks that were
    stopped from outside count only when no other rank failed), or None."""
    done = []
    for rank in range(nproc):
        got = _read_pair(os.path.join(log_dir, f"rank_{rank}.exit"))
        if got is not None and got[0] != 0:
            done.append((got[2], got[1], rank, got[0]))
    return (min(done)[2], min(done)[3]) if done else None


def find_failing_rank(log_dir: str, nproc: int):
    """(rank, status) of the rank that failed first, or (None, None).

    First the rank named by the earliest runtime failure report (``[disttensor] job aborted:
    rank K``, recorded by the wrapper in ``rank_k.blame``); then ranks whose log holds a Python
    traceback, ordered by when the wrapper saw it (``rank_k.traceback``), else by the log's
    modification time; failing that, the rank whose non-zero exit was recorded first."""
    blames = []
    for rank in range(nproc):
        got = _read_pair(os.path.join(log_dir, f"rank_{rank}.blame"))
        if got is not None and 0 <= got[0] < nproc:
            blames.append((got[1], got[0]))
    if blames:
        rank = min(blames)[1]
        st = _status_of(log_dir, rank)
        return rank, (st if st else ABORT_STATUS)
    tbs = []
    for rank in range(nproc):
        log = os.path.join(log_dir, f"rank_{rank}.log")
        try:
            with open(log, errors="replace") as f:
                has_tb = "Traceback (most recent call last)" in f.read()
        except OSError:
            continue
        if not has_tb:
            continue
        try:
            with open(os.path.join(log_dir, f"rank_{rank}.traceback")) as f:
                when = float(f.read().strip())
        except (OSError, ValueError):
            when = os.path.getmtime(log)
        tbs.append((when, rank))
    if tbs:
        rank = min(tbs)[1]
        st = _status_of(log_dir, rank)
        return rank, (st if st else ABORT_STATUS)
    return first_nonzero_exit(log_dir, nproc) or (None, None)


def find_mpiexec() -> str | None:
    """The mpiexec installed beside this Python (the mpich wheel puts it there, even when a
    version manager has not made a shim for it yet), else the first one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec") or shutil.which("mpirun")


def host_args(mpiexec: str, hosts: str | None, hostfile: str | None) -> list[str]:
    """mpiexec's options for ``--hosts``/``--hostfile`` (Open MPI spells them differently)."""
    if not hosts and not hostfile:
        return []
    try:
        ver = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    ompi = "Open MPI" in ver or "OpenRTE" in ver
    out = []
    if hosts:
        out += ["--host" if ompi else "-hosts", hosts]
    if hostfile:
        out += ["--hostfile" if ompi else "-f", hostfile]
    return out


def _wait_or_stop(proc: subprocess.Popen, log_dir: str, nproc: int) -> int:
    """Wait for mpiexec; as soon as a rank's recorded status says it failed, stop the job
    (SIGTERM, then SIGKILL after 3 s) instead of waiting for the other ranks."""
    stop_at = None
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        if stop_at is None and first_nonzero_exit(log_dir, nproc) is not None:
            stop_at = time.monotonic() + 3
            proc.send_signal(signal.SIGTERM)
        elif stop_at is not None and time.monotonic() > stop_at:
            proc.kill()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc < 1:
        print("launch: --nproc must be >= 1", file=sys.stderr)
        return 2
    mpiexec = args.mpiexec or find_mpiexec()
    if mpiexec is None:
        print("launch: no mpiexec found on PATH (pip install mpich, or pass --mpiexec)",
              file=sys.stderr)
        return 2
    log_dir = os.path.abspath(args.log_dir)
    os.makedirs(log_dir, exist_ok=True)
    for pat in ("rank_*.log", "rank_*.exit", "rank_*.traceback", "rank_*.blame"):
        for p in glob.glob(os.path.join(log_dir, pat)):
            os.remove(p)

    wrapper = [sys.executable, "-m", "launch.rank_wrapper", "--log-dir", log_dir]
    if args.gpus:
        wrapper.append("--gpus")
    if args.quiet_others:
        wrapper.append("--quiet-others")
    script_args = args.args[1:] if args.args and args.args[0] == "--" else args.args
    cmd = [mpiexec, *host_args(mpiexec, args.hosts, args.hostfile), "-n", str(args.nproc),
           *wrapper, "--", args.script, *script_args]

    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # so ranks find `launch`
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    # Rank lines ("[rank k] ...") stream through live; anything else mpiexec prints (abort banners
    # and the like) is held back and printed after the failing rank's traceback.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    held: list = []
    lock = threading.Lock()

    def pump(stream, out):
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            with lock:
                if line.startswith("[rank "):
                    out.write(line)
                    out.flush()
                else:
                    held.append((out, line))
        stream.close()

    threads = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
    for t in threads:
        t.start()

    def forward(sig, frame):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = _wait_or_stop(proc, log_dir, args.nproc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in threads:
        t.join(timeout=10)

    def flush_held():
        for out, line in held:
            out.write(line)
        sys.stdout.flush()
        sys.stderr.flush()

    rank, status = find_failing_rank(log_dir, args.nproc)
    if rank is None:
        flush_held()
        if rc == 0:
            return 0
        return rc if rc > 0 else 128 - rc
    sys.stdout.flush()
    bar = "=" * 72
    how = f"exit status {status}"
    if status > 128:
        try:
            how += f": killed by signal {status - 128} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    sys.stderr.write(f"\n{bar}\nlaunch: rank {rank} failed ({how}); its log "
                     f"({os.path.join(log_dir, f'rank_{rank}.log')}):\n{bar}\n")
    try:
        with open(os.path.join(log_dir, f"rank_{rank}.log"), errors="replace") as f:
            text = f.read()
        i = text.find("Traceback (most recent call last)")
        sys.stderr.write(text[i:] if i >= 0 else text[-20000:])
    except OSError:
        sys.stderr.write("(no log)\n")
    sys.stderr.write(f"{bar}\n")
    sys.stderr.flush()
    flush_held()
    return status
