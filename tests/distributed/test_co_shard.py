"""Co-sharding on a 2x2 mesh (4 ranks): the split order of a co-sharded dim
(``Shard(d, shard_order=k)``) carried through ops, printing and agreement, and the elementwise
rule's co-sharded output (``[S(0),R] + [S(1),R] -> [S(0),S(0)]`` for the one all-to-all the
2-way answer also needs). Values and gradients against numpy, collectives counted."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor.distributed.agreement import RankDisagreementError
from spmd_rules import DistAttr, ProcessMesh, Replicate, Shard, local_slices

pytestmark = pytest.mark.mpi

TP_FIRST = [Shard(0, shard_order=1), Shard(0, shard_order=0)]


def mesh2x2() -> ProcessMesh:
    if dt.get_world_size() != 4:
        pytest.skip("needs 4 ranks (a 2x2 mesh)")
    return ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def data(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).integers(-5, 6, size=shape).astype(np.float64)


def moved(before: dict) -> dict:
    after = collectives.collective_counts()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def holds(x: dt.Tensor, G: np.ndarray) -> None:
    """This rank's piece of ``x`` is ``G`` cut by x's layout (nested array_split in order)."""
    mesh = x.process_mesh
    attr = DistAttr.from_placements(x.placements, G.ndim, mesh.shape)
    coord = mesh.get_coord(dt.get_rank())
    np.testing.assert_array_equal(x._local_array(), G[local_slices(G.shape, attr, coord)])


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)], ids=["even", "uneven"])
def test_add_of_conflicting_shards_gives_a_co_sharded_output(shape):
    """x [S(0),R] + y [S(1),R]: y moves by one all-to-all on mesh dim 0 and mesh dim 1 (free)
    co-shards dim 0 by a local slice: the output is 4-way sharded for the all-to-all alone;
    a later op reads it; the gradients arrive in the leaves' own layouts."""
    mesh = mesh2x2()
    X, Y, W = data(shape, 1), data(shape, 2), data(shape, 3)
    x = dt.shard_tensor(X, mesh, [Shard(0), Replicate()], stop_gradient=False)
    y = dt.shard_tensor(Y, mesh, [Shard(1), Replicate()], stop_gradient=False)
    before = collectives.collective_counts()
    z = x + y
    assert moved(before) == {"all_to_all": 1}
    assert z.placements == [Shard(0), Shard(0)]
    holds(z, X + Y)
    loss = (dt.tanh(z) * dt.to_tensor(W)).sum()
    np.testing.assert_allclose(loss.numpy(), (np.tanh(X + Y) * W).sum(), rtol=1e-12)
    loss.backward()
    g = W * (1 - np.tanh(X + Y) ** 2)
    assert x.grad.placements == x.placements and y.grad.placements == y.placements
    np.testing.assert_allclose(x.grad.numpy(), g, rtol=1e-12)
    np.testing.assert_allclose(y.grad.numpy(), g, rtol=1e-12)


def test_ops_keep_the_split_order_without_communication():
    """x co-sharded tp first ([S(0)@1, S(0)@0], 10 rows: uneven 3,2,3,2 pieces): elementwise
    with a like-laid-out input, matmul by a replicated weight, a sum over the other axis, a
    reshape and a transpose all keep the order and communicate nothing; values and gradients
    equal numpy's."""
    mesh = mesh2x2()
    X, Y, Wt = data((10, 6), 4), data((10, 6), 5), data((6, 4), 6)
    x = dt.shard_tensor(X, mesh, TP_FIRST, stop_gradient=False)
    y = dt.shard_tensor(Y, mesh, TP_FIRST, stop_gradient=False)
    w = dt.shard_tensor(Wt, mesh, [Replicate(), Replicate()], stop_gradient=False)
    before = collectives.collective_counts()
    s = x * y
    h = dt.matmul(s, w)
    r = h.sum(axis=1)
    v = dt.reshape(s, [10, 3, 2])
    t = dt.transpose(s, [1, 0])
    assert moved(before) == {}
    assert s.placements == h.placements == r.placements == v.placements == TP_FIRST
    assert t.placements == [Shard(1, shard_order=1), Shard(1, shard_order=0)]
    for got, want in ((s, X * Y), (h, (X * Y) @ Wt), (r, ((X * Y) @ Wt).sum(1)),
                      (v, (X * Y).reshape(10, 3, 2)), (t, (X * Y).T)):
        holds(got, want)
    (r.sum() + (v * v).sum()).backward()
    gs = np.ones((10, 4)) @ Wt.T + 2 * X * Y
    np.testing.assert_allclose(x.grad.numpy(), gs * Y, rtol=1e-12)
    np.testing.assert_allclose(y.grad.numpy(), gs * X, rtol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), (X * Y).T @ np.ones((10, 4)), rtol=1e-12)
    assert x.grad.placements == TP_FIRST


def test_co_shard_order_prints_and_round_trips():
    """placements, repr, visualize_sharding and dtensor_from_local carry the order."""
    mesh = mesh2x2()
    G = data((10, 3), 7)
    x = dt.shard_tensor(G, mesh, TP_FIRST)
    assert repr(x.placements) == "[Shard(dim=0, shard_order=1), Shard(dim=0, shard_order=0)]"
    text = dt.visualize_sharding(x, print_=False)
    assert "placements [S(0, order 1), S(0, order 0)]" in text
    # rows 0:3 -> (0,0), 3:5 -> (1,0), 5:8 -> (0,1), 8:10 -> (1,1): tp splits first
    assert "| 1    | [0, 1] | [5:8, 0:3]" in text and "| 2    | [1, 0] | [3:5, 0:3]" in text
    y = dt.dtensor_from_local(x._local_array(), mesh, TP_FIRST)
    assert y.shape == [10, 3] and y.placements == TP_FIRST
    np.testing.assert_array_equal(y.numpy(), G)
    # the explicit default order is the default layout
    z = dt.shard_tensor(G, mesh, [Shard(0, shard_order=0), Shard(0, shard_order=1)])
    assert z.placements == [Shard(0), Shard(0)]
    with pytest.raises(ValueError, match=r"shard_tensor: .*shard_order \[1, None\]"):
        dt.shard_tensor(G, mesh, [Shard(0, shard_order=1), Shard(0)])


def test_ranks_disagreeing_on_the_order_raise_on_every_rank():
    mesh = mesh2x2()
    G = np.arange(33.0).reshape(11, 3)  # a shape of its own: fingerprints are checked once
    pl = TP_FIRST if dt.get_rank() == 3 else [Shard(0), Shard(0)]
    with pytest.raises(RankDisagreementError, match=r"shard_tensor: ranks disagree.*\[3\] differ"):
        dt.shard_tensor(G, mesh, pl)
    x = dt.shard_tensor(G, mesh, [Shard(0), Shard(0)])
    target = TP_FIRST if dt.get_rank() == 0 else [Shard(0), Shard(0)]
    with pytest.raises(RankDisagreementError, match=r"reshard: ranks disagree"):
        dt.reshard(x, mesh, target)
    np.testing.assert_array_equal(dt.reshard(x, mesh, TP_FIRST).numpy(), G)
