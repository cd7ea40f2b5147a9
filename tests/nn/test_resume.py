"""Resume across world sizes: 10 steps at 4 ranks, 5 at 2, 5 at 1 (each loading the previous
checkpoint the README's way) give the loss curve of 20 uninterrupted steps, bitwise; the
optimizer's states (ZeRO-1 sharded), its schedule and the model come back exactly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import find_mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = find_mpiexec()
UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "PMIX_RANK"))

pytestmark = [pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
              pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec jobs")]


def _job(n: int, path, first: int, last: int, load: bool) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, os.path.join(HERE, "resume_job.py"),
           str(path), str(first), str(last)] + (["load"] if load else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [s for s in r.stdout.splitlines() if s.startswith("LOSSES")]
    assert len(line) == 1, r.stdout
    return line[0].split()[1:]


def test_resume_4_2_1_equals_uninterrupted(tmp_path):
    straight = _job(1, tmp_path / "straight", 0, 20, load=False)
    resumed = (_job(4, tmp_path / "ckpt", 0, 10, load=False)
               + _job(2, tmp_path / "ckpt", 10, 15, load=True)
               + _job(1, tmp_path / "ckpt", 15, 20, load=True))
    assert len(straight) == 20
    assert resumed == straight                      # repr of every float: bitwise
