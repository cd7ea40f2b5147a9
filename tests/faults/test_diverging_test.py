"""A test that fails on some ranks only must not hang the MPI test run (tests/conftest.py's
verdict exchange): the ranks that fail leave the test while the others wait in its next
collective; the job ends within the verdict wait with one report naming the test, the ranks that
never finished it and the failure the others saw."""
import os
import re
import subprocess
import sys

import pytest

from launch import find_mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = find_mpiexec()
UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "PMIX_RANK"))

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job; run outside MPI"),
]


def test_a_test_failing_on_some_ranks_ends_the_job_with_a_report(tmp_path):
    wait = 3
    env = dict(os.environ, DISTTENSOR_TEST_VERDICT_WAIT=str(wait), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DISTTENSOR_TEST_STATUS_DIR", None)
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "pytest", "--with-mpi", "-m", "mpi", "-q",
           "-p", "no:cacheprovider", "--timeout-method=thread",
           os.path.join(HERE, "diverging_case.py")]
    # the job ends soon after the wait, long before pytest's 120 s per-test timeout: a hang
    # is caught by the subprocess timeout
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=90, env=env, cwd=ROOT)
    assert r.returncode != 0, r.stdout
    lines = re.findall(r"\[disttensor\] job aborted: rank\(s\) .*", r.stdout)
    assert len(lines) == 1, r.stdout
    assert re.search(r"rank\(s\) \[0, 3\] did not finish test \S*diverging_case.py::test_diverges "
                     r"within 3 s .* of rank\(s\) \[1, 2\]", lines[0]), lines[0]
    assert "rank 1 failed: AssertionError: planted failure on ranks 1 and 2" in lines[0]
    assert "rank 2 failed: AssertionError: planted failure on ranks 1 and 2" in lines[0]
