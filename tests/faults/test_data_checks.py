"""Data checks inside distributed kernels (embedding ids, cross-entropy labels, gather indices,
one_hot classes) raise the same error on every rank of the op's mesh, also on the ranks whose
piece holds no bad value, so a program that catches the error to skip a batch goes on with every
rank; the next step's values equal numpy's on the global arrays."""
from __future__ import annotations

import re

import numpy as np
import pytest

import disttensor as dt
import disttensor.nn.functional as F
from disttensor import ProcessMesh, Replicate, Shard

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
        F.embedding(dt.shard_tensor(bad_ids(bad), mesh, batch_pl), w)
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
        F.cross_entropy(x, dt.shard_tensor(labels, mesh, batch_pl))
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
        dt.gather(w, idx)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"one_hot: x value {V} is out of range [0, {V})") + "$"):
        F.one_hot(idx, V)
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

