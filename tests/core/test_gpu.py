"""The op checks on ``place="gpu"`` (cupy): forward values and gradients equal the numpy ones.

Skipped where cupy with a CUDA device is not importable."""
from __future__ import annotations

import numpy as np
import pytest
from core_samples import SAMPLES

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.ops import OPS

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

# a representative list: every kernel family, every kernel that branches on xp (erf, scatter-add)
GPU_OPS = ["add", "divide", "maximum", "pow", "exp", "gelu", "sigmoid", "relu", "scale", "cast",
           "clip", "where", "matmul", "sum", "max", "reshape", "transpose", "slice", "set_value",
           "split", "concat", "stack", "expand", "tile", "softmax", "log_softmax", "layer_norm",
           "batch_norm", "batch_norm_infer", "embedding", "cross_entropy", "dropout", "gather"]


def _run(op, arrays, attrs, place, weights=None):
    """Outputs (numpy) and, with weights, the grads of sum_i <w_i, out_i> (numpy)."""
    gin = [i for i in (op.grad_inputs if op.grad_inputs is not None else range(len(arrays)))
           if arrays[i] is not None and np.asarray(arrays[i]).dtype.kind == "f"]
    ts = [None if a is None else dt.to_tensor(a, place=place, stop_gradient=i not in gin)
          for i, a in enumerate(arrays)]
    outs = apply(op, tuple(ts), attrs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    for o in outs:
        assert o.place.startswith(place), (op.name, o.place)
    values = [o.numpy() for o in outs]
    if weights is None:
        return values, None
    slots = sorted(weights)
    seeds = [dt.to_tensor(weights[i].astype(values[i].dtype), place=place) for i in slots]
    grads = dt.grad([outs[i] for i in slots], [ts[i] for i in gin], grad_outputs=seeds,
                    allow_unused=True)
    return values, [None if g is None else g.numpy() for g in grads]


@pytest.mark.parametrize("name", GPU_OPS)
def test_gpu_matches_cpu(name):
    op = OPS[name]
    for k, build in enumerate(SAMPLES[name]):
        rng = np.random.default_rng(2000 + k)
        arrays, attrs = build(rng)
        cpu_vals, _ = _run(op, arrays, attrs, "cpu")
        weights = {i: rng.standard_normal(v.shape) for i, v in enumerate(cpu_vals)
                   if i not in op.nondiff_outputs and v.dtype.kind == "f"}
        cpu_vals, cpu_grads = _run(op, arrays, attrs, "cpu", weights)
        gpu_vals, gpu_grads = _run(op, arrays, attrs, "gpu", weights)
        for c, g in zip(cpu_vals, gpu_vals):
            np.testing.assert_allclose(g, c, rtol=1e-7, atol=1e-9, err_msg=f"{name} forward")
        for c, g in zip(cpu_grads, gpu_grads):
            if c is None:
                assert g is None
                continue
            np.testing.assert_allclose(g, c, rtol=1e-7, atol=1e-9, err_msg=f"{name} backward")


def test_gpu_public_functions_and_inplace():
    x_np = np.random.default_rng(0).standard_normal((4, 3))
    x = dt.to_tensor(x_np, place="gpu", stop_gradient=False)
    loss = dt.cross_entropy(x, dt.to_tensor(np.array([0, 2, 1, -100]), place="gpu"))
    loss.backward()
    ref = dt.to_tensor(x_np, stop_gradient=False)
    ref_loss = dt.cross_entropy(ref, dt.to_tensor(np.array([0, 2, 1, -100])))
    ref_loss.backward()
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), ref.grad.numpy(), rtol=1e-10)
    assert x.grad.place.startswith("gpu")
    y = dt.to_tensor(x_np, place="gpu")
    v = y[1:]
    assert y.add_(1.0) is y and v.inplace_version == 1
    np.testing.assert_allclose(v.numpy(), x_np[1:] + 1)
    dt.seed(3)
    d_gpu = dt.dropout(dt.to_tensor(np.ones((5, 7)), place="gpu"), 0.5).numpy()
    dt.seed(3)
    d_cpu = dt.dropout(dt.to_tensor(np.ones((5, 7))), 0.5).numpy()
    np.testing.assert_array_equal(d_gpu, d_cpu)
    nm = dt.numel(y)
    assert nm.item() == 12 and nm.place.startswith("gpu")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("l2,wd", [(0.0, 0.0), (0.1, 0.2)])
def test_gpu_adam_update_is_adams_third_step(l2, wd, dtype):
    """The fused cupy Adam(W) update, in place, against the float64 formula; the beta powers
    and learning rate stay on the host as the optimizer makes them."""
    import cupy as cp
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    rng = np.random.default_rng(5)
    p64, g64, m64 = (rng.standard_normal((33, 65)) for _ in range(3))
    v64 = np.abs(rng.standard_normal((33, 65))) * 0.1
    gi = g64 + l2 * p64
    wm = b1 * m64 + (1 - b1) * gi
    wv = b2 * v64 + (1 - b2) * gi * gi
    wp = p64 * (1 - lr * wd) - lr / (1 - b1 ** 3) * wm / (np.sqrt(wv / (1 - b2 ** 3)) + eps)
    p, g, m, v = (cp.asarray(a.astype(dtype)) for a in (p64, g64, m64, v64))
    b1p, b2p = np.array([b1 ** 2]), np.array([b2 ** 2])
    out = OPS["adam_update"].kernel(cp, p, g, m, v, b1p, b2p, np.array(lr), beta1=b1, beta2=b2,
                                    epsilon=eps, l2=l2, weight_decay=wd, lr_scale=1.0)
    assert out[0] is p and out[1] is m and out[2] is v
    tol = 2e-6 if dtype == np.float32 else 1e-12
    for got, want in ((m, wm), (v, wv), (p, wp)):
        np.testing.assert_allclose(cp.asnumpy(got), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(b1p, [b1 ** 3], rtol=1e-15)


@pytest.mark.parametrize("approximate", [False, True])
def test_gpu_gelu_float32_against_the_float64_formula(approximate):
    import math

    import cupy as cp
    x64 = np.concatenate([np.linspace(-9.0, 9.0, 2001), [-1e4, -100.0, -30.0, -12.0, 12.0, 30.0,
                                                         100.0, 1e4]])  # exp(-2u) overflows
    g64 = np.random.default_rng(6).standard_normal(x64.shape)
    if approximate:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x64 + 0.044715 * x64 ** 3))
        want = 0.5 * x64 * (1 + t)
        dwant = g64 * (0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * c * (1 + 3 * 0.044715 * x64 ** 2))
    else:
        cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x64])
        want = x64 * cdf
        dwant = g64 * (cdf + x64 * np.exp(-0.5 * x64 ** 2) / math.sqrt(2 * math.pi))
    x = cp.asarray(x64.astype(np.float32))
    got = OPS["gelu"].kernel(cp, x, approximate=approximate)
    dgot = OPS["gelu_grad"].kernel(cp, x, cp.asarray(g64.astype(np.float32)),
                                   approximate=approximate)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(dgot), dwant, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_gpu_row_kernels_against_numpy_formulas(n, dtype):
    """softmax, layer_norm and their gradients (one thread block per row) on rows shorter and
    longer than a block, against float64 numpy; softmax also in place and from a strided x."""
    import cupy as cp
    rng = np.random.default_rng(n)
    x64, g64 = rng.standard_normal((2, 3, n)) * 3, rng.standard_normal((2, 3, n))
    w64, b64 = rng.standard_normal(n), rng.standard_normal(n)
    tol = {"rtol": 2e-5, "atol": 2e-6} if dtype == np.float32 else {"rtol": 1e-11, "atol": 1e-13}
    x, g = cp.asarray(x64.astype(dtype)), cp.asarray(g64.astype(dtype))

    e = np.exp(x64 - x64.max(-1, keepdims=True))
    y64 = e / e.sum(-1, keepdims=True)
    y = OPS["softmax"].kernel(cp, x, axis=2)
    np.testing.assert_allclose(cp.asnumpy(y), y64, **tol)
    dy64 = y64 * (g64 - (y64 * g64).sum(-1, keepdims=True))
    np.testing.assert_allclose(cp.asnumpy(OPS["softmax_grad"].kernel(cp, y, g, axis=2)), dy64,
                               **tol)
    inplace = x.copy()
    assert OPS["softmax"].kernel(cp, inplace, axis=2, out=inplace) is inplace
    np.testing.assert_allclose(cp.asnumpy(inplace), y64, **tol)
    wide = cp.zeros((2, 3, 2 * n), dtype)
    wide[..., ::2] = x
    np.testing.assert_allclose(cp.asnumpy(OPS["softmax"].kernel(cp, wide[..., ::2], axis=2)),
                               y64, **tol)

    mean64 = x64.mean(-1)
    rstd64 = 1 / np.sqrt(((x64 - mean64[..., None]) ** 2).mean(-1) + 1e-5)
    xhat = (x64 - mean64[..., None]) * rstd64[..., None]
    for w, b in ((w64, b64), (None, None)):
        wc = None if w is None else cp.asarray(w.astype(dtype))
        bc = None if b is None else cp.asarray(b.astype(dtype))
        out, mean, rstd = OPS["layer_norm"].kernel(cp, x, wc, bc, begin_norm_axis=2,
                                                   epsilon=1e-5)
        want = xhat * (1 if w is None else w) + (0 if b is None else b)
        np.testing.assert_allclose(cp.asnumpy(out), want, **tol)
        np.testing.assert_allclose(cp.asnumpy(mean), mean64, **tol)
        np.testing.assert_allclose(cp.asnumpy(rstd), rstd64, rtol=tol["rtol"] * 10)
        dx, dw, db = OPS["layer_norm_grad"].kernel(cp, x, wc, mean, rstd, g, begin_norm_axis=2,
                                                   epsilon=1e-5)
        dxhat = g64 * (1 if w is None else w)
        want_dx = rstd64[..., None] * (dxhat - dxhat.mean(-1, keepdims=True)
                                       - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        gtol = {k: v * 50 for k, v in tol.items()}
        np.testing.assert_allclose(cp.asnumpy(dx), want_dx, **gtol)
        np.testing.assert_allclose(cp.asnumpy(dw), (g64 * xhat).sum((0, 1)), **gtol)
        np.testing.assert_allclose(cp.asnumpy(db), g64.sum((0, 1)), **gtol)
