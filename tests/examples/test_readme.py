"""Every ``python`` code block of the README runs as written: blocks on a 2x2 mesh under
``mpiexec -n 4``, the others in one process."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from launch import find_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)
ENV = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", range(len(BLOCKS)))
def test_readme_block_runs(k, tmp_path):
    code = BLOCKS[k]
    script = tmp_path / f"block{k}.py"
    script.write_text(code)
    cmd = [sys.executable, str(script)]
    if "[[0, 1], [2, 3]]" in code:
        mpiexec = find_mpiexec()
        assert mpiexec, "mpiexec not found (pip install mpich)"
        cmd = [mpiexec, "-n", "4"] + cmd
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert r.returncode == 0, f"README block {k} failed:\n{code}\n{r.stdout}\n{r.stderr}"
