"""Always-on checks inside one job (any world size): rank agreement at the entry points,
shard_tensor(src_rank=...), NaN-propagating max/min across ranks, bounded caches. A check that
fails raises the same error on every rank, so the ranks go on together."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import ProcessMesh, Replicate, Shard
from disttensor.distributed.agreement import RankDisagreementError

pytestmark = pytest.mark.mpi


def world_mesh() -> ProcessMesh:
    return ProcessMesh(list(range(dt.get_world_size())), dim_names=["x"])


def odd_rank() -> int:
    return dt.get_world_size() - 1


@pytest.mark.parametrize("what", ["dtype", "shape", "placement"])
def test_shard_tensor_disagreement_raises_on_every_rank(what):
    n = dt.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    mesh = world_mesh()
    # a shape of its own per case: a fingerprint agreed on before is not checked again (a rank
    # diverging from an agreed one is the watchdog's case, see tests/faults/test_fault_matrix)
    # (shapes no other test uses: the suite runs in one process per rank)
    rows = {"dtype": 41, "shape": 43, "placement": 47}[what]
    data, pl = np.arange(3.0 * rows).reshape(rows, 3), [Shard(0)]
    if dt.get_rank() == odd_rank():
        if what == "dtype":
            data = data.astype(np.float32)
        elif what == "shape":
            data = data[:6]
        else:
            pl = [Replicate()]
    with pytest.raises(RankDisagreementError, match=rf"shard_tensor: ranks disagree.*rank\(s\) "
                       rf"\[{odd_rank()}\] differ") as e:
        dt.shard_tensor(data, mesh, pl)
    assert e.value.failing_ranks == [odd_rank()]
    # nothing half-done: the ranks go on together
    x = dt.shard_tensor(np.arange(3.0 * rows).reshape(rows, 3), mesh, [Shard(0)])
    np.testing.assert_array_equal(x.numpy(), np.arange(3.0 * rows).reshape(rows, 3))


def test_reshard_and_from_local_disagreement_raise_on_every_rank():
    n = dt.get_world_size()
    if n == 1:
        pytest.skip("needs two ranks")
    mesh = world_mesh()
    x = dt.shard_tensor(np.ones((n * 2 + 1, 3)), mesh, [Shard(0)])
    target = [Shard(1)] if dt.get_rank() == odd_rank() else [Replicate()]
    with pytest.raises(RankDisagreementError, match=r"(?s)reshard: ranks disagree.*target"):
        dt.reshard(x, mesh, target)
    pl = [Replicate()] if dt.get_rank() == odd_rank() else [Shard(0)]
    with pytest.raises(RankDisagreementError, match=r"dtensor_from_local: ranks disagree"):
        dt.dtensor_from_local(np.ones((2, 3)), mesh, pl)
    np.testing.assert_array_equal(dt.reshard(x, mesh, [Replicate()]).numpy(),
                                  np.ones((n * 2 + 1, 3)))


def test_agreement_is_paid_once_per_fingerprint():
    mesh = world_mesh()
    x = dt.shard_tensor(np.ones((4, 2)), mesh, [Shard(0)])
    dt.reshard(x, mesh, [Replicate()])
    before = dt.cache_info()["agreed_fingerprints"]
    for _ in range(5):
        dt.shard_tensor(np.ones((4, 2)), mesh, [Shard(0)])
        dt.reshard(x, mesh, [Replicate()])
    assert dt.cache_info()["agreed_fingerprints"] == before


def test_the_ranks_of_a_group_keep_and_evict_the_same_fingerprints(monkeypatch):
    """Rank 0 alone agrees on more fingerprints (on a mesh of its own) than the cache holds per
    group; a fingerprint every rank agreed on before is then known to all of them, so using it
    again runs the same collectives everywhere. (One LRU over all groups had evicted it on rank
    0 only, which then checked it alone while the others went on.)"""
    from disttensor.distributed import agreement
    monkeypatch.setattr(agreement, "CACHE_LIMIT", 4)
    n = dt.get_world_size()
    mesh = world_mesh()
    dt.shard_tensor(np.ones((n, 7)), mesh, [Shard(0)])
    if dt.get_rank() == 0:
        for rows in range(1, 7):
            dt.shard_tensor(np.ones((rows, 5)), ProcessMesh([0]), [Replicate()])
    x = dt.shard_tensor(np.ones((n, 7)), mesh, [Shard(0)])
    assert float(x.sum().numpy()) == n * 7


def test_shard_tensor_from_one_rank():
    n = dt.get_world_size()
    mesh = world_mesh()
    src = odd_rank()
    G = np.random.default_rng(7).random((2 * n + 1, 3))
    data = G if dt.get_rank() == src else (None if dt.get_rank() % 2 else np.zeros((5, 5)))
    x = dt.shard_tensor(data, mesh, [Shard(0)], src_rank=src)
    assert x.shape == [2 * n + 1, 3]
    np.testing.assert_array_equal(x.numpy(), G)


def test_max_min_over_sharded_axis_propagate_nan():
    n = dt.get_world_size()
    mesh = world_mesh()
    G = np.random.default_rng(3).standard_normal((3, 4 * n))
    G[1, 4 * n - 1] = np.nan  # in the last rank's piece only
    x = dt.shard_tensor(G, mesh, [Shard(1)])
    for fn, ref in ((dt.max, np.max), (dt.min, np.min)):
        got = fn(x, axis=1).numpy()
        np.testing.assert_array_equal(got, ref(G, axis=1))  # NaN where numpy has NaN
        assert np.isnan(got[1])
    g = collectives.init()
    for op, ref in (("max", np.maximum), ("min", np.minimum)):
        mine = np.arange(5.0) * (g.rank + 1)
        if g.rank == odd_rank():
            mine[2] = np.nan
        expect = np.arange(5.0)
        for r in range(g.size):
            other = np.arange(5.0) * (r + 1)
            if r == odd_rank():
                other[2] = np.nan
            expect = ref(expect, other)
        np.testing.assert_array_equal(g.all_reduce(mine, op), expect)
        np.testing.assert_array_equal(g.all_reduce(mine.astype(np.float16), op),
                                      expect.astype(np.float16))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.mark.timeout(300)
def test_caches_stay_flat_when_an_equal_mesh_is_built_each_step():
    n = dt.get_world_size()
    steps = 10_000 if n == 1 else 2_000
    data = np.arange(8.0 * n).reshape(2 * n, 4)

    def step():
        mesh = ProcessMesh([list(range(n))], dim_names=["dp", "mp"]).get_mesh_with_dim("mp")
        x = dt.shard_tensor(data, mesh, [Shard(0), Replicate()])
        y = dt.reshard(x * 2.0, mesh, [Replicate(), Replicate()])
        return y.sum()

    for _ in range(steps // 10):
        step()
    sizes, rss = dt.cache_info(), _rss_kb()
    for _ in range(steps):
        last = step()
    assert dt.cache_info() == sizes
    assert float(last.numpy()) == 2 * data.sum()
    assert _rss_kb() - rss < 4096, f"RSS grew by {_rss_kb() - rss} KB over {steps} steps"


def test_plan_cache_is_a_bounded_lru(monkeypatch):
    from disttensor import dispatch
    monkeypatch.setattr(dispatch, "PLAN_CACHE_LIMIT", 16)
    dispatch.clear_plan_cache()
    mesh = world_mesh()
    n = dt.get_world_size()
    hot = dt.shard_tensor(np.ones((n, 2)), mesh, [Shard(0)])
    for rows in range(1, 40):  # 39 distinct shapes, each a new plan
        x = dt.shard_tensor(np.ones((n * rows, 2)), mesh, [Shard(0)])
        (x + 1.0).sum()
        (hot + 1.0).sum()  # used every time: stays cached
        assert dt.cache_info()["plans"] <= 16
    keys = list(dispatch._PLANS)
    assert any(k[2][0][0] == (n, 2) for k in keys)  # the hot plan survived (LRU, not FIFO)
