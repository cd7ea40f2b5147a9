"""Optimizer updates keep their one-element inputs (Adam's beta powers, the learning rate)
replicated whatever the parameter's layout: a one-element parameter that fully_shard spreads
over 4 ranks (3 of them hold an empty piece) still takes AdamW's step, equal to numpy's."""
import numpy as np
import pytest

import disttensor as dt
from disttensor import nn

pytestmark = pytest.mark.mpi


def _adamw(p, g, m, v, t, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps), m, v


def test_fully_sharded_one_element_bias_takes_adamw_steps():
    n = dt.get_world_size()
    mesh = dt.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    dt.seed(0)
    layer = nn.Linear(3, 1)
    w0, b0 = layer.weight.numpy().copy(), layer.bias.numpy().copy()
    dt.fully_shard(layer, mesh=mesh)
    opt = dt.optimizer.AdamW(learning_rate=1e-2, parameters=layer.parameters())
    x = np.random.default_rng(1).random((8, 3)).astype("float32")
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    mw = vw = np.zeros_like(w)
    mb = vb = np.zeros_like(b)
    for t in (1, 2):
        out = layer(dt.shard_tensor(x, mesh, [dt.Shard(0)])).mean()
        out.backward()
        opt.step()
        opt.clear_grad()
        gw = np.repeat(x.mean(0, keepdims=True).T, 1, axis=1).astype(np.float64)  # d mean / d w
        gb = np.ones_like(b)
        w, mw, vw = _adamw(w, gw, mw, vw, t)
        b, mb, vb = _adamw(b, gb, mb, vb, t)
    np.testing.assert_allclose(layer.weight.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.bias.numpy(), b, rtol=1e-5, atol=1e-6)
