"""GradScaler inside a captured step: the found-inf verdict, the skip and the scale update run
in the program (no host read), and a captured run equals the eager one bitwise, an inf in one
rank's gradient piece skipping the step on every rank. Run at 1-4 ranks."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard

pytestmark = pytest.mark.mpi

STEPS, BAD = 5, 2            # the step whose gradient holds an inf


def _mesh():
    n = collectives.init().size
    grid = [[0, 1], [2, 3]] if n == 4 else [list(range(n))]
    return dt.ProcessMesh(grid, dim_names=["dp", "mp"])


def _run(captured: bool):
    """Losses, weights and scales of STEPS float16-O1 AdamW steps with a GradScaler; at step
    BAD one element of the weight gradient, held by the last rank only, becomes inf."""
    mesh = _mesh()
    rng = np.random.default_rng(6)
    dt.seed(5)
    layer = dt.nn.Linear(6, 8)
    layer.weight = dt.shard_tensor(layer.weight, mesh, [Replicate(), Shard(1)])
    opt = dt.optimizer.AdamW(0.05, parameters=layer.parameters())
    scaler = dt.amp.GradScaler(init_loss_scaling=1024.0, incr_every_n_steps=2)

    def step(x, poison):
        with dt.amp.auto_cast(dtype="float16"):
            loss = layer(x).astype("float32").pow(2).mean()
        scaler.scale(loss).backward()
        layer.weight.grad = layer.weight.grad * poison
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        return loss
    f = dt.jit.to_static(step) if captured else step
    losses, weights, scales = [], [], []
    for k in range(STEPS):
        poison = np.ones((6, 8), np.float32)
        if k == BAD:
            poison[5, 7] = np.inf            # the last column: the last mp rank's piece
        x = dt.shard_tensor(rng.standard_normal((4, 6)).astype(np.float32), mesh,
                            [Shard(0), Replicate()])
        p = dt.shard_tensor(poison, mesh, [Replicate(), Shard(1)])
        losses.append(float(f(x, p).numpy()))
        weights.append(layer.weight.numpy())
        scales.append(scaler.get_loss_scaling())
    return losses, weights, scales, f


def test_captured_scaler_equals_eager_and_skips_on_every_rank():
    eager, captured = _run(False), _run(True)
    assert captured[0] == eager[0]
    for a, b in zip(captured[1], eager[1]):
        np.testing.assert_array_equal(a, b)
    assert captured[2] == eager[2]
    assert captured[3].captures == 2                 # then replayed, the bad step included
    weights, scales = eager[1], eager[2]
    np.testing.assert_array_equal(weights[BAD], weights[BAD - 1])   # skipped here too
    assert not np.array_equal(weights[BAD + 1], weights[BAD])
    # 1024 -> 2048 after two good steps, halved at the bad one, counting again after it
    assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
