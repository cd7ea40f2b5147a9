"""Data checks inside distributed kernels (embedding ids, cross-entropy labels, gather indices,
one_hot classes) raise the same error on every rank of the op's mesh, also on the ranks whose
piece holds no bad value, so a program that catches the error to skip a batch goes on with every
rank; the next step's values equal numpy's on the global arrays.

Sharded ids and labels are agreed on later, without a collective of the op's own: the error is
raised at the next collective, write into a distributed tensor, ``backward`` or step end (here
mostly ``numpy()`` of the result, whose gather is a collective); replicated ones at once."""
from __future__ import annotations

import re

import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import ProcessMesh, Replicate, Shard
from disttensor.ops.data_checks import pending_data_checks

pytestmark = pytest.mark.mpi

ROWS, V, D = 8, 13, 5  # shapes no agreement test uses (an agreed fingerprint is not rechecked)
RNG = np.random.default_rng(5)
WEIGHT = RNG.standard_normal((V, D))
LOGITS = RNG.standard_normal((ROWS, V))
IDS = RNG.integers(0, V, (ROWS,))


def layouts() -> list[str]:
    n = dt.get_world_size()
    return ["data", "model"] + (["2d"] if n == 4 else [])


def meshes(layout: str):
    """(mesh, batch placements, class/vocab placements): batch rows sharded ("data"), the
    vocab / class axis sharded ("model"), or both on a 2 x 2 mesh."""
    n = dt.get_world_size()
    if layout == "2d":
        mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        return mesh, [Shard(0), Replicate()], [Replicate(), Shard(0)]
    mesh = ProcessMesh(list(range(n)), dim_names=["x"])
    if layout == "data":
        return mesh, [Shard(0)], [Replicate()]
    return mesh, [Replicate()], [Shard(0)]


def bad_ids(value: int) -> np.ndarray:
    """IDS with ``value`` in the last row: on the last rank's piece when rows are sharded."""
    ids = IDS.copy()
    ids[-1] = value
    return ids


def ce_numpy(logits: np.ndarray, labels: np.ndarray, ignore_index: int = -100) -> float:
    m = logits.max(1, keepdims=True)
    lse = (np.log(np.exp(logits - m).sum(1)) + m[:, 0])
    valid = labels != ignore_index
    picked = logits[np.arange(len(labels)), np.where(valid, labels, 0)]
    return float(np.where(valid, lse - picked, 0).sum() / valid.sum())


@pytest.mark.parametrize("bad", [V + 2, -3])
@pytest.mark.parametrize("layout", ["data", "model", "2d"])
def test_embedding_id_out_of_range_raises_on_every_rank(layout, bad):
    if layout not in layouts():
        pytest.skip("needs 4 ranks")
    mesh, batch_pl, vocab_pl = meshes(layout)
    w = dt.shard_tensor(WEIGHT, mesh, vocab_pl)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"embedding: id {bad} is out of range [0, {V})") + "$"):
        F.embedding(dt.shard_tensor(bad_ids(bad), mesh, batch_pl), w).numpy()
    assert pending_data_checks() == 0
    # the job goes on: the next batch's rows are numpy's
    out = F.embedding(dt.shard_tensor(IDS, mesh, batch_pl), w)
    np.testing.assert_allclose(out.numpy(), WEIGHT[IDS])


@pytest.mark.parametrize("layout", ["data", "model", "2d"])
def test_cross_entropy_label_out_of_range_raises_on_every_rank(layout):
    if layout not in layouts():
        pytest.skip("needs 4 ranks")
    mesh, batch_pl, _ = meshes(layout)
    class_pl = [batch_pl[0], Shard(1)] if layout == "2d" else (
        [Shard(0)] if layout == "data" else [Shard(1)])
    x = dt.shard_tensor(LOGITS, mesh, class_pl, stop_gradient=False)
    labels = bad_ids(V)
    labels[0] = -100  # ignore_index aside: not out of range
    with pytest.raises(ValueError, match="^" + re.escape(
            f"cross_entropy: label value {V} is out of range [0, {V}) (ignore_index=-100)") + "$"):
        F.cross_entropy(x, dt.shard_tensor(labels, mesh, batch_pl))  # mean: agreed at once
    with pytest.raises(ValueError, match="^" + re.escape(
            f"cross_entropy: label value {V} is out of range [0, {V}) (ignore_index=-100)") + "$"):
        F.cross_entropy(x, dt.shard_tensor(labels, mesh, batch_pl), reduction="sum").backward()
    assert x.grad is None  # raised before backward wrote anything
    labels[-1] = IDS[-1]
    loss = F.cross_entropy(x, dt.shard_tensor(labels, mesh, batch_pl))
    np.testing.assert_allclose(float(loss.numpy()), ce_numpy(LOGITS, labels), rtol=1e-10)
    loss.backward()  # the step completes on every rank
    assert x.grad.shape == [ROWS, V]


@pytest.mark.parametrize("layout", ["data", "model"])
def test_gather_and_one_hot_raise_on_every_rank(layout):
    mesh, batch_pl, _ = meshes(layout)
    idx = dt.shard_tensor(bad_ids(V), mesh, batch_pl)
    w = dt.shard_tensor(WEIGHT, mesh, [Replicate()])
    with pytest.raises(ValueError, match="^" + re.escape(
            f"gather: index value {V} is out of range [0, {V})") + "$"):
        dt.gather(w, idx).numpy()
    with pytest.raises(ValueError, match="^" + re.escape(
            f"one_hot: x value {V} is out of range [0, {V})") + "$"):
        F.one_hot(idx, V).numpy()
    good = dt.shard_tensor(IDS, mesh, batch_pl)
    np.testing.assert_allclose(dt.gather(w, good).numpy(), WEIGHT[IDS])
    np.testing.assert_array_equal(F.one_hot(good, V).numpy(), np.eye(V)[IDS])


def test_dense_checks_and_empty_pieces():
    """Dense calls check the same way (no collective); a piece with no values, or only
    ignored labels, is no error."""
    with pytest.raises(ValueError, match=re.escape(f"embedding: id -1 is out of range [0, {V})")):
        F.embedding(dt.to_tensor(np.array([3, -1, V])), dt.to_tensor(WEIGHT))
    n = dt.get_world_size()
    mesh = ProcessMesh(list(range(n)), dim_names=["x"])
    ids = IDS[: max(n - 1, 1)]  # fewer rows than ranks: the last piece is empty
    out = F.embedding(dt.shard_tensor(ids, mesh, [Shard(0)]), dt.shard_tensor(WEIGHT, mesh,
                                                                                 [Replicate()]))
    np.testing.assert_allclose(out.numpy(), WEIGHT[ids])
    labels = np.full(ROWS, -100)
    labels[0] = 2
    loss = F.cross_entropy(dt.shard_tensor(LOGITS, mesh, [Shard(0)]),
                           dt.shard_tensor(labels, mesh, [Shard(0)]))
    np.testing.assert_allclose(float(loss.numpy()), ce_numpy(LOGITS, labels), rtol=1e-10)



def batch_mesh():
    n = dt.get_world_size()
    return ProcessMesh(list(range(n)), dim_names=["x"])


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_cross_entropy_on_a_batch_sharded_input_issues_no_collective(reduction):
    """The label check of a batch-sharded cross entropy costs no collective of its own: its
    verdict joins the next collective (here the gather of ``numpy()``) as one small all-reduce."""
    mesh = batch_mesh()
    x = dt.shard_tensor(LOGITS, mesh, [Shard(0)])
    labels = dt.shard_tensor(IDS, mesh, [Shard(0)])
    F.cross_entropy(x, labels, reduction=reduction)  # plans cached
    loss = F.cross_entropy(x, labels, reduction=reduction).numpy()  # verdicts agreed
    before = collectives.collective_counts()
    loss = F.cross_entropy(x, labels, reduction=reduction)
    assert collectives.collective_counts() == before
    assert pending_data_checks() == (1 if dt.get_world_size() > 1 else 0)
    expect = ce_numpy(LOGITS, IDS) * ROWS if reduction == "sum" else None
    got = loss.numpy()
    if expect is None:
        m = LOGITS.max(1, keepdims=True)
        lse = np.log(np.exp(LOGITS - m).sum(1)) + m[:, 0]
        np.testing.assert_allclose(got.reshape(-1), lse - LOGITS[np.arange(ROWS), IDS],
                                   rtol=1e-10)
    else:
        np.testing.assert_allclose(float(got), expect, rtol=1e-10)
    assert pending_data_checks() == 0


@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_a_bad_id_on_one_rank_surfaces_at_the_next_write_on_every_rank(bad_rank):
    """A bad id held by one rank only: the embedding returns on every rank, and the write into
    a distributed tensor that follows raises on every rank before anything is written."""
    mesh = batch_mesh()
    w = dt.shard_tensor(WEIGHT, mesh, [Replicate()])
    ids = IDS.copy()
    ids[0 if bad_rank == "first" else -1] = V + 4
    acc = dt.shard_tensor(np.zeros((ROWS, D)), mesh, [Shard(0)])
    where = "embedding"  # one rank: no other piece, the error is raised at once
    with pytest.raises(ValueError, match="^" + re.escape(
            f"embedding: id {V + 4} is out of range [0, {V})") + "$"):
        out = F.embedding(dt.shard_tensor(ids, mesh, [Shard(0)]), w)
        where = "add_"
        acc.add_(out)
    assert where == ("add_" if dt.get_world_size() > 1 else "embedding")
    np.testing.assert_array_equal(acc.numpy(), np.zeros((ROWS, D)))
    acc.add_(F.embedding(dt.shard_tensor(IDS, mesh, [Shard(0)]), w))
    np.testing.assert_allclose(acc.numpy(), WEIGHT[IDS])


def test_captured_step_agrees_once_per_step():
    """A captured step with two checks on batch-sharded inputs and no collective agrees once
    (one all-reduce after its forward); a bad label raises on every rank at replay, and the next
    replay gives numpy's values."""
    mesh = batch_mesh()
    w = dt.shard_tensor(WEIGHT, mesh, [Replicate()])

    def step(ids, labels):
        return F.cross_entropy(F.embedding(ids, w), labels, reduction="none")

    f = dt.jit.to_static(step)
    ids = dt.shard_tensor(IDS, mesh, [Shard(0)])
    labels = dt.shard_tensor(IDS % D, mesh, [Shard(0)])
    f(ids, labels)
    f(ids, labels)
    before = collectives.collective_counts()
    out = f(ids, labels)
    after = collectives.collective_counts()
    n = 1 if dt.get_world_size() > 1 else 0
    assert {k: after.get(k, 0) - v for k, v in before.items() if after.get(k, 0) != v} == (
        {"all_reduce": n} if n else {})
    bad = IDS % D
    bad[-1] = D
    with pytest.raises(ValueError, match="^" + re.escape(
            f"cross_entropy: label value {D} is out of range [0, {D}) (ignore_index=-100)") + "$"):
        f(ids, dt.shard_tensor(bad, mesh, [Shard(0)]))
    out = f(ids, labels).numpy()
    e = WEIGHT[IDS]
    m = e.max(1, keepdims=True)
    lse = np.log(np.exp(e - m).sum(1)) + m[:, 0]
    np.testing.assert_allclose(out.reshape(-1), lse - e[np.arange(ROWS), IDS % D], rtol=1e-10)


def test_before_next_collective_runs_once_and_may_refuse_the_call():
    """The hook the checks use: run once before the next collective of any group; when it
    raises, that collective is not made (not counted, the group's call index unchanged)."""
    world = collectives.init()
    calls = []

    def refuse():
        calls.append("refuse")
        raise ValueError("refused")
    collectives.before_next_collective(refuse)
    collectives.before_next_collective(refuse)  # registered once
    before, index = collectives.collective_counts(), world._call_index
    with pytest.raises(ValueError, match="refused"):
        world.all_reduce(np.ones(2), "sum")
    assert collectives.collective_counts() == before and world._call_index == index
    np.testing.assert_array_equal(world.all_reduce(np.ones(2), "sum"), np.full(2, world.size))
    assert calls == ["refuse"]
    collectives.before_next_collective(refuse)
    collectives.cancel_before_next_collective(refuse)
    world.barrier()
    assert calls == ["refuse"]
