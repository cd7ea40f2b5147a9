"""Every ``python`` code block of the README runs as it is at 4 ranks, the size the README's
meshes are written for (each in a fresh namespace; the checkpoint block writes to a temporary
directory instead of /tmp/ckpt_demo)."""
import os
import re
import shutil
import tempfile

import pytest

import collectives

pytestmark = pytest.mark.mpi

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _blocks():
    with open(README) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_blocks_run(comm):
    if collectives.init().size != 4:
        pytest.skip("the README's meshes are 2 x 2")
    blocks = _blocks()
    assert len(blocks) >= 8
    tmp = comm.bcast(tempfile.mkdtemp(prefix="dt-readme-") if comm.rank == 0 else None)
    try:
        for code in blocks:
            exec(compile(code.replace("/tmp/ckpt_demo", os.path.join(tmp, "ckpt")),
                         "README.md", "exec"), {})
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
