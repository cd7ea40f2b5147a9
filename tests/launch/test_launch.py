"""`python -m launch` end to end (each test starts its own small mpiexec job)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from launch import find_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = find_mpiexec()
UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "PMIX_RANK"))

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job; run outside MPI"),
]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def launch(tmp_path, code, *opts, nproc=2, args=(), timeout=60):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "launch", "--nproc", str(nproc), "--log-dir", str(logs), *opts,
           str(script), *args]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, env=_env(), cwd=str(tmp_path))
    return r, logs


def test_logs_prefixes_and_args(tmp_path):
    r, logs = launch(tmp_path, """
        import os, sys
        rank = os.environ["PMI_RANK"]
        print(f"out {rank} {sys.argv[1:]}")
        print(f"err {rank}", file=sys.stderr)
        print(f"cvd={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    """, "--gpus", args=("--lr", "0.1"))
    assert r.returncode == 0, r.stdout
    for k in range(2):
        text = (logs / f"rank_{k}.log").read_text()
        assert f"out {k} ['--lr', '0.1']" in text and f"err {k}" in text
        assert f"cvd={k}" in text  # one local rank per GPU with --gpus
        assert f"[rank {k}] out {k}" in r.stdout and f"[rank {k}] err {k}" in r.stdout


def test_quiet_others(tmp_path):
    r, logs = launch(tmp_path, """
        import os
        print("line from", os.environ["PMI_RANK"])
    """, "--quiet-others", nproc=3)
    assert r.returncode == 0
    assert "[rank 0] line from 0" in r.stdout
    assert "[rank 1]" not in r.stdout and "[rank 2]" not in r.stdout
    assert "line from 2" in (logs / "rank_2.log").read_text()


def test_exit_status_of_failing_rank(tmp_path):
    r, logs = launch(tmp_path, """
        import os, sys
        print("bye")
        sys.exit(3 if os.environ["PMI_RANK"] == "1" else 0)
    """)
    assert r.returncode == 3, r.stdout
    assert "launch: rank 1 failed (exit status 3)" in r.stdout


def test_raising_rank_aborts_job_and_traceback_comes_first(tmp_path):
    r, logs = launch(tmp_path, """
        import time, numpy as np, collectives
        g = collectives.init()
        if g.rank == 1:
            time.sleep(0.5)
            raise ValueError("rank one is broken")
        g.all_reduce(np.ones(3))   # the other ranks block here
        print("UNREACHABLE")
    """, nproc=3)  # a job that hung instead would run into launch()'s timeout and fail
    # the excepthook calls MPI_Abort(1): the job's status is the abort code, 1
    assert r.returncode == 1, r.stdout
    out = r.stdout
    assert "UNREACHABLE" not in out
    first_tb = out.index("Traceback (most recent call last)")
    line = out[:first_tb].rsplit("\n", 1)[-1]
    assert line == "[rank 1] " or out[first_tb:].startswith("Traceback"), out
    assert "launch: rank 1 failed" in out
    block = out[out.index("launch: rank 1 failed"):]
    assert "ValueError: rank one is broken" in block
    assert "ValueError: rank one is broken" in (logs / "rank_1.log").read_text()


def test_plain_mpiexec_failure_does_not_hang(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, collectives
        g = collectives.init()
        if g.rank == 0:
            raise KeyError("rank zero")
        g.barrier()
    """))
    # a hang runs into the timeout (subprocess.TimeoutExpired fails the test)
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True,
                       timeout=60, env=_env())
    assert r.returncode != 0 and "KeyError: 'rank zero'" in r.stderr


def test_sigterm_is_forwarded(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent("""
        import signal, sys, time, os
        def on_term(sig, frame):
            print("got signal", sig, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        print("ready", flush=True)
        time.sleep(60)
    """))
    logs = tmp_path / "logs"
    p = subprocess.Popen([sys.executable, "-m", "launch", "--nproc", "2", "--log-dir", str(logs),
                          str(script)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all((logs / f"rank_{k}.log").exists() and "ready" in (logs / f"rank_{k}.log").read_text()
               for k in range(2)):
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert any("got signal" in (logs / f"rank_{k}.log").read_text() for k in range(2)), out


def test_hosts_are_passed_to_mpiexec_and_gpus_bound_by_local_rank(tmp_path):
    """The multi-node path on one machine: the same host given twice."""
    r, logs = launch(tmp_path, """
        import os
        print("env", os.environ["PMI_RANK"], os.environ.get("MPI_LOCALRANKID", os.environ.get(
            "OMPI_COMM_WORLD_LOCAL_RANK")), os.environ["CUDA_VISIBLE_DEVICES"])
    """, "--hosts", "localhost,localhost", "--gpus", nproc=2)
    assert r.returncode == 0, r.stdout
    for k in range(2):
        line = next(x for x in (logs / f"rank_{k}.log").read_text().splitlines()
                    if x.startswith("env"))
        _, rank, local, cuda = line.split()
        assert rank == str(k) and cuda == local, line


def test_launcher_stops_the_job_when_a_rank_fails_without_mpi(tmp_path):
    """A rank that exits non-zero while the others keep running (no MPI involved): the launcher
    stops the job at once and blames that rank."""
    r, logs = launch(tmp_path, """
        import os, sys, time
        if os.environ["PMI_RANK"] == "1":
            sys.exit(5)
        time.sleep(600)
    """, nproc=3)  # waiting for the sleeping ranks would run into launch()'s timeout (60 s)
    assert r.returncode == 5 and "launch: rank 1 failed (exit status 5)" in r.stdout, r.stdout
