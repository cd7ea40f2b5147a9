"""Shared fixture of the checkpoint tests: ``ckdir``, a fresh directory every rank agrees on
(rank 0 makes it and removes it after the test), with the checkpoint path inside it."""
import os
import shutil
import tempfile

import pytest


@pytest.fixture
def ckdir(comm):
    path = comm.bcast(tempfile.mkdtemp(prefix="dt-ckpt-") if comm.rank == 0 else None)
    yield os.path.join(path, "ckpt")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
