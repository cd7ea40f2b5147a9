"""Gradient merge: a captured step (``DistModel`` with ``strategy.gradient_merge``, train.py
``--accumulate K --to-static``) consumes K micro-batches in one call, equals the eager step
bitwise and syncs the gradients once per step. Run at 1-4 ranks."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard
from disttensor.optimizer import merged_step, micro_batches

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi


def _dp():
    return dt.ProcessMesh(list(range(collectives.init().size)), dim_names=["dp"])


def _data(step: int, n: int = 48):
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((n, 5)).astype(np.float32),
            rng.standard_normal((n, 3)).astype(np.float32))


def _linear(mesh, optimizer="adamw"):
    dt.seed(11)
    layer = dt.nn.Linear(5, 3)
    dt.shard_layer(layer, mesh)
    opt = dt.optimizer.AdamW(1e-2, parameters=layer.parameters()) if optimizer == "adamw" \
        else dt.optimizer.SGD(0.5, parameters=layer.parameters())
    return layer, opt


def _batch(mesh, step):
    x, y = _data(step)
    return dt.shard_tensor(x, mesh, [Shard(0)]), dt.shard_tensor(y, mesh, [Shard(0)])


def _all_reduces() -> int:
    return collectives.collective_counts().get("all_reduce", 0)


def _strategy(k: int) -> dt.Strategy:
    strategy = dt.Strategy()
    strategy.gradient_merge.enable = True
    strategy.gradient_merge.k_steps = k
    return strategy


def test_captured_gradient_merge_equals_eager_and_syncs_once():
    mesh = _dp()
    eager_layer, eager_opt = _linear(mesh)
    layer, opt = _linear(mesh)
    model = dt.to_static(layer, None, F.mse_loss, opt, strategy=_strategy(4))
    single_layer, single_opt = _linear(mesh)
    single = dt.to_static(single_layer, None, F.mse_loss, single_opt)
    syncs = {}
    for step in range(5):
        x, y = _batch(mesh, step)
        want = merged_step(eager_layer, eager_opt, lambda a, b: F.mse_loss(eager_layer(a), b),
                           x, y, k_steps=4)
        before = _all_reduces()
        got = model(x, y)
        syncs.setdefault("merged", []).append(_all_reduces() - before)
        before = _all_reduces()
        single(x, y)
        syncs.setdefault("single", []).append(_all_reduces() - before)
        assert float(got.numpy()) == float(want.numpy())
        for p, q in zip(layer.parameters(), eager_layer.parameters()):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    assert model._steps["train"].captures == 2          # then replayed: 4 micro-batches a call
    # one gradient sync (one bucketed all-reduce) per step, as without micro-batches
    assert syncs["merged"] == syncs["single"]
    if mesh.shape[0] > 1:
        assert syncs["merged"][2:] == [1, 1, 1]


def test_merged_step_matches_the_full_batch_gradient():
    mesh = _dp()
    layer, opt = _linear(mesh, "sgd")
    w0, b0 = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
    x, y = _batch(mesh, 0)
    loss = merged_step(layer, opt, lambda a, c: F.mse_loss(layer(a), c), x, y, k_steps=4)
    xa, ya = (a.astype(np.float64) for a in _data(0))
    r = xa @ w0 + b0 - ya                                   # numpy: the full batch's mean
    np.testing.assert_allclose(float(loss.numpy()), (r ** 2).mean(), rtol=1e-6)
    np.testing.assert_allclose(layer.weight.numpy(), w0 - 0.5 * 2 * xa.T @ r / r.size,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.bias.numpy(), b0 - 0.5 * 2 * r.sum(0) / r.size,
                               rtol=1e-5, atol=1e-6)


def test_micro_batches_cut_each_rank_piece():
    mesh = _dp()
    x = dt.shard_tensor(np.arange(24 * 2, dtype=np.float32).reshape(24, 2), mesh, [Shard(0)])
    parts = micro_batches(x, 2)
    n = mesh.shape[0]
    pieces = np.array_split(x.numpy(), n)
    for i, part in enumerate(parts):
        assert part.placements == x.placements and part.shape == [12, 2]
        want = np.concatenate([np.array_split(p, 2)[i] for p in pieces])
        np.testing.assert_array_equal(part.numpy(), want)


@pytest.mark.parametrize("extra", [[], ["--amp", "O1"]])
def test_train_py_accumulate_to_static_equals_eager(extra):
    args = ["--model", "gpt", "--steps", "5", "--log-interval", "100", "--batch", "24",
            "--accumulate", "2"]
    eager = train.main(args + extra)
    captured = train.main(args + extra + ["--to-static"])
    assert captured == eager


def test_bad_gradient_merge_settings():
    mesh = _dp()
    x = dt.shard_tensor(np.zeros((4 * mesh.shape[0] + 1, 2), np.float32), mesh,
                        [Replicate()])
    with pytest.raises(ValueError, match=r"gradient_merge: the batch of shape \[.*k_steps=2"):
        micro_batches(x, 2)
    with pytest.raises(ValueError, match="k_steps must be a positive integer"):
        dt.to_static(dt.nn.Linear(2, 2), None, F.mse_loss,
                     dt.optimizer.SGD(0.1, parameters=[]),
                     strategy={"gradient_merge": {"enable": True, "k_steps": 0}})
    with pytest.raises(ValueError, match=r"Strategy: unknown gradient_merge settings \['k'\]"):
        dt.Strategy({"gradient_merge": {"k": 2}})
