"""examples/resnet.py at a tiny size: one forward/backward equals a numpy-only ResNet (values
and every parameter's gradient), the distributed loss curve equals the dense one, and a
captured step equals the eager one bitwise."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import disttensor as dt

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "distributed"))
import resnet  # noqa: E402
from references_vision import _conv2d, _conv2d_grad, _max_pool2d, _max_pool2d_grad  # noqa: E402

TINY = ["--width", "2", "--blocks", "1", "1", "--image-size", "8", "--classes", "3",
        "--batch", "8", "--log-interval", "1000"]


# -- a numpy-only ResNet: each layer returns its output and its backward ------------------------

class NumpyNet:
    """Forward/backward of :class:`resnet.ResNet` in numpy, reading the parameters by name."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p, self.grads = params, {k: np.zeros_like(v) for k, v in params.items()}

    def conv(self, name, x, stride, pad):
        attrs = {"stride": (stride, stride), "padding": (pad,) * 4, "dilation": (1, 1),
                 "groups": 1}
        w = self.p[name + ".weight"]

        def back(g):
            dx, dw = _conv2d_grad([x, w, g], attrs, None)
            self.grads[name + ".weight"] += dw
            return dx
        return _conv2d([x, w], attrs, None)[0], back

    def bn(self, name, x, eps=1e-5):
        gamma, beta = self.p[name + ".weight"], self.p[name + ".bias"]
        mu, var = x.mean((0, 2, 3), keepdims=True), x.var((0, 2, 3), keepdims=True)
        rstd = 1 / np.sqrt(var + eps)
        xhat = (x - mu) * rstd
        m = x.size / x.shape[1]

        def back(g):
            self.grads[name + ".weight"] += (g * xhat).sum((0, 2, 3))
            self.grads[name + ".bias"] += g.sum((0, 2, 3))
            dxhat = g * gamma[None, :, None, None]
            return rstd / m * (m * dxhat - dxhat.sum((0, 2, 3), keepdims=True)
                               - xhat * (dxhat * xhat).sum((0, 2, 3), keepdims=True))
        return xhat * gamma[None, :, None, None] + beta[None, :, None, None], back

    @staticmethod
    def relu(x):
        return np.maximum(x, 0), lambda g: g * (x > 0)

    @staticmethod
    def chain(x, *layers):
        backs = []
        for layer in layers:
            x, b = layer(x)
            backs.append(b)

        def back(g):
            for b in reversed(backs):
                g = b(g)
            return g
        return x, back

    def block(self, name, x, stride, down):
        main, back_main = self.chain(
            x, lambda t: self.conv(name + ".conv1", t, stride, 1),
            lambda t: self.bn(name + ".bn1", t), self.relu,
            lambda t: self.conv(name + ".conv2", t, 1, 1), lambda t: self.bn(name + ".bn2", t))
        short, back_short = (x, lambda g: g) if not down else self.chain(
            x, lambda t: self.conv(name + ".down.0", t, stride, 0),
            lambda t: self.bn(name + ".down.1", t))
        out, back_relu = self.relu(main + short)

        def back(g):
            g = back_relu(g)
            return back_main(g) + back_short(g)
        return out, back

    def loss_and_grads(self, x, labels):
        pool = {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1, 1, 1),
                "ceil_mode": False}

        def maxpool(t):
            return _max_pool2d([t], pool, None)[0], lambda g: _max_pool2d_grad([t, g], pool,
                                                                               None)[0]
        h, back = self.chain(
            x, lambda t: self.conv("stem.0", t, 1, 1), lambda t: self.bn("stem.1", t),
            self.relu, maxpool, lambda t: self.block("layers.0", t, 1, False),
            lambda t: self.block("layers.1", t, 2, True))
        feat = h.mean((2, 3))
        logits = feat @ self.p["fc.weight"] + self.p["fc.bias"]
        z = logits - logits.max(1, keepdims=True)
        prob = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        n = len(labels)
        loss = -np.log(prob[np.arange(n), labels]).mean()
        dlogits = prob.copy()
        dlogits[np.arange(n), labels] -= 1
        dlogits /= n
        self.grads["fc.weight"] += feat.T @ dlogits
        self.grads["fc.bias"] += dlogits.sum(0)
        dfeat = dlogits @ self.p["fc.weight"].T
        back(np.broadcast_to(dfeat[:, :, None, None] / (h.shape[2] * h.shape[3]), h.shape))
        return loss, self.grads


def test_tiny_resnet_matches_a_numpy_reference_forward_and_backward():
    dt.seed(0)
    model = resnet.ResNet(2, 3, (1, 1))
    model.to(dtype="float64")
    rng = np.random.default_rng(0)
    x, y = resnet.images(rng, 6, 8, 3, "float64")
    loss = dt.nn.functional.cross_entropy(model(dt.to_tensor(x)), dt.to_tensor(y))
    loss.backward()
    ref = NumpyNet({k: v.numpy() for k, v in model.named_parameters()})
    ref_loss, ref_grads = ref.loss_and_grads(x, y)
    np.testing.assert_allclose(float(loss.numpy()), ref_loss, rtol=1e-10)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), ref_grads[name], rtol=1e-7, atol=1e-10,
                                   err_msg=name)


def test_captured_dense_step_equals_eager_bitwise_for_five_steps():
    eager = resnet.main(TINY + ["--dense", "--steps", "5"])
    captured = resnet.main(TINY + ["--dense", "--steps", "5", "--to-static"])
    assert eager == captured, (eager, captured)
    assert eager[-1] < eager[0]


@pytest.mark.mpi
def test_distributed_run_equals_the_dense_run_and_its_capture(comm):
    dense = resnet.main(TINY + ["--dense", "--steps", "10"])
    dist = resnet.main(TINY + ["--steps", "10"])
    np.testing.assert_allclose(dist, dense, rtol=1e-5)
    captured = resnet.main(TINY + ["--steps", "10", "--to-static"])
    assert captured == dist, (captured, dist)


@pytest.mark.mpi
def test_spatially_sharded_run_equals_the_dense_run(comm):
    common = TINY + ["--image-size", "32", "--steps", "4"]
    dense = resnet.main(common + ["--dense"])
    spatial = resnet.main(common + ["--spatial"])
    np.testing.assert_allclose(spatial, dense, rtol=1e-5)
    assert resnet.main(common + ["--spatial", "--to-static"]) == spatial
