"""A training step made of the tensor ops, captured (``to_static``, with and without
recomputation) and replayed: bitwise the eager losses and parameters, on a sharded layout —
the kernels that all-reduce their own statistics (logsumexp, var) and check their indices
(take_along_axis) replay like any other step."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import Replicate, Shard

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()


def _mesh():
    return dt.ProcessMesh([[0, 1], [2, 3]]) if WORLD == 4 else dt.ProcessMesh(list(range(WORLD)))


def _run(captured: bool, recompute: bool = False):
    mesh = _mesh()
    rng = np.random.default_rng(2)
    rest = [Replicate()] * (mesh.ndim - 1)
    w = dt.shard_tensor(rng.standard_normal((6, 7)) * 0.3, mesh, rest + [Shard(1)],
                        stop_gradient=False)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=[w])
    mask = dt.to_tensor(rng.random((5, 7)) < 0.3)
    ids = dt.shard_tensor(rng.integers(0, 7, (5, 2)), mesh, [Shard(0)] + rest)

    def step(x):
        h = dt.masked_fill(dt.matmul(x, w), mask, 0.0)
        h = dt.tril(h, 1) + dt.sin(h)
        top, _ = dt.topk(h, 2)
        loss = (dt.logsumexp(h, axis=1).mean() + dt.var(h, axis=1).mean() + top.mean() * 0.1
                + dt.take_along_axis(h, ids, 1).mean() + dt.cumsum(h[:, [0, -1]], 1).mean()
                + dt.einsum("ij,ij->i", h, h).mean() * 0.01)
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    if captured:
        step = dt.jit.to_static(step, recompute=recompute)
    xs = [dt.shard_tensor(rng.standard_normal((5, 6)), mesh, [Shard(0)] + rest)
          for _ in range(4)]
    losses = [float(step(x).numpy()) for x in xs]
    return losses, w.numpy()


@pytest.mark.parametrize("recompute", [False, True])
def test_captured_tensor_ops_equal_eager(recompute):
    eager = _run(False)
    cap = _run(True, recompute)
    assert cap[0] == eager[0]
    np.testing.assert_array_equal(cap[1], eager[1])
