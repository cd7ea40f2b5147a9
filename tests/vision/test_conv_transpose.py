"""Transposed convolution: ``F.conv2d_transpose`` / ``F.conv1d_transpose`` and their layers
against a numpy scatter loop (values and gradients), the argument forms (output_size, NHWC,
"same", bias), bad input, and the channel-parallel layouts on a mesh (output channels: weight
Shard(1), no communication; input channels: weight Shard(0), output Partial)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import nn
from disttensor.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from references_vision import _conv2d_transpose, _conv2d_transpose_grad  # noqa: E402

S, R, P = dt.Shard, dt.Replicate, dt.Partial


def _attrs(stride=(1, 1), padding=(0, 0, 0, 0), output_padding=(0, 0), dilation=(1, 1),
           groups=1):
    return {"stride": stride, "padding": padding, "output_padding": output_padding,
            "dilation": dilation, "groups": groups}


def _t(a, grad=False):
    return dt.to_tensor(a, stop_gradient=not grad)


@pytest.mark.parametrize("case", [
    dict(stride=2, padding=1, output_padding=1),
    dict(stride=[2, 3], padding=[1, 0, 0, 2], output_padding=[0, 2], dilation=[1, 2],
         groups=2),
    dict(stride=1, padding=[1, 2], dilation=2),
])
def test_conv2d_transpose_values_and_gradients_equal_numpy(case):
    rng = np.random.default_rng(0)
    groups = case.get("groups", 1)
    x, w, b = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((4, 6 // groups, 3, 2)), \
        rng.standard_normal(6)
    xt, wt, bt = _t(x, True), _t(w, True), _t(b, True)
    y = F.conv2d_transpose(xt, wt, bt, **case)
    pad = case["padding"]
    pads = (pad,) * 4 if isinstance(pad, int) else tuple(pad) if len(pad) == 4 else \
        (pad[0], pad[0], pad[1], pad[1])
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    attrs = _attrs(pair(case["stride"]), pads, pair(case.get("output_padding", 0)),
                   pair(case.get("dilation", 1)), groups)
    want = _conv2d_transpose([x, w], attrs, None)[0] + b[None, :, None, None]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(want.shape)
    (y * _t(g)).sum().backward()
    dx, dw = _conv2d_transpose_grad([x, w, g], attrs, None)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(bt.grad.numpy(), g.sum((0, 2, 3)), rtol=1e-12)


def test_output_size_nhwc_same_and_conv1d_transpose():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((3, 2, 3, 3))
    base = _conv2d_transpose([x, w], _attrs((2, 2), (1, 1, 1, 1)), None)[0]   # [7, 9]
    y = F.conv2d_transpose(_t(x), _t(w), stride=2, padding=1, output_size=[8, 9])
    assert y.shape == [2, 2, 8, 9]
    np.testing.assert_allclose(y.numpy()[:, :, :7], base, rtol=1e-12, atol=1e-12)
    y2 = F.conv2d_transpose(_t(x.transpose(0, 2, 3, 1)), _t(w), stride=2, padding=1,
                            output_padding=[1, 0], data_format="NHWC")
    np.testing.assert_allclose(y2.numpy(), y.numpy().transpose(0, 2, 3, 1), rtol=1e-12)
    # "same": conv2d's "same" padding for the input size (Paddle): H pads (0, 1), W (1, 1)
    assert F.conv2d_transpose(_t(x), _t(w), stride=2, padding="same").shape == [2, 2, 8, 9]
    x1, w1 = rng.standard_normal((2, 3, 7)), rng.standard_normal((3, 4, 3))
    y1 = F.conv1d_transpose(_t(x1), _t(w1), stride=2, padding=1, output_padding=1)
    want = _conv2d_transpose([x1[:, :, None], w1[:, :, None]],
                             _attrs((1, 2), (0, 0, 1, 1), (0, 1)), None)[0][:, :, 0]
    np.testing.assert_allclose(y1.numpy(), want, rtol=1e-12, atol=1e-12)
    y1l = F.conv1d_transpose(_t(x1.transpose(0, 2, 1)), _t(w1), stride=2, padding=1,
                             output_padding=1, data_format="NLC")
    np.testing.assert_allclose(y1l.numpy(), want.transpose(0, 2, 1), rtol=1e-12, atol=1e-12)


def test_transpose_layers():
    up = nn.Conv2DTranspose(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    assert up.weight.shape == [4, 3, 3, 3] and up.bias.shape == [6]
    x = np.random.default_rng(2).standard_normal((1, 4, 5, 5)).astype(np.float32)
    y = up(_t(x))
    want = _conv2d_transpose([x.astype(np.float64), up.weight.numpy().astype(np.float64)],
                             _attrs((2, 2), (1,) * 4, (1, 1), groups=2), None)[0]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    assert up(_t(x), output_size=[9, 9]).shape == [1, 6, 9, 9]
    assert nn.Conv1DTranspose(2, 3, 4, stride=2)(dt.ones([1, 2, 5])).shape == [1, 3, 12]
    assert nn.Conv2DTranspose(2, 2, 1, bias_attr=False).bias is None


@pytest.mark.parametrize("call, words", [
    (lambda: F.conv2d_transpose(dt.ones([1, 3, 5, 5]), dt.ones([4, 2, 3, 3])),
     ["conv2d_transpose", "[1, 3, 5, 5]", "[4, 2, 3, 3]"]),
    (lambda: F.conv2d_transpose(dt.ones([1, 4, 5, 5]), dt.ones([4, 2, 3, 3]), groups=3),
     ["conv2d_transpose", "groups=3"]),
    (lambda: F.conv2d_transpose(dt.ones([1, 2, 5, 5]), dt.ones([2, 2, 3, 3]), stride=2,
                                output_padding=2), ["conv2d_transpose", "below the stride"]),
    (lambda: F.conv2d_transpose(dt.ones([1, 2, 5, 5]), dt.ones([2, 2, 3, 3]), stride=2,
                                output_size=[13, 11]), ["conv2d_transpose", "[11, 13)"]),
    (lambda: F.conv2d_transpose(dt.ones([1, 2, 2, 2]), dt.ones([2, 2, 1, 1]), padding=1),
     ["conv2d_transpose", "output size"]),
    (lambda: F.conv2d_transpose(dt.ones([1, 2, 3, 3]), dt.ones([2, 2, 3, 3]), dt.ones([3])),
     ["conv2d_transpose", "bias", "[3]"]),
])
def test_bad_input_names_the_op_and_shapes(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _counts():
    return {k: v for k, v in collectives.collective_counts().items() if v}


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["output_channels", "input_channels"])
def test_channel_parallel_transpose_layouts(case):
    world = dt.get_world_size()
    mesh = dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]) if world == 4 else \
        dt.ProcessMesh(list(range(world)), dim_names=["mp"])
    dp = [S(0)] if mesh.ndim == 2 else []
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 6, 4, 3)), rng.standard_normal((6, 7, 3, 3))
    if case == "output_channels":   # weight Shard(1): output sharded on its channels
        xp_, wp_, want_out = dp + [R()], [R()] * (mesh.ndim - 1) + [S(1)], dp + [S(1)]
    else:                           # weight Shard(0) with x Shard(1): output Partial
        xp_, wp_, want_out = dp + [S(1)], [R()] * (mesh.ndim - 1) + [S(0)], dp + [P()]
    xt = dt.shard_tensor(x, mesh, xp_, stop_gradient=False)
    wt = dt.shard_tensor(w, mesh, wp_, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.conv2d_transpose(xt, wt, stride=2, padding=1, output_padding=1)
    assert _counts() == {}, _counts()
    assert list(y.placements) == want_out
    attrs = _attrs((2, 2), (1,) * 4, (1, 1))
    np.testing.assert_allclose(y.numpy(), _conv2d_transpose([x, w], attrs, None)[0],
                               rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(y.shape)
    (y * dt.shard_tensor(g, mesh, dp + [R()])).sum().backward()
    dx, dw = _conv2d_transpose_grad([x, w, g], attrs, None)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-10, atol=1e-10)
    assert list(wt.grad.placements) == wp_ and list(xt.grad.placements) == xp_
