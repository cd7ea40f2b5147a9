"""End to end: an MLP with BatchNorm1D trained by AdamW; BatchNorm running statistics."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn


def _regression_data(n=256, d=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal((d, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.5 * x[:, :1] ** 2
    return dt.to_tensor(x), dt.to_tensor(y.astype(np.float32))


def test_mlp_with_batchnorm_adamw_regression_loss_falls():
    dt.seed(0)
    x, y = _regression_data()
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1D(32), nn.ReLU(), nn.Linear(32, 1))
    opt = dt.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters(),
                             weight_decay=0.01)
    loss_fn = nn.MSELoss()
    params = {id(p) for p in model.parameters()}
    losses = []
    for _ in range(100):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    assert {id(p) for p in model.parameters()} == params
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    model.eval()
    with dt.no_grad():
        eval_loss = float(loss_fn(model(x), y))
    assert eval_loss < 0.5 * losses[0]


def test_mlp_classification_cross_entropy_loss_falls():
    dt.seed(1)
    rng = np.random.default_rng(1)
    xs = rng.standard_normal((128, 4)).astype(np.float32)
    labels = (xs[:, 0] + xs[:, 1] > 0).astype(np.int64) + 2 * (xs[:, 2] > 0.5)
    x, label = dt.to_tensor(xs), dt.to_tensor(labels)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = dt.optimizer.Momentum(0.1, parameters=model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    first = None
    for _ in range(60):
        loss = loss_fn(model(x), label)
        first = float(loss) if first is None else first
        loss.backward()
        opt.step()
        opt.clear_grad()
    assert float(loss) < 0.5 * first


@pytest.mark.parametrize("shape,fmt", [((16, 5), "NCL"), ((6, 5, 3), "NCL"), ((6, 3, 5), "NLC")])
def test_batchnorm1d_running_stats_match_numpy(shape, fmt):
    """Running mean/variance after 3 training steps (Paddle's convention: momentum-weighted,
    biased batch variance), then eval-mode output from the running stats."""
    dt.seed(2)
    momentum, eps = 0.8, 1e-5
    bn = nn.BatchNorm1D(5, momentum=momentum, epsilon=eps, data_format=fmt)
    pre = nn.Linear(shape[-1], shape[-1])
    opt = dt.optimizer.SGD(0.5, parameters=pre.parameters() + bn.parameters())
    seen = []
    bn.register_forward_pre_hook(lambda layer, inputs: seen.append(inputs[0].numpy()))
    mean_buf, var_buf = bn._mean, bn._variance
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = dt.to_tensor(rng.standard_normal(shape).astype(np.float32) * 3 + 1)
        out = bn(pre(x))
        (out * out).mean().backward()
        opt.step()
        opt.clear_grad()
    axes = tuple(a for a in range(len(shape)) if a != (1 if fmt == "NCL" else len(shape) - 1))
    r_mean, r_var = np.zeros(5), np.ones(5)
    for h in seen:
        r_mean = momentum * r_mean + (1 - momentum) * h.mean(axis=axes)
        r_var = momentum * r_var + (1 - momentum) * h.var(axis=axes)
    assert bn._mean is mean_buf and bn._variance is var_buf  # updated inplace
    np.testing.assert_allclose(bn._mean.numpy(), r_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn._variance.numpy(), r_var, rtol=1e-5, atol=1e-6)
    # eval: normalized by the running statistics, which stay unchanged
    bn.eval()
    h = rng.standard_normal(shape).astype(np.float32)
    out = bn(dt.to_tensor(h)).numpy()
    bshape = [1] * len(shape)
    bshape[1 if fmt == "NCL" else -1] = 5
    ref = ((h - r_mean.reshape(bshape)) / np.sqrt(r_var.reshape(bshape) + eps)
           * bn.weight.numpy().reshape(bshape) + bn.bias.numpy().reshape(bshape))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn._mean.numpy(), r_mean, rtol=1e-5, atol=1e-6)


def test_batchnorm2d_and_layernorm_forward():
    dt.seed(4)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    bn = nn.BatchNorm2D(3)
    out = bn(dt.to_tensor(h)).numpy()
    ref = (h - h.mean((0, 2, 3), keepdims=True)) / np.sqrt(h.var((0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(bn._mean.numpy(), 0.1 * h.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)
    ln = nn.LayerNorm([2, 2])
    out = ln(dt.to_tensor(h)).numpy()
    ref = (h - h.mean((2, 3), keepdims=True)) / np.sqrt(h.var((2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
