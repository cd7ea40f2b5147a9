"""The strided shard where metadata leaves the runtime: checkpoints save it and load into it
(resharding on load to and from other layouts), the rank-agreement fingerprint tells it
from the plain shard, and ``visualize_sharding`` draws its ranges."""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

import disttensor as dt
from disttensor import Replicate, Shard
from disttensor.distributed.agreement import RankDisagreementError

pytestmark = pytest.mark.mpi


@pytest.fixture
def ckdir(comm):
    path = comm.bcast(tempfile.mkdtemp(prefix="dt-strided-") if comm.rank == 0 else None)
    yield os.path.join(path, "ckpt")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _mesh() -> dt.ProcessMesh:
    return dt.ProcessMesh(list(range(dt.get_world_size())), dim_names=["x"])


@pytest.mark.parametrize("shape", [(12, 3), (7, 2)], ids=["even", "uneven"])
def test_checkpoint_round_trip_through_other_layouts(ckdir, shape):
    """Saved strided, loaded into Replicate, plain Shard and another factor; saved plain,
    loaded into a strided target: every target holds numpy's values in its own layout."""
    mesh = _mesh()
    G = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    src = dt.shard_tensor(G, mesh, [Shard(0, split_factor=3)])
    dt.save_state_dict({"w": src, "step": 3}, ckdir)
    assert src.placements == [Shard(0, split_factor=3)]  # the saved tensor is unchanged
    for pl in ([Replicate()], [Shard(0)], [Shard(0, split_factor=2)], [Shard(1)],
               [Shard(0, split_factor=3)]):
        t = dt.shard_tensor(np.zeros(shape), mesh, pl)
        state = {"w": t, "step": 0}
        dt.load_state_dict(state, ckdir)
        assert state["w"] is t and t.placements == pl and state["step"] == 3
        np.testing.assert_array_equal(t.numpy(), G)
        np.testing.assert_array_equal(
            t._local_array(), dt.reshard(src, mesh, pl)._local_array())
    dt.save_state_dict({"w": dt.shard_tensor(G, mesh, [Shard(1)]), "step": 4}, ckdir)
    t = dt.shard_tensor(np.zeros(shape), mesh, [Shard(0, split_factor=2)])
    dt.load_state_dict({"w": t, "step": 0}, ckdir)
    np.testing.assert_array_equal(t.numpy(), G)


def test_fingerprint_tells_strided_from_plain():
    """Ranks passing Shard(0) and Shard(0, split_factor=2) disagree, and every rank says so."""
    if dt.get_world_size() < 2:
        pytest.skip("needs 2 ranks")
    mesh = _mesh()
    G = np.arange(26.0).reshape(13, 2)  # a shape of its own: fingerprints are checked once
    pl = [Shard(0, split_factor=2)] if dt.get_rank() == 1 else [Shard(0)]
    with pytest.raises(RankDisagreementError, match=r"split_factor=2"):
        dt.shard_tensor(G, mesh, pl)
    x = dt.shard_tensor(G, mesh, [Shard(0)])
    target = [Shard(0, split_factor=3)] if dt.get_rank() == 0 else [Shard(0, split_factor=2)]
    with pytest.raises(RankDisagreementError, match=r"reshard: ranks disagree"):
        dt.reshard(x, mesh, target)
    np.testing.assert_array_equal(dt.reshard(x, mesh, [Shard(0, split_factor=2)]).numpy(), G)


def test_visualize_sharding_draws_the_ranges():
    if dt.get_world_size() != 2:
        pytest.skip("the picture below is drawn for 2 ranks")
    x = dt.shard_tensor(np.zeros((6, 2)), _mesh(), [Shard(0, split_factor=3)])
    text = dt.visualize_sharding(x, print_=False)
    assert "placements [S(0, split factor 3)]" in text
    assert "| 0    | [0]   | [0:1+2:3+4:5, 0:2] | [3, 2]      | 48    |" in text
    assert "| 1    | [1]   | [1:2+3:4+5:6, 0:2] | [3, 2]      | 48    |" in text
    assert "| rows 2:3 | ranks 0  |" in text and "| rows 5:6 | ranks 1  |" in text
