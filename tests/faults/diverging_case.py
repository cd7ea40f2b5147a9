"""Run by tests/faults/test_diverging_test.py under ``mpiexec -n 4 python -m pytest --with-mpi``
(not collected by the suite: the name does not start with ``test_``). In ``test_diverges``
ranks 1 and 2 fail an assertion and leave while ranks 0 and 3 wait in the reshard after it."""
import numpy as np
import pytest

import disttensor as dt
from disttensor import ProcessMesh, Replicate, Shard


@pytest.mark.mpi
def test_agrees(comm):
    assert comm.Get_size() == 4


@pytest.mark.mpi
def test_diverges(comm):
    mesh = ProcessMesh(list(range(comm.Get_size())), dim_names=["x"])
    x = dt.shard_tensor(dt.to_tensor(np.ones((8, 4), np.float32)), mesh, [Shard(0)])
    assert comm.Get_rank() not in (1, 2), "planted failure on ranks 1 and 2"
    y = dt.reshard(x, mesh, [Replicate()])
    np.testing.assert_array_equal(y.numpy(), np.ones((8, 4), np.float32))
