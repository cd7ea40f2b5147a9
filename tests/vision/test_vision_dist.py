"""Layouts of the vision ops on a mesh: batch over dp and channels over mp run without
communication (column-parallel conv: weight Shard(0); row-parallel: weight Shard(1), output
Partial), a channel-sharded BatchNorm2D all-reduces only its statistics, and values and
gradients equal numpy on the global arrays."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor.nn import functional as F

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
S, R, P = dt.Shard, dt.Replicate, dt.Partial


def _mesh():
    """[dp, mp] = 2 x 2 at 4 ranks, else every rank on both roles of a 1-D mesh."""
    if WORLD == 4:
        return dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    return dt.ProcessMesh(list(range(WORLD)), dim_names=["dp"])


def _place(mesh, dp=None, mp=None):
    """Placements putting tensor dim ``dp`` on the dp mesh dim and ``mp`` on the mp one (on a
    1-D mesh only ``dp``, or ``mp`` when dp is None)."""
    if mesh.ndim == 1:
        d = dp if dp is not None else mp
        return [R() if d is None else S(d)]
    return [R() if d is None else S(d) for d in (dp, mp)]


def _conv_np(x, w, pad):
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    kh, kw = w.shape[2:]
    ho, wo = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", xp[:, :, i:i + ho, j:j + wo], w[:, :, i, j])
    return out


def _counts():
    return {k: v for k, v in collectives.collective_counts().items() if v}


@pytest.mark.parametrize("case", ["data", "column", "row"])
def test_conv2d_parallel_layouts_communicate_as_promised(case):
    mesh = _mesh()
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 6, 5, 4)), rng.standard_normal((7, 6, 3, 3))
    dp = 0 if mesh.ndim == 2 or case == "data" else None  # a 1-D mesh plays one role
    xp_, wp_, want_out = {
        "data": (_place(mesh, dp=0), _place(mesh), _place(mesh, dp=0)),
        "column": (_place(mesh, dp=dp), _place(mesh, mp=0), _place(mesh, dp=dp, mp=1)),
        "row": (_place(mesh, dp=dp, mp=1), _place(mesh, mp=1),
                [S(0), P()] if mesh.ndim == 2 else [P()]),
    }[case]
    xt = dt.shard_tensor(x, mesh, xp_, stop_gradient=False)
    wt = dt.shard_tensor(w, mesh, wp_, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.conv2d(xt, wt, padding=1)
    assert _counts() == {}, f"{case}: forward communicated {_counts()}"
    assert list(y.placements) == want_out
    np.testing.assert_allclose(y.numpy(), _conv_np(x, w, 1), rtol=1e-12, atol=1e-12)
    g = rng.standard_normal((5, 7, 5, 4))
    (y * dt.shard_tensor(g, mesh, _place(mesh, dp=0))).sum().backward()
    # numpy gradients: dx = conv of g with the flipped, transposed w; dw = correlation
    gp = np.pad(g, ((0, 0), (0, 0), (1, 1), (1, 1)))
    dx = _conv_np(gp, np.flip(w, (2, 3)).transpose(1, 0, 2, 3), 0)
    xpad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    dw = np.stack([np.stack([np.einsum("nohw,nchw->oc", g, xpad[:, :, i:i + 5, j:j + 4])
                             for j in range(3)], -1) for i in range(3)], -2)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-10, atol=1e-10)
    assert list(wt.grad.placements) == list(wt.placements)


def test_channel_sharded_batch_norm_reduces_only_its_statistics():
    mesh = _mesh()
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((6, 5, 3, 4)), rng.standard_normal(5)
    xt = dt.shard_tensor(x, mesh, _place(mesh, dp=0, mp=1), stop_gradient=False)
    vec = _place(mesh, mp=0) if mesh.ndim == 2 else _place(mesh)  # channel-parallel buffers
    mean, var = (dt.shard_tensor(np.full(5, v), mesh, vec) for v in (0.0, 1.0))
    wt = dt.shard_tensor(w, mesh, vec, stop_gradient=False)
    collectives.reset_collective_counts()
    y = F.batch_norm(xt, mean, var, wt, training=True)
    counts = _counts()
    assert set(counts) <= {"all_reduce"}, counts        # statistics only: x is never gathered
    assert list(y.placements) == list(xt.placements)
    mu, sig2 = x.mean((0, 2, 3)), x.var((0, 2, 3))
    xhat = (x - mu[:, None, None]) / np.sqrt(sig2[:, None, None] + 1e-5)
    np.testing.assert_allclose(y.numpy(), xhat * w[:, None, None], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(mean.numpy(), 0.1 * mu, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(var.numpy(), 0.9 + 0.1 * sig2, rtol=1e-10)
    g = rng.standard_normal(x.shape)
    (y * dt.shard_tensor(g, mesh, _place(mesh, dp=0, mp=1))).sum().backward()
    np.testing.assert_allclose(wt.grad.numpy(), (g * xhat).sum((0, 2, 3)), rtol=1e-10)


@pytest.mark.parametrize("pool", ["max", "avg", "adaptive"])
def test_pooling_keeps_batch_and_channel_shards_without_communication(pool):
    mesh = _mesh()
    rng = np.random.default_rng(2)
    x = rng.permutation(5 * 3 * 6 * 5).reshape(5, 3, 6, 5).astype(np.float64)
    xt = dt.shard_tensor(x, mesh, _place(mesh, dp=0, mp=1), stop_gradient=False)
    collectives.reset_collective_counts()
    fn = {"max": lambda t: F.max_pool2d(t, 2), "avg": lambda t: F.avg_pool2d(t, 2),
          "adaptive": lambda t: F.adaptive_avg_pool2d(t, 1)}[pool]
    y = fn(xt)
    assert _counts() == {}
    assert list(y.placements) == list(xt.placements)
    blocks = x[:, :, :6, :4].reshape(5, 3, 3, 2, 2, 2)
    want = {"max": blocks.max(axis=(3, 5)), "avg": blocks.mean(axis=(3, 5)),
            "adaptive": x.mean(axis=(2, 3), keepdims=True)}[pool]
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12)
    y.sum().backward()
    if pool == "max":  # one 1 per window, at its maximum
        dx = xt.grad.numpy()[:, :, :6, :4].reshape(5, 3, 3, 2, 2, 2)
        np.testing.assert_array_equal(dx.sum(axis=(3, 5)), np.ones((5, 3, 3, 2)))
        np.testing.assert_array_equal((dx * blocks).sum(axis=(3, 5)), want)
    elif pool == "adaptive":
        np.testing.assert_allclose(xt.grad.numpy(), np.full(x.shape, 1 / 30), rtol=1e-12)


def test_bad_distributed_input_raises_on_every_rank_before_communicating():
    mesh = _mesh()
    xt = dt.shard_tensor(np.ones((4, 3, 5, 5)), mesh, _place(mesh, dp=0))
    wt = dt.shard_tensor(np.ones((4, 2, 3, 3)), mesh, _place(mesh, mp=0))
    collectives.reset_collective_counts()
    with pytest.raises(ValueError, match=r"conv2d: .*\[4, 3, 5, 5\].*\[4, 2, 3, 3\]"):
        F.conv2d(xt, wt)
    with pytest.raises(ValueError, match="conv2d: .*larger than the padded input"):
        F.conv2d(xt, dt.shard_tensor(np.ones((4, 3, 7, 7)), mesh, _place(mesh)))
    assert _counts() == {}
