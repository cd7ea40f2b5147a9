"""The global norm in one all-reduce whatever the meshes: gradients on two meshes (pipeline
stages) and ranks holding no gradient; a captured clipped step equals the eager one. Run at
1-4 ranks."""
from __future__ import annotations

import math

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard
from disttensor.nn.clip import global_norm

pytestmark = pytest.mark.mpi


def _world() -> int:
    return collectives.init().size


@pytest.mark.parametrize("layout", ["two-meshes", "some-ranks-outside"])
def test_gradients_on_several_meshes_one_all_reduce(layout):
    w = _world()
    if w < 2:
        pytest.skip("needs 2 ranks")
    if layout == "two-meshes":
        a_ranks, b_ranks = list(range(w // 2)), list(range(w // 2, w))
    else:
        a_ranks, b_ranks = [0], [1]                    # ranks 2, 3 hold no gradient
    mesh_a = dt.ProcessMesh(a_ranks, dim_names=["x"])
    mesh_b = dt.ProcessMesh(b_ranks, dim_names=["x"])
    rng = np.random.default_rng(9)
    a, b, c = (np.round(rng.standard_normal(s) * 8).astype(np.float32)
               for s in ((5, 3), (7,), (2, 2)))
    grads = [dt.shard_tensor(a, mesh_a, [Shard(0)]), dt.shard_tensor(b, mesh_b, [Shard(0)]),
             dt.shard_tensor(c, mesh_b, [Replicate()])]
    collectives.reset_collective_counts()
    norm = global_norm(grads)
    member = dt.get_rank() in a_ranks + b_ranks      # the others take no part
    assert collectives.collective_counts().get("all_reduce", 0) == int(member)
    want = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in (a, b, c)))
    if member:
        np.testing.assert_allclose(float(norm.numpy()), want, rtol=1e-6)


def test_captured_clipped_step_equals_eager():
    n = _world()
    mesh = dt.ProcessMesh([[0, 1], [2, 3]] if n == 4 else [list(range(n))],
                          dim_names=["dp", "mp"])
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((8, 6)).astype(np.float32) for _ in range(4)]

    def build():
        dt.seed(3)
        layer = dt.nn.Linear(6, 4)
        layer.weight = dt.shard_tensor(layer.weight, mesh, [Replicate(), Shard(1)])
        layer.bias = dt.shard_tensor(layer.bias, mesh, [Replicate(), Shard(0)])
        opt = dt.optimizer.AdamW(0.1, parameters=layer.parameters(),
                                 grad_clip=dt.nn.ClipGradByGlobalNorm(0.05))
        return layer, opt

    def step_of(layer, opt):
        def step(x):
            loss = (layer(x) ** 2).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss
        return step
    layer_e, opt_e = build()
    layer_c, opt_c = build()
    eager, captured = step_of(layer_e, opt_e), dt.jit.to_static(step_of(layer_c, opt_c))
    for x in xs:
        t = dt.shard_tensor(x, mesh, [Shard(0), Replicate()])
        assert float(eager(t).numpy()) == float(captured(t).numpy())
    for p, q in zip(layer_e.parameters(), layer_c.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
    assert captured.captures == 2                 # replayed: the clip needs no host read
