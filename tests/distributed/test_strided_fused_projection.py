"""A fused projection kept split: ``ColWiseParallel(split_factor=k)`` places a fused QKV (or
gate/up) Linear as ``Shard(-1, split_factor=k)`` on mp, so the split after it gives each
section column-parallel without a reshard. Collectives per training step of examples/gpt2.py
on 2x2 counted, values and gradients against numpy."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard, nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt2  # noqa: E402
import language_model as lm  # noqa: E402

pytestmark = pytest.mark.mpi


def mesh2x2() -> dt.ProcessMesh:
    if dt.get_world_size() != 4:
        pytest.skip("needs 4 ranks (a 2x2 [dp, mp] mesh)")
    return dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def moved(before: dict) -> dict:
    after = collectives.collective_counts()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


class QKV(nn.Layer):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        return self.qkv(x).split(3, axis=-1)


def test_fused_qkv_split_needs_no_communication():
    """The weight is Shard(1, split_factor=3) on mp, the bias Shard(0, split_factor=3); q, k,
    v come out column-parallel with no collective in forward; backward only syncs gradients
    (all-reduces); values and gradients against numpy."""
    mesh = mesh2x2()
    dt.seed(1)
    layer = QKV(8)
    W, B = layer.qkv.weight.numpy(), layer.qkv.bias.numpy()
    dt.parallelize(layer, None, mesh, {"mp_config": {"parallelize_plan": {
        "qkv": dt.ColWiseParallel(split_factor=3)}}})
    assert layer.qkv.weight.placements == [Replicate(), Shard(1, split_factor=3)]
    assert layer.qkv.bias.placements == [Replicate(), Shard(0, split_factor=3)]
    X = np.random.default_rng(2).standard_normal((4, 5, 8)).astype(np.float32)
    x = dt.shard_tensor(X, mesh, [Shard(0), Replicate()])
    before = collectives.collective_counts()
    q, k, v = layer(x)
    assert moved(before) == {}
    for t in (q, k, v):
        assert t.placements == [Shard(0), Shard(2)]
    Q, K, V = np.split(X @ W + B, 3, axis=-1)
    for t, want in zip((q, k, v), (Q, K, V)):
        np.testing.assert_allclose(t.numpy(), want, rtol=1e-5, atol=1e-6)
    loss = (q * k).sum() + (v * v).sum()
    before = collectives.collective_counts()
    loss.backward()
    assert set(moved(before)) == {"all_reduce"}, moved(before)
    G = np.concatenate([K, Q, 2 * V], axis=-1)
    np.testing.assert_allclose(layer.qkv.weight.grad.numpy(),
                               np.einsum("bti,btj->ij", X, G), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.qkv.bias.grad.numpy(), G.sum((0, 1)), rtol=1e-4,
                               atol=1e-5)


def test_split_factor_must_divide_the_out_features():
    mesh = mesh2x2()
    layer = QKV(5)
    layer.qkv = nn.Linear(5, 10)
    with pytest.raises(ValueError, match=r"ColWiseParallel\(split_factor=3\).*qkv.*10"):
        dt.parallelize(layer, None, mesh, {"mp_config": {"parallelize_plan": {
            "qkv": dt.ColWiseParallel(split_factor=3)}}})
    assert not layer.qkv.weight.is_dist()  # nothing changed
    with pytest.raises(ValueError, match="split_factor"):
        dt.ColWiseParallel(split_factor=0)


def _step_counts(plan: dict) -> tuple[dict, float]:
    """Collectives of the second forward + backward of a 1-layer GPT-2 on 2x2, and its loss."""
    mesh = mesh2x2()
    dt.seed(0)
    args = argparse.Namespace(seq=8, vocab=32, layers=1, heads=4, dim=16)
    model = lm.distribute(gpt2.build(args), mesh, plan)
    xs, ys = lm.token_data(0, 4, 8, 32)
    x, y = lm.to_batch(xs, mesh), lm.to_batch(ys, mesh)
    for _ in range(2):
        before = collectives.collective_counts()
        _, loss = model(x, y)
        loss.backward()
        counts = moved(before)
    return counts, float(loss.numpy())


def test_gpt2_fused_qkv_split_does_not_reshard():
    """examples/gpt2.py's plan (c_attn with split_factor=3): a step's collectives are
    all-reduces only (the row-parallel outputs, the norms' and loss's statistics, the dp
    gradient sync); the same plan without the split factor also all-to-alls the q/k/v split
    and reduce-scatters its gradient. Both give the dense loss."""
    counts, loss = _step_counts(gpt2.PLAN)
    plain = dict(gpt2.PLAN)
    plain[r"h\.\d+\.attn\.c_attn"] = dt.ColWiseParallel()
    plain_counts, plain_loss = _step_counts(plain)
    assert set(counts) == {"all_reduce"}, counts
    assert plain_counts.get("all_to_all", 0) > 0 and counts["all_reduce"] <= \
        plain_counts["all_reduce"], (counts, plain_counts)
    dt.seed(0)
    args = argparse.Namespace(seq=8, vocab=32, layers=1, heads=4, dim=16)
    dense = gpt2.build(args)
    xs, ys = lm.token_data(0, 4, 8, 32)
    _, dense_loss = dense(dt.to_tensor(xs), dt.to_tensor(ys))
    np.testing.assert_allclose([loss, plain_loss], float(dense_loss.numpy()), rtol=1e-5)


def test_torch_style_colwise_parallel_split_factor():
    """PyTorch's spelling: ColwiseParallel(split_factor=3) on a tp mesh; the local output is
    each rank's piece of q, k and v, so a local split gives the local q, k, v pieces."""
    n = dt.get_world_size()
    tp = dt.init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    dt.seed(3)
    layer = nn.Linear(4, 6 * n)
    W, B = layer.weight.numpy(), layer.bias.numpy()
    dt.parallelize_module(layer, tp, dt.ColwiseParallel(split_factor=3))
    assert layer.weight.placements == [Shard(1, split_factor=3)]
    X = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    x = dt.shard_tensor(X, tp, [Replicate()])  # a DTensor: no piece-shape exchange
    before = collectives.collective_counts()
    local = layer(x)
    assert moved(before) == {} and not local.is_dist()
    r = dt.get_rank()
    for got, section in zip(np.split(local.numpy(), 3, axis=1), np.split(X @ W + B, 3, axis=1)):
        np.testing.assert_allclose(got, np.array_split(section, n, axis=1)[r], rtol=1e-5,
                                   atol=1e-6)
    with pytest.raises(ValueError, match="split_factor"):
        dt.ColwiseParallel(split_factor=0)
