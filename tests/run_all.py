#!/usr/bin/env python
"""THE test command: the linter, then every suite, single-process and under mpiexec -n 1, 2, 3, 4.

    python tests/run_all.py [-k EXPR] [--np 2,4] [--timeout SECONDS] [extra pytest args...]

0. ``ruff check .`` (the configuration is pyproject.toml's); not with ``-k`` (a selection runs
   tests only) or ``--no-lint``.
1. ``python -m pytest tests`` in one process (tests marked ``@pytest.mark.mpi`` are skipped there
   by pytest-mpi).
2. For each world size n: ``mpiexec -n n python -m pytest --with-mpi -m mpi tests`` with
   single-threaded BLAS/OpenMP. Rank 0 prints to the console; other ranks write to
   ``<results>/np<n>/rank_<k>.out``, printed when that run fails.

Each run is bounded by ``--timeout``; on expiry the run's process group is killed and the test that
each rank was running is printed. The last line is ``N passed, N failed[, N skipped]`` summed over
all runs; the exit status is non-zero if anything failed. ``--results-dir`` keeps the per-rank
output and junit files (default: a fresh temporary directory, printed at the end).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# the repository first: tests/launch must not shadow the launch package
sys.path.insert(0, ROOT)
from launch import find_mpiexec  # noqa: E402

THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _rank_from_env() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def rank_child(outdir: str, pytest_args: list[str]) -> None:
    """Runs inside mpiexec: per-rank junit file, stdout/stderr of ranks > 0 to a file, then
    becomes pytest (exec, so MPI is initialised in the pytest process itself)."""
    rank = _rank_from_env()
    if rank != 0:
        fd = os.open(os.path.join(outdir, f"rank_{rank}.out"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    args = [sys.executable, "-m", "pytest", *pytest_args,
            f"--junitxml={os.path.join(outdir, f'rank_{rank}.xml')}"]
    os.execv(sys.executable, args)


def parse_junit(path: str):
    """(passed, failed, skipped) from a junit xml file, or None if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failures = errors = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failures += int(s.get("failures", 0))
        errors += int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return tests - failures - errors - skipped, failures + errors, skipped


def parse_tally(path: str):
    try:
        with open(path) as f:
            p, f_, s = (int(v) for v in f.read().split())
        return p, f_, s
    except (OSError, ValueError):
        return None


def print_current(status_dir: str) -> None:
    for name in sorted(os.listdir(status_dir)):
        if name.endswith(".current"):
            with open(os.path.join(status_dir, name)) as f:
                print(f"    {name[:-len('.current')]}: {f.read().strip()}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def run_one(label: str, cmd: list[str], env: dict, timeout: float, status_dir: str,
            show_files: list[str] | None = None):
    """Run ``cmd`` in its own process group. Returns (rc, timed_out, seconds)."""
    print(f"\n=== {label}: {' '.join(cmd)}", flush=True)
    os.makedirs(status_dir, exist_ok=True)
    env = dict(env, DISTTENSOR_TEST_STATUS_DIR=status_dir)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"\n!!! {label}: timed out after {timeout:.0f} s; test running on each rank:",
              flush=True)
        print_current(status_dir)
        _kill_group(proc)
        rc = proc.returncode if proc.returncode is not None else -9
    # a killed mpiexec may leave ranks behind in their own sessions: they die with their
    # mpiexec connection; nothing else to do portably.
    return rc, timed_out, time.monotonic() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("-k", dest="k", default=None, help="pytest -k expression")
    ap.add_argument("--np", default="1,2,3,4",
                    help="comma-separated MPI world sizes (default 1,2,3,4; 0 = none)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per run (default 1800; a hung test is named by its own 120 s "
                         "timeout first)")
    ap.add_argument("--no-single", action="store_true", help="skip the single-process run")
    ap.add_argument("--no-lint", action="store_true", help="skip `ruff check .`")
    ap.add_argument("--results-dir", default=None, help="where per-rank output and junit files go")
    ap.add_argument("--mpiexec", default=None, help="mpiexec to use (default: found on PATH)")
    ap.add_argument("--rank-child", default=None, help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]

    if args.rank_child is not None:
        rank_child(args.rank_child, extra)
        return 0  # not reached

    nps = [int(v) for v in args.np.split(",") if v.strip() and int(v) > 0]
    results = args.results_dir or tempfile.mkdtemp(prefix="disttensor-tests-")
    os.makedirs(results, exist_ok=True)
    env = dict(os.environ)
    env.update(THREAD_ENV)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    common = ["-p", "no:cacheprovider", "-q", "-rfEs"]
    if args.k:
        common += ["-k", args.k]
    common += extra

    summary = []  # (label, passed, failed, skipped, note)

    if not (args.k or args.no_lint):
        summary.append(lint())

    if not args.no_single:
        d = os.path.join(results, "single")
        os.makedirs(d, exist_ok=True)
        junit = os.path.join(d, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", TESTS, *common, f"--junitxml={junit}"]
        rc, timed_out, secs = run_one("single process", cmd, env, args.timeout, d)
        summary.append(_tally("single process", rc, timed_out, secs, _counts(junit, d), d))

    mpiexec = args.mpiexec or find_mpiexec()
    for n in nps:
        label = f"mpiexec -n {n}"
        if mpiexec is None:
            summary.append((label, 0, 1, 0, "mpiexec not found"))
            continue
        d = os.path.join(results, f"np{n}")
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            os.remove(os.path.join(d, name))
        pytest_args = [TESTS, "--with-mpi", "-m", "mpi", "--timeout-method=thread", *common]
        cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--rank-child", d,
               "--", *pytest_args]
        rc, timed_out, secs = run_one(label, cmd, env, args.timeout, d)
        row = _tally(label, rc, timed_out, secs, _counts(os.path.join(d, "rank_0.xml"), d), d)
        summary.append(row)
        if row[2]:
            for k in range(1, n):
                path = os.path.join(d, f"rank_{k}.out")
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        text = f.read()
                    print(f"\n----- {label}: output of rank {k} ({path}) -----")
                    print(text[-20000:])

    passed = sum(r[1] for r in summary)
    failed = sum(r[2] for r in summary)
    skipped = sum(r[3] for r in summary)
    print("\n=== summary")
    for label, p, f, s, note in summary:
        print(f"  {label:16s} {p:5d} passed {f:5d} failed {s:5d} skipped  {note}")
    print(f"  results: {results}")
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line, flush=True)
    return 1 if failed else 0


def lint():
    """``ruff check .`` as a summary row: one check, passed or failed."""
    cmd = [sys.executable, "-m", "ruff", "check", "."]
    print(f"\n=== lint: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT).returncode
    except OSError as e:  # pragma: no cover
        print(f"!!! lint: {e}")
        rc = -1
    note = f"({time.monotonic() - t0:.1f} s, exit {rc})"
    return ("ruff check", int(rc == 0), int(rc != 0), 0, note)


def _counts(junit: str, status_dir: str):
    """Counts from rank 0's junit file, else from its running tally (run died early)."""
    return parse_junit(junit) or parse_tally(os.path.join(status_dir, "rank_0.tally"))


def _tally(label, rc, timed_out, secs, counts, status_dir):
    note = f"({secs:.1f} s, exit {rc})"
    if counts is None:
        p, f, s = 0, 0, 0
    else:
        p, f, s = counts
    if timed_out:
        return (label, p, f + 1, s, note + " TIMED OUT")
    if rc not in (0, 5) and f == 0:  # 5: no tests collected
        print(f"\n!!! {label}: exit status {rc} with no failing test recorded; last test started "
              "on each rank:")
        print_current(status_dir)
        return (label, p, 1, s, note + " run failed without a failing test (crash/abort?)")
    return (label, p, f, s, note)


if __name__ == "__main__":
    sys.exit(main())
