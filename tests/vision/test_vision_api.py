"""The public vision API (``F.conv1d``/``conv2d``, pooling, ``F.interpolate``, ``F.pad``, the
layers, GroupNorm/InstanceNorm2D/Dropout2D) against numpy loops written here, its argument
forms (padding "same", NHWC, bias) and its bad-input errors."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn
from disttensor.nn import functional as F


def _conv_np(x, w, stride, pads, dilation=(1, 1), groups=1):
    """Direct cross-correlation: out[n, o, p, q] = sum x_pad[n, c, p s + i d, q s + j d] w."""
    pt, pb, pl, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, wd = xp.shape
    o, cg, kh, kw = w.shape
    ho = (h - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, ho, wo))
    og = o // groups
    for oc in range(o):
        g = oc // og
        for p in range(ho):
            for q in range(wo):
                patch = xp[:, g * cg:(g + 1) * cg,
                           p * stride[0]:p * stride[0] + dilation[0] * (kh - 1) + 1:dilation[0],
                           q * stride[1]:q * stride[1] + dilation[1] * (kw - 1) + 1:dilation[1]]
                out[:, oc, p, q] = (patch * w[oc]).sum(axis=(1, 2, 3))
    return out


def _t(a, grad=False):
    return dt.to_tensor(a, stop_gradient=not grad)


def test_conv2d_same_padding_bias_and_nhwc_match_numpy():
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3)), \
        rng.standard_normal(4)
    # "same" at stride 2: out ceil(7/2)=4, ceil(6/2)=3; pads (1, 1) on H, (0, 1) on W
    y = F.conv2d(_t(x), _t(w), _t(b), stride=2, padding="same")
    want = _conv_np(x, w, (2, 2), (1, 1, 0, 1)) + b[None, :, None, None]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    y2 = F.conv2d(_t(x.transpose(0, 2, 3, 1)), _t(w), _t(b), stride=2, padding="same",
                  data_format="NHWC")
    np.testing.assert_allclose(y2.numpy(), want.transpose(0, 2, 3, 1), rtol=1e-12, atol=1e-12)
    y3 = F.conv2d(_t(x), _t(w), padding=[[0, 0], [0, 0], [2, 0], [1, 1]], dilation=2)
    np.testing.assert_allclose(y3.numpy(), _conv_np(x, w, (1, 1), (2, 0, 1, 1), (2, 2)),
                               rtol=1e-12, atol=1e-12)


def test_conv1d_and_depthwise_values_and_gradients():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 4, 9)), rng.standard_normal((4, 1, 3))
    xt, wt = _t(x, True), _t(w, True)
    y = F.conv1d(xt, wt, stride=2, padding=1, groups=4)
    want = _conv_np(x[:, :, None], w[:, :, None], (1, 2), (0, 0, 1, 1), groups=4)[:, :, 0]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(want.shape)
    (y * _t(g)).sum().backward()
    # numpy gradients of the depthwise conv: each output reads 3 taps of its own channel
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1)))
    dxp, dw = np.zeros_like(xp), np.zeros_like(w)
    for q in range(want.shape[2]):
        for j in range(3):
            dxp[:, :, 2 * q + j] += g[:, :, q] * w[None, :, 0, j]
            dw[:, 0, j] += (g[:, :, q] * xp[:, :, 2 * q + j]).sum(0)
    np.testing.assert_allclose(xt.grad.numpy(), dxp[:, :, 1:-1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-12, atol=1e-12)


def test_pooling_and_interpolate_match_numpy():
    rng = np.random.default_rng(2)
    x = rng.permutation(2 * 3 * 5 * 5).reshape(2, 3, 5, 5).astype(np.float64)
    m = F.max_pool2d(_t(x), 2, ceil_mode=True).numpy()  # windows of 2 at 0, 2, 4 (last: 1 row)
    want = np.stack([np.stack([x[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].max(axis=(2, 3))
                               for j in range(3)], -1) for i in range(3)], -2)
    np.testing.assert_array_equal(m, want)
    a = F.avg_pool2d(_t(x), 3, stride=2, padding=1).numpy()  # exclusive: in-input mean
    want = np.stack([np.stack([x[:, :, max(2 * i - 1, 0):2 * i + 2,
                                 max(2 * j - 1, 0):2 * j + 2].mean(axis=(2, 3))
                               for j in range(3)], -1) for i in range(3)], -2)
    np.testing.assert_allclose(a, want, rtol=1e-12)
    a = F.avg_pool2d(_t(x), 3, stride=2, padding=1, exclusive=False).numpy()
    np.testing.assert_allclose(a[:, :, 0, 0], x[:, :, :2, :2].sum(axis=(2, 3)) / 9, rtol=1e-12)
    g = F.adaptive_avg_pool2d(_t(x), 1).numpy()
    np.testing.assert_allclose(g, x.mean(axis=(2, 3), keepdims=True), rtol=1e-12)
    up = F.interpolate(_t(x), scale_factor=2, mode="nearest").numpy()
    np.testing.assert_array_equal(up, x.repeat(2, axis=2).repeat(2, axis=3))
    bl = F.interpolate(_t(x), size=[5, 9], mode="bilinear", align_corners=True).numpy()
    np.testing.assert_allclose(bl[..., ::2], x, rtol=1e-12)   # corners aligned: every 2nd column
    np.testing.assert_allclose(bl[..., 1::2], (x[..., :-1] + x[..., 1:]) / 2, rtol=1e-12)
    am = F.adaptive_max_pool2d(_t(x), [2, 1]).numpy()
    np.testing.assert_array_equal(am[:, :, 0, 0], x[:, :, :3].max(axis=(2, 3)))
    np.testing.assert_array_equal(am[:, :, 1, 0], x[:, :, 2:].max(axis=(2, 3)))


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad_modes_values_and_gradients(mode):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4, 5))
    xt = _t(x, True)
    y = F.pad(xt, [1, 2, 3, 0], mode=mode, value=0.25)  # W: (1, 2), H: (3, 0)
    np_mode = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}[mode]
    kw = {"constant_values": 0.25} if mode == "constant" else {}
    want = np.pad(x, ((0, 0), (0, 0), (3, 0), (1, 2)), mode=np_mode, **kw)
    np.testing.assert_array_equal(y.numpy(), want)
    g = rng.standard_normal(want.shape)
    (y * _t(g)).sum().backward()
    # numpy: the gradient of a padded copy is the sum over the positions each element went to
    idx = np.arange(x.size).reshape(x.shape)
    src = np.pad(idx, ((0, 0), (0, 0), (3, 0), (1, 2)), mode=np_mode,
                 **({"constant_values": -1} if mode == "constant" else {}))
    dx = np.zeros(x.size)
    np.add.at(dx, src[src >= 0], g[src >= 0])
    np.testing.assert_allclose(xt.grad.numpy(), dx.reshape(x.shape), rtol=1e-12, atol=1e-12)
    full = F.pad(_t(x), [0, 0, 1, 0, 0, 0, 0, 2], mode=mode, value=0.25)  # every axis, first up
    assert full.shape == [2, 4, 4, 7]


def test_group_and_instance_norm_match_numpy():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 6, 4, 5))
    gn = nn.GroupNorm(3, 6)
    gn.weight.set_value(rng.standard_normal(6).astype(np.float32))
    gn.bias.set_value(rng.standard_normal(6).astype(np.float32))
    w, b = gn.weight.numpy(), gn.bias.numpy()
    xg = x.reshape(3, 3, -1)
    norm = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5))
    want = norm.reshape(x.shape) * w[None, :, None, None] + b[None, :, None, None]
    np.testing.assert_allclose(gn(_t(x)).numpy(), want, rtol=1e-6, atol=1e-6)
    inst = nn.InstanceNorm2D(6)
    mu, var = x.mean((2, 3), keepdims=True), x.var((2, 3), keepdims=True)
    np.testing.assert_allclose(inst(_t(x)).numpy(), (x - mu) / np.sqrt(var + 1e-5),
                               rtol=1e-10, atol=1e-10)


def test_dropout2d_zeroes_whole_channels():
    dt.seed(5)
    layer = nn.Dropout2D(0.5)
    y = layer(dt.ones([4, 8, 3, 3])).numpy()
    per_channel = y.reshape(4, 8, 9)
    assert np.all(per_channel == per_channel[:, :, :1])        # one value per channel
    assert set(np.unique(per_channel)) <= {0.0, 2.0}
    assert 0 < (per_channel[:, :, 0] == 0).sum() < 32
    layer.eval()
    np.testing.assert_array_equal(layer(dt.ones([2, 2, 2, 2])).numpy(), np.ones((2, 2, 2, 2)))


def test_layers_use_the_functional_ops():
    rng = np.random.default_rng(6)
    conv = nn.Conv2D(3, 4, 3, stride=1, padding=1)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    want = _conv_np(x.astype(np.float64), conv.weight.numpy().astype(np.float64), (1, 1),
                    (1, 1, 1, 1))
    np.testing.assert_allclose(conv(_t(x)).numpy(), want, rtol=1e-4, atol=1e-4)
    assert conv.weight.shape == [4, 3, 3, 3] and conv.bias.shape == [4]
    assert nn.Conv2D(4, 4, 3, groups=4, bias_attr=False).bias is None
    assert nn.MaxPool2D(2)(_t(x)).shape == [2, 3, 2, 2]
    assert nn.AvgPool2D(2, 1)(_t(x)).shape == [2, 3, 4, 4]
    assert nn.AdaptiveAvgPool2D([1, 2])(_t(x)).shape == [2, 3, 1, 2]


@pytest.mark.parametrize("call, words", [
    (lambda: F.conv2d(dt.ones([1, 3, 5, 5]), dt.ones([4, 2, 3, 3])),
     ["conv2d", "[1, 3, 5, 5]", "[4, 2, 3, 3]"]),
    (lambda: F.conv2d(dt.ones([1, 4, 5, 5]), dt.ones([6, 2, 3, 3]), groups=3),
     ["conv2d", "groups=3"]),
    (lambda: F.conv2d(dt.ones([1, 3, 2, 2]), dt.ones([4, 3, 3, 3])),
     ["conv2d", "larger than the padded input", "[1, 3, 2, 2]"]),
    (lambda: F.max_pool2d(dt.ones([1, 1, 2, 2]), 3), ["max_pool2d", "output size"]),
    (lambda: F.max_pool2d(dt.ones([1, 1, 6, 6]), 2, padding=2), ["max_pool2d", "half"]),
    (lambda: F.pad(dt.ones([1, 1, 2, 2]), [2, 0], mode="reflect"), ["pad", "reflect", "size 2"]),
    (lambda: F.interpolate(dt.ones([1, 1, 2, 2])), ["interpolate", "size"]),
    (lambda: nn.GroupNorm(4, 6), ["GroupNorm", "num_groups=4"]),
])
def test_bad_input_names_the_op_and_shapes(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
