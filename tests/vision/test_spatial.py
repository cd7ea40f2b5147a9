"""Spatial sharding: conv2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d, interpolate and pad on
inputs sharded on H (1-D mesh) or on H and W (2 x 2 mesh), uneven heights, kernels 3 and 5,
strides 1 and 2, dilation 2, up- and downsampling: values and
gradients equal numpy, the output keeps the spatial shards, and the only collectives are the
neighbours' sendrecv (x is never all-gathered)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from references_vision import (  # noqa: E402
    _avg_pool2d,
    _avg_pool2d_grad,
    _conv2d,
    _conv2d_grad,
    _max_pool2d,
    _max_pool2d_grad,
    _pad,
    _pad_grad,
    _resample2d,
    _resample2d_grad,
)

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
S, R = dt.Shard, dt.Replicate

CONVS = [  # (H, W, kernel, stride, padding, dilation)
    (11, 7, 3, 1, 1, 1), (13, 9, 5, 1, 2, 1), (12, 10, 3, 2, 1, 1), (14, 11, 3, 1, 2, 2),
    (10, 13, 5, 2, 2, 1),
]


def _meshes():
    out = [("H", dt.ProcessMesh(list(range(WORLD))), [S(2)])]
    if WORLD == 4:
        out.append(("HxW", dt.ProcessMesh([[0, 1], [2, 3]]), [S(2), S(3)]))
    return out


def _counts():
    return {k: v for k, v in collectives.collective_counts().items() if v}


@pytest.mark.parametrize("case", CONVS)
@pytest.mark.parametrize("mesh_name", ["H", "HxW"])
def test_spatially_sharded_conv2d_equals_numpy(case, mesh_name):
    meshes = dict((n, (m, p)) for n, m, p in _meshes())
    if mesh_name not in meshes:
        pytest.skip("H x W sharding needs 4 ranks")
    mesh, place = meshes[mesh_name]
    h, w, k, s, p, d = case
    rng = np.random.default_rng(h * 100 + w)
    x, wt_ = rng.standard_normal((2, 3, h, w)), rng.standard_normal((4, 3, k, k))
    attrs = {"stride": (s, s), "padding": (p,) * 4, "dilation": (d, d), "groups": 1}
    want = _conv2d([x, wt_], attrs, None)[0]
    xt = dt.shard_tensor(x, mesh, place, stop_gradient=False)
    wt = dt.shard_tensor(wt_, mesh, [R()] * mesh.ndim, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.conv2d(xt, wt, stride=s, padding=p, dilation=d)
    counts = _counts()
    assert set(counts) <= {"sendrecv"}, counts        # neighbours only, no gather of x
    assert list(y.placements) == place
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(want.shape)
    collectives.reset_collective_counts()
    (y * dt.shard_tensor(g, mesh, place)).sum().backward()
    assert "all_gather" not in _counts()
    dx, dw = _conv2d_grad([x, wt_, g], attrs, None)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-10, atol=1e-10)
    assert list(xt.grad.placements) == place


@pytest.mark.parametrize("case", [(11, 7, 3, 2, 1, False), (9, 10, 2, 2, 0, True),
                                  (13, 9, 3, 1, 1, False), (10, 11, 3, 2, 1, True)])
@pytest.mark.parametrize("mesh_name", ["H", "HxW"])
@pytest.mark.parametrize("kind", ["max", "avg", "avg_inclusive"])
def test_spatially_sharded_pooling_equals_numpy(case, mesh_name, kind):
    meshes = dict((n, (m, p)) for n, m, p in _meshes())
    if mesh_name not in meshes:
        pytest.skip("H x W sharding needs 4 ranks")
    mesh, place = meshes[mesh_name]
    h, w, k, s, p, ceil = case
    rng = np.random.default_rng(h * 10 + w)
    x = (rng.permutation(2 * 3 * h * w) * 0.37).reshape(2, 3, h, w)
    attrs = {"kernel_size": (k, k), "stride": (s, s), "padding": (p,) * 4, "ceil_mode": ceil,
             "exclusive": kind == "avg"}
    fwd, bwd = (_max_pool2d, _max_pool2d_grad) if kind == "max" else \
        (_avg_pool2d, _avg_pool2d_grad)
    want = fwd([x], attrs, None)[0]
    xt = dt.shard_tensor(x, mesh, place, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.max_pool2d(xt, k, s, p, ceil_mode=ceil) if kind == "max" else \
        F.avg_pool2d(xt, k, s, p, ceil_mode=ceil, exclusive=kind == "avg")
    assert set(_counts()) <= {"sendrecv"}, _counts()
    assert list(y.placements) == place
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(want.shape)
    (y * dt.shard_tensor(g, mesh, place)).sum().backward()
    np.testing.assert_allclose(xt.grad.numpy(), bwd([x, g], attrs, None)[0],
                               rtol=1e-12, atol=1e-12)


def test_sendrecv_count_is_two_per_sharded_axis():
    mesh, place = _meshes()[-1][1:]
    xt = dt.shard_tensor(np.ones((1, 2, 12, 12)), mesh, place)
    wt = dt.shard_tensor(np.ones((2, 2, 3, 3)), mesh, [R()] * mesh.ndim)
    collectives.reset_collective_counts()
    F.conv2d(xt, wt, padding=1)
    assert _counts() == ({"sendrecv": 2 * len(place)} if WORLD > 1 else {})


def test_a_halo_larger_than_a_piece_names_the_rank_and_suggests_fewer_ranks():
    if WORLD < 3:
        pytest.skip("needs pieces smaller than the halo")
    mesh = dt.ProcessMesh(list(range(WORLD)))
    xt = dt.shard_tensor(np.ones((1, 1, WORLD + 1, 8)), mesh, [S(2)])
    wt = dt.shard_tensor(np.ones((1, 1, 7, 1)), mesh, [R()])
    collectives.reset_collective_counts()
    with pytest.raises(ValueError, match=r"conv2d: axis 2 .* coordinate \d+ .*fewer ranks"):
        F.conv2d(xt, wt, padding=[3, 0])
    assert _counts() == {}


RESAMPLES = [  # (H, W, call, attrs of the resample2d op)
    (11, 9, lambda t: F.adaptive_avg_pool2d(t, [5, 4]),
     {"out_hw": (5, 4), "mode": "area", "align_corners": False, "ratio": None}),
    (13, 10, lambda t: F.adaptive_avg_pool2d(t, [7, 6]),
     {"out_hw": (7, 6), "mode": "area", "align_corners": False, "ratio": None}),
    (9, 11, lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"),
     {"out_hw": (18, 22), "mode": "bilinear", "align_corners": False, "ratio": (0.5, 0.5)}),
    (10, 9, lambda t: F.interpolate(t, size=[13, 7], mode="nearest"),
     {"out_hw": (13, 7), "mode": "nearest", "align_corners": False, "ratio": None}),
    (12, 10, lambda t: F.interpolate(t, size=[7, 15], mode="bilinear", align_corners=True),
     {"out_hw": (7, 15), "mode": "bilinear", "align_corners": True, "ratio": None}),
]


@pytest.mark.parametrize("case", range(len(RESAMPLES)))
@pytest.mark.parametrize("mesh_name", ["H", "HxW"])
def test_spatially_sharded_resampling_equals_numpy(case, mesh_name):
    meshes = dict((n, (m, p)) for n, m, p in _meshes())
    if mesh_name not in meshes:
        pytest.skip("H x W sharding needs 4 ranks")
    mesh, place = meshes[mesh_name]
    h, w, call, attrs = RESAMPLES[case]
    rng = np.random.default_rng(h * 10 + w)
    x = rng.standard_normal((2, 3, h, w))
    want = _resample2d([x], attrs, None)[0]
    xt = dt.shard_tensor(x, mesh, place, stop_gradient=False)
    collectives.reset_collective_counts()
    y = call(xt)
    assert _counts() == ({"sendrecv": 2 * len(place)} if WORLD > 1 else {}), _counts()
    assert list(y.placements) == place
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    g = rng.standard_normal(want.shape)
    gt = dt.shard_tensor(g, mesh, place)
    collectives.reset_collective_counts()
    (y * gt).sum().backward()
    assert "all_gather" not in _counts() and "all_to_all" not in _counts(), _counts()
    np.testing.assert_allclose(xt.grad.numpy(), _resample2d_grad([x, g], attrs, None)[0],
                               rtol=1e-12, atol=1e-12)
    assert list(xt.grad.placements) == place


def test_resampling_whose_windows_pass_the_neighbours_moves_the_axis_instead():
    mesh = dt.ProcessMesh(list(range(WORLD)))
    x = np.random.default_rng(5).standard_normal((2, 3, 11, 6))
    xt = dt.shard_tensor(x, mesh, [S(2)], stop_gradient=False)
    y = F.adaptive_avg_pool2d(xt, 1)  # every output reads every row: no halo fits past 2 ranks
    if WORLD >= 3:
        assert S(2) not in list(y.placements)
    np.testing.assert_allclose(y.numpy(), x.mean((2, 3), keepdims=True), rtol=1e-12)
    y.sum().backward()
    np.testing.assert_allclose(xt.grad.numpy(), np.full(x.shape, 1 / 66), rtol=1e-12)


PADS = [  # (H, W, pad [left, right, top, bottom], mode)
    (11, 9, [1, 2, 2, 1], "constant"), (9, 10, [2, 1, 3, 2], "reflect"),
    (10, 7, [0, 3, 1, 4], "replicate"), (13, 6, [1, 1, 0, 5], "constant"),
]


@pytest.mark.parametrize("case", PADS)
@pytest.mark.parametrize("mesh_name", ["H", "HxW"])
def test_spatially_sharded_pad_equals_numpy(case, mesh_name):
    meshes = dict((n, (m, p)) for n, m, p in _meshes())
    if mesh_name not in meshes:
        pytest.skip("H x W sharding needs 4 ranks")
    mesh, place = meshes[mesh_name]
    h, w, pad, mode = case
    rng = np.random.default_rng(h * 10 + w)
    x = rng.standard_normal((2, 3, h, w))
    attrs = {"pads": ((0, 0), (0, 0), (pad[2], pad[3]), (pad[0], pad[1])), "mode": mode,
             "value": 0.5}
    want = _pad([x], attrs, None)[0]
    xt = dt.shard_tensor(x, mesh, place, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.pad(xt, pad, mode=mode, value=0.5)
    assert set(_counts()) <= {"sendrecv"}, _counts()
    assert list(y.placements) == place
    np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=0)
    g = rng.standard_normal(want.shape)
    gt = dt.shard_tensor(g, mesh, place)
    collectives.reset_collective_counts()
    (y * gt).sum().backward()
    assert set(_counts()) <= {"sendrecv"}, _counts()
    np.testing.assert_allclose(xt.grad.numpy(), _pad_grad([g], attrs, None)[0], rtol=1e-12,
                               atol=1e-12)
    assert list(xt.grad.placements) == place


def test_pad_reaching_past_the_neighbours_gathers_the_axis():
    mesh = dt.ProcessMesh(list(range(WORLD)))
    x = np.random.default_rng(6).standard_normal((1, 2, 5, 3))
    xt = dt.shard_tensor(x, mesh, [S(2)], stop_gradient=False)
    y = F.pad(xt, [0, 0, 4, 0], mode="reflect")  # the first rows mirror rows 1..4
    if WORLD == 4:
        assert S(2) not in list(y.placements)
    np.testing.assert_array_equal(y.numpy(), np.pad(x, ((0, 0), (0, 0), (4, 0), (0, 0)),
                                                    mode="reflect"))
