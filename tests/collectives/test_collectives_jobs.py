"""Whole-job behaviour, run as `mpiexec -n 2` subprocesses so the test process itself is safe:
debug-mode mismatch raising on every rank, and one failing rank ending the job quickly."""
import os
import subprocess
import sys
import textwrap

import pytest

import collectives
from launch import find_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = find_mpiexec()

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(collectives.is_mpi(), reason="starts its own mpiexec job; run outside MPI"),
]


def run_job(tmp_path, code, n=2, timeout=60, env=None):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    e = dict(os.environ, OMP_NUM_THREADS="1",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script)], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=str(tmp_path))


@pytest.mark.parametrize("debug", ["0", "1"])
def test_mismatch_raises_same_error_on_every_rank(tmp_path, debug):
    """Ranks in calls of different byte counts or kinds: the collective headers raise the
    same error on every rank, naming both calls and their call sites, before any data moves
    (with or without the debug mode's agreement check); a caught error leaves the group
    usable."""
    r = run_job(tmp_path, """
        import numpy as np, collectives
        g = collectives.init()
        g.all_reduce(np.ones(3))                      # agreeing call: fine
        x = np.ones(3 + g.rank)                       # shapes disagree
        try:
            g.all_reduce(x)
        except collectives.CollectiveMismatchError as e:
            open(f"err_{g.rank}.txt", "w").write(str(e))
        else:
            open(f"noerr_{g.rank}.txt", "w").write("no error")
        g.barrier()
        try:                                          # different collectives
            g.barrier() if g.rank == 0 else g.broadcast(np.ones(2))
        except collectives.CollectiveMismatchError as e:
            open(f"caught2_{g.rank}.txt", "w").write(str(e))
        print("DONE", flush=True)
    """, env={"DISTTENSOR_CHECK_COLLECTIVES": debug})
    assert r.returncode == 0 and "DONE" in r.stdout, r.stdout + r.stderr
    assert not list(tmp_path.glob("noerr_*"))
    assert sorted(p.name for p in tmp_path.glob("caught2_*")) == ["caught2_0.txt", "caught2_1.txt"]
    c0 = (tmp_path / "caught2_0.txt").read_text()
    assert c0 == (tmp_path / "caught2_1.txt").read_text()
    assert "rank 0: barrier() call #3" in c0 and "rank 1: broadcast(shape=(2,)" in c0, c0
    e0 = (tmp_path / "err_0.txt").read_text()
    e1 = (tmp_path / "err_1.txt").read_text()
    assert e0 == e1
    assert "as call #1; no data was exchanged" in e0, e0
    assert "rank 0: all_reduce(shape=(3,)" in e0 and "rank 1: all_reduce(shape=(4,)" in e0, e0
    assert e0.count("job.py:7 in <module>") == 2, e0


def test_one_rank_raises_while_others_block_ends_quickly(tmp_path):
    r = run_job(tmp_path, """
        import numpy as np, collectives, time
        g = collectives.init()
        if g.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("boom on rank 1")
        g.all_reduce(np.ones(4))                      # rank 0 blocks here forever without abort
        print("UNREACHABLE", flush=True)
    """, timeout=60)
    assert r.returncode != 0
    assert "RuntimeError: boom on rank 1" in r.stderr
    assert "UNREACHABLE" not in r.stdout


def test_watchdog_covers_a_nonblocking_all_reduce(tmp_path):
    """A rank that never starts the all-reduce: the other one, blocked where it starts it
    (until every member has posted the call's header), is aborted past the timeout with a
    report naming iall_reduce, its call site, and where the missing rank is."""
    r = run_job(tmp_path, """
        import numpy as np, collectives, time
        g = collectives.init()
        h = g.iall_reduce(np.ones(4)) if g.rank == 0 else None
        if g.rank == 1:
            time.sleep(30)
        h.wait()                                      # line 7
        print("UNREACHABLE", flush=True)
    """, timeout=60, env={"DISTTENSOR_TIMEOUT": "2"})
    assert r.returncode != 0
    err = r.stderr
    assert "job aborted: rank 1 did not arrive" in err, err
    assert "iall_reduce(shape=(4,), dtype=<f8, op=sum) call #0" in err, err
    assert "called from job.py:4" in err.replace(str(tmp_path) + "/", ""), err
    assert "rank 1: outside any collective, at " in err and "job.py:6" in err, err
    assert "UNREACHABLE" not in r.stdout


def test_nonblocking_against_blocking_all_reduce_is_reported(tmp_path):
    """One rank starts a nonblocking all-reduce where the other calls the blocking one: MPI
    does not match them, and the watchdog's probe names both calls."""
    r = run_job(tmp_path, """
        import numpy as np, collectives
        g = collectives.init()
        if g.rank == 0:
            g.iall_reduce(np.ones(4)).wait()
        else:
            g.all_reduce(np.ones(4))
        print("UNREACHABLE", flush=True)
    """, timeout=60)
    assert r.returncode != 0
    assert "called a different collective than other ranks" in r.stderr, r.stderr
    assert "iall_reduce(shape=(4,)" in r.stderr and "all_reduce(shape=(4,)" in r.stderr
    assert "UNREACHABLE" not in r.stdout
