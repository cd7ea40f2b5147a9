"""The single-process group (program not started under MPI): every method works locally."""
import os

import numpy as np
import pytest

import collectives
from collectives import _common
from collectives.group import LocalGroup

pytestmark = pytest.mark.skipif(
    collectives.is_mpi(), reason="single-process group tests run outside mpiexec"
)


@pytest.fixture
def g():
    return collectives.init()


def test_init_is_local_and_idempotent(g):
    assert isinstance(g, LocalGroup) and isinstance(g, collectives.ProcessGroup)
    assert (g.rank, g.size, g.ranks) == (0, 1, (0,))
    assert collectives.init() is g and collectives.world() is g
    assert collectives.get_rank() == 0 and collectives.get_world_size() == 1
    assert collectives.new_group([0]) is g


def test_local_collectives_are_copies(g):
    x = np.arange(12.0).reshape(3, 4)
    for y in (
        g.all_reduce(x, "sum"),
        g.all_reduce(x, "avg"),
        g.all_gather(x, axis=1),
        g.all_gather(x, axis=0, sizes=[3]),
        g.reduce_scatter(x, "max", axis=1),
        g.all_to_all(x, 0, 1),
        g.all_to_all(x, 1, 1, recv_sizes=[4]),
        g.broadcast(x, src=0),
        g.sendrecv(x, 0),
    ):
        np.testing.assert_array_equal(y, x)
        assert y is not x
    out = np.empty_like(x)
    assert g.all_reduce(x, out=out) is out
    g.send(x, 0)
    np.testing.assert_array_equal(g.recv((3, 4), np.float64, 0), x)
    g.barrier()


def test_local_iall_reduce_is_complete_at_once(g):
    x = np.arange(6.0)
    before = collectives.collective_counts()["all_reduce"]
    h = g.iall_reduce(x, "avg")
    assert h.test() and h.wait() is x
    np.testing.assert_array_equal(x, np.arange(6.0))
    assert collectives.collective_counts()["all_reduce"] == before + 1


def test_local_errors_and_counts(g):
    collectives.reset_collective_counts()
    x = np.ones((2, 3), np.int64)
    with pytest.raises(TypeError,
                       match="all_reduce: reduce op 'avg' is not supported for dtype int64"):
        g.all_reduce(x, "avg")
    with pytest.raises(ValueError, match=r"axis'=5 is out of range .*\(2, 3\)"):
        g.all_gather(x, axis=5)
    with pytest.raises(ValueError, match="src'=1 is out of range for a group of size 1"):
        g.broadcast(x, src=1)
    with pytest.raises(ValueError, match=r"caller \(global rank 0\) is not in ranks|out of range"):
        collectives.new_group([1])
    with pytest.raises(RuntimeError, match="no message from oneself"):
        g.recv((1,), np.float64, 0, tag=99)
    g.all_reduce(x, "max")
    counts = collectives.collective_counts()
    assert counts["all_reduce"] == 1 and counts["all_gather"] == 0 and counts["recv"] == 1


def test_op_normalisation():
    import enum

    class RT(str, enum.Enum):
        AVG = "avg"

    assert _common.normalize_op(RT.AVG, "x") == "avg"
    assert _common.normalize_op("SUM", "x") == "sum"
    assert _common.normalize_op("ReduceType.MAX", "x") == "max"
    with pytest.raises(ValueError, match="unsupported reduce op"):
        _common.normalize_op("mean", "x")
    assert _common.split_sizes(2, 4) == [1, 1, 0, 0]
    assert _common.split_sizes(7, 3) == [3, 2, 2]


def test_no_mpi_env_means_no_mpi():
    assert not any(v in os.environ for v in collectives._MPI_ENV_VARS)
