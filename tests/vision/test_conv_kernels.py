"""The conv2d kernels' paths: Winograd F(2x2, 3x3) (3x3, stride 1, many channels, with numba)
and im2col give numpy's values and gradients, odd sizes, asymmetric padding and both float
dtypes included; the im2col columns are built chunk by chunk into one buffer."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor.nn import functional as F
from disttensor.ops import conv, conv_winograd, fast

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed"))
from references_vision import _conv2d, _conv2d_grad  # noqa: E402


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
@pytest.mark.parametrize("shape, padding", [
    ((2, 16, 9, 7), (1, 1, 1, 1)), ((3, 16, 6, 5), (0, 2, 1, 0)), ((1, 20, 3, 4), (0, 0, 0, 0)),
    ((2, 16, 2, 2), (1, 1, 1, 1)),
])
def test_winograd_conv_values_and_gradients_equal_numpy(shape, padding, dtype, tol):
    rng = np.random.default_rng(sum(shape))
    x, w = rng.standard_normal(shape), rng.standard_normal((24, shape[1], 3, 3))
    if fast.BACKEND == "numba":  # this case takes the Winograd path wherever numba is there
        assert conv_winograd.fits(np, x.astype(dtype), w.astype(dtype), w.shape, (1, 1),
                                  (1, 1), 1)
    xt = dt.to_tensor(x.astype(dtype), stop_gradient=False)
    wt = dt.to_tensor(w.astype(dtype), stop_gradient=False)
    y = F.conv2d(xt, wt, padding=[padding[0], padding[1], padding[2], padding[3]])
    attrs = {"stride": (1, 1), "padding": padding, "dilation": (1, 1), "groups": 1}
    want = _conv2d([x, w], attrs, None)[0]
    scale = np.abs(want).max()
    np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=tol * scale)
    g = rng.standard_normal(want.shape)
    (y * dt.to_tensor(g.astype(dtype))).sum().backward()
    dx, dw = _conv2d_grad([x, w, g], attrs, None)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=0, atol=tol * np.abs(dx).max())
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=0, atol=tol * np.abs(dw).max())


def test_im2col_chunks_share_one_buffer_and_cover_every_sample(monkeypatch):
    monkeypatch.setattr(conv, "CHUNK_BYTES", 1)  # one sample per chunk
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3, 6, 7)), rng.standard_normal((4, 3, 2, 3))
    attrs = dict(stride=(2, 1), padding=(1, 0, 1, 1), dilation=(1, 2), groups=1)
    chunks = list(conv._chunks(np, x, w.shape, **attrs))
    assert [(a, b) for a, b, _ in chunks] == [(k, k + 1) for k in range(5)]
    assert len({c.__array_interface__["data"][0] for _, _, c in chunks}) == 1
    got = conv.conv2d_kernel(np, x, w, **attrs)
    np.testing.assert_allclose(got, _conv2d([x, w], attrs, None)[0], rtol=1e-12, atol=1e-12)
