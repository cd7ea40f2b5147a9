"""Collectives on dense tensors with paddle.distributed's signatures, over the world and over a
group (non-members return at once)."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import ReduceOp

pytestmark = pytest.mark.mpi


def world():
    return collectives.init()


def values(r):
    return np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 1) - r


def test_all_reduce_in_place_on_tensors_and_arrays():
    n, r = world().size, world().rank
    allv = np.stack([values(k) for k in range(n)])
    for op, ref in ((ReduceOp.SUM, allv.sum(0)), (ReduceOp.MAX, allv.max(0)),
                    (ReduceOp.MIN, allv.min(0)), (ReduceOp.AVG, allv.mean(0)),
                    (ReduceOp.PROD, allv.prod(0))):
        t = dt.to_tensor(values(r))
        ver = t.inplace_version
        assert dt.all_reduce(t, op) is None
        np.testing.assert_allclose(t.numpy(), ref, rtol=1e-12)
        assert t.inplace_version > ver, "written in place"
        a = values(r)
        dt.all_reduce(a, op)
        np.testing.assert_allclose(a, ref, rtol=1e-12)
    ints = dt.to_tensor(np.array([r, 1]))
    dt.all_reduce(ints)
    assert ints.dtype == np.int64 and ints.numpy().tolist() == [n * (n - 1) // 2, n]


def test_all_gather_broadcast_reduce_scatter_barrier():
    n, r = world().size, world().rank
    out = []
    dt.all_gather(out, dt.to_tensor(values(r)))
    assert len(out) == n
    for k in range(n):
        np.testing.assert_array_equal(out[k].numpy(), values(k))
    dt.all_gather(out, dt.to_tensor(values(r) * 2))   # a full list is written in place
    np.testing.assert_array_equal(out[n - 1].numpy(), values(n - 1) * 2)

    t = dt.to_tensor(values(r))
    dt.broadcast(t, src=n - 1)
    np.testing.assert_array_equal(t.numpy(), values(n - 1))

    parts = [dt.to_tensor(values(r) + 10 * k) for k in range(n)]
    res = dt.zeros([2, 3], dtype="float64")
    dt.reduce_scatter(res, parts)
    np.testing.assert_allclose(res.numpy(), sum(values(k) for k in range(n)) + 10 * r * n)
    dt.barrier()


def test_groups_and_non_members():
    n, r = world().size, world().rank
    if n < 2:
        pytest.skip("needs 2 ranks")
    members = list(range(n - 1))               # every rank but the last
    g = dt.new_group(members)
    assert g.is_member() == (r in members) and g.nranks == n - 1
    assert g.get_group_rank(n - 1) == -1
    t = dt.to_tensor(values(r))
    dt.all_reduce(t, group=g)
    want = sum(values(k) for k in members) if r in members else values(r)
    np.testing.assert_allclose(t.numpy(), want)
    if g.is_member():    # a non-member returns at once, as in Paddle
        with pytest.raises(ValueError, match=f"src rank {n - 1} is not in the group"):
            dt.broadcast(t, src=n - 1, group=g)
    dt.barrier(group=g)


def test_bad_input():
    mesh = dt.ProcessMesh(list(range(world().size)))
    with pytest.raises(TypeError, match="distributed tensor"):
        dt.all_reduce(dt.shard_tensor(np.ones(4), mesh, [dt.Shard(0)]))
    with pytest.raises(ValueError, match="op must be a ReduceOp"):
        dt.all_reduce(dt.to_tensor([1.0]), op="sum")
    with pytest.raises(ValueError, match="tensor_list has"):
        dt.reduce_scatter(dt.zeros([2]), [dt.zeros([2])] * (world().size + 1))
    with pytest.raises(ValueError, match="distinct ranks of the world"):
        dt.new_group([0, 0])
    with pytest.raises(TypeError, match="must be a dense Tensor or a numpy/cupy array"):
        dt.broadcast([1, 2], src=0)
