"""Spatial sharding: conv2d, max_pool2d and avg_pool2d on inputs sharded on H (1-D mesh) or on H
and W (2 x 2 mesh), uneven heights, kernels 3 and 5, strides 1 and 2, dilation 2: values and
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
