"""Kernels declared ``accepts_out``: called with ``out=`` they write the result into the given
buffer and return it, equal to a numpy oracle; ``out`` may also be one of the inputs the op may
``reuse`` (the memory planner's buffer reuse, an inplace variant). Also the folded matmul
(one GEMM over the leading dims) and its weight gradient on 3-D inputs, dense and distributed."""
from __future__ import annotations

import math

import numpy as np
import pytest

import disttensor as dt
from disttensor.schema import DENSE_CTX, OPS

RNG = np.random.default_rng(13)
C, A = math.sqrt(2.0 / math.pi), 0.044715


def n(*shape):
    return RNG.standard_normal(shape)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _phi(x):
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + A * x ** 3)))


def _gelu_tanh_grad(x):
    t = np.tanh(C * (x + A * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t ** 2) * C * (1.0 + 3.0 * A * x ** 2)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax(x, axis):
    z = x - x.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


X, Y, POS = n(3, 4), n(3, 4), np.abs(n(3, 4)) + 0.5
S3 = _softmax(n(2, 3, 5), 1)
LS3 = _log_softmax(n(2, 3, 5), 1)
G3 = n(2, 3, 5)
LOGITS = n(4, 6)
LABEL = np.array([1, 5, -100, 0])
DLOSS = np.abs(n(4, 1))


def _ce_grad_oracle(sm, label, dloss):
    hot = np.zeros_like(sm)
    ok = label != -100
    hot[np.arange(len(label))[ok], label[ok]] = 1.0
    return (sm - hot) * dloss * ok[:, None]


# op -> list of (inputs, attrs, oracle); one case per interesting path
CASES = {
    "add": [((X, Y), {}, X + Y), ((X, n(4)), {}, None)],
    "subtract": [((X, Y), {}, X - Y)],
    "multiply": [((X, Y), {}, X * Y)],
    "divide": [((X, POS), {}, X / POS)],
    "pow": [((POS, Y), {}, POS ** Y)],
    "maximum": [((X, Y), {}, np.maximum(X, Y))],
    "minimum": [((X, Y), {}, np.minimum(X, Y))],
    "minmax_mask": [((X, Y), {"pick": "maximum"}, (X >= Y).astype(float)),
                    ((X, Y), {"pick": "minimum"}, (X <= Y).astype(float))],
    "equal": [((X, X.round()), {}, X == X.round())],
    "not_equal": [((X, X.round()), {}, X != X.round())],
    "less_than": [((X, Y), {}, X < Y)],
    "less_equal": [((X, Y), {}, X <= Y)],
    "greater_than": [((X, Y), {}, X > Y)],
    "greater_equal": [((X, Y), {}, X >= Y)],
    "logical_and": [((X > 0, Y > 0), {}, (X > 0) & (Y > 0))],
    "logical_or": [((X > 0, Y > 0), {}, (X > 0) | (Y > 0))],
    "logical_not": [((X > 0,), {}, X <= 0)],
    "neg": [((X,), {}, -X)],
    "abs": [((X,), {}, np.abs(X))],
    "abs_grad": [((X, Y), {}, Y * np.sign(X))],
    "exp": [((X,), {}, np.exp(X))],
    "exp_grad": [((POS, Y), {}, Y * POS)],
    "log": [((POS,), {}, np.log(POS))],
    "log_grad": [((POS, Y), {}, Y / POS)],
    "sqrt": [((POS,), {}, np.sqrt(POS))],
    "sqrt_grad": [((POS, Y), {}, Y * 0.5 / POS)],
    "rsqrt": [((POS,), {}, 1.0 / np.sqrt(POS))],
    "rsqrt_grad": [((POS, Y), {}, Y * -0.5 * POS ** 3)],
    "tanh": [((X,), {}, np.tanh(X))],
    "tanh_grad": [((np.tanh(X), Y), {}, Y * (1.0 - np.tanh(X) ** 2))],
    "sigmoid": [((X,), {}, _sig(X))],
    "sigmoid_grad": [((_sig(X), Y), {}, Y * _sig(X) * (1.0 - _sig(X)))],
    "relu": [((X,), {}, np.where(X > 0, X, 0.0))],
    "relu_grad": [((np.where(X > 0, X, 0.0), Y), {}, Y * (X > 0))],
    "silu": [((X,), {}, X * _sig(X))],
    "silu_grad": [((X, Y), {}, Y * (_sig(X) + X * _sig(X) * (1.0 - _sig(X))))],
    "gelu": [((X,), {"approximate": False}, X * _phi(X)),
             ((X,), {"approximate": True}, _gelu_tanh(X))],
    "gelu_grad": [((X, Y), {"approximate": False},
                   Y * (_phi(X) + X * np.exp(-0.5 * X * X) / math.sqrt(2.0 * math.pi))),
                  ((X, Y), {"approximate": True}, Y * _gelu_tanh_grad(X))],
    "scale": [((X,), {"scale": 2.5, "bias": 1.0, "bias_after_scale": True}, X * 2.5 + 1.0),
              ((X,), {"scale": 2.5, "bias": 1.0, "bias_after_scale": False}, (X + 1.0) * 2.5)],
    "clip": [((X,), {"min": -0.5, "max": 0.5}, np.clip(X, -0.5, 0.5))],
    "clip_grad": [((np.clip(X, -0.5, 0.5), Y), {"min": -0.5, "max": 0.5},
                   Y * (np.abs(np.clip(X, -0.5, 0.5)) < 0.5)),
                  ((np.clip(X, -0.5, None), Y), {"min": -0.5, "max": None},
                   Y * (np.clip(X, -0.5, None) > -0.5)),
                  ((X, Y), {"min": None, "max": None}, Y)],
    "cast": [((X,), {"dtype": np.dtype(np.float32), "src_dtype": np.dtype(np.float64)},
              X.astype(np.float32))],
    "full_like": [((X,), {"fill_value": 2.5, "dtype": np.dtype(np.float64)}, np.full((3, 4), 2.5))],
    "softmax": [((X,), {"axis": 1}, _softmax(X, 1)), ((G3,), {"axis": 1}, _softmax(G3, 1))],
    "log_softmax": [((X,), {"axis": 1}, _log_softmax(X, 1)),
                    ((G3,), {"axis": 0}, _log_softmax(G3, 0))],
    "softmax_grad": [((S3, G3), {"axis": 1}, S3 * (G3 - (G3 * S3).sum(1, keepdims=True))),
                     ((_softmax(X, 1), Y), {"axis": 1},
                      _softmax(X, 1) * (Y - (Y * _softmax(X, 1)).sum(1, keepdims=True)))],
    "log_softmax_grad": [((LS3, G3), {"axis": 1}, G3 - np.exp(LS3) * G3.sum(1, keepdims=True))],
    "matmul": [((n(2, 3, 4), n(4, 5)), {}, None), ((n(2, 3, 4), n(5, 4)), {"transpose_y": True},
                                                   None),
               ((n(2, 4, 3), n(4, 5)), {"transpose_x": True}, None), ((X, n(4, 2)), {}, None),
               ((n(2, 3, 4), n(2, 4, 5)), {}, None)],
    "reshape": [((n(2, 3, 4).transpose(1, 0, 2),), {"shape": (3, 8)}, None),
                ((X,), {"shape": (2, 6)}, X.reshape(2, 6))],
    "set_value": [((X, np.array(5.0)), {"index": (slice(0, 2), 1)},
                   np.where((np.arange(3)[:, None] < 2) & (np.arange(4) == 1), 5.0, X))],
    "cross_entropy_grad": [((_softmax(LOGITS, 1), LABEL, DLOSS),
                            {"axis": 1, "ignore_index": -100},
                            _ce_grad_oracle(_softmax(LOGITS, 1), LABEL, DLOSS))],
    "cross_entropy_mean_grad": [((_softmax(LOGITS, 1), LABEL, np.array(3.0), np.array(0.7)),
                                 {"axis": 1, "ignore_index": -100},
                                 _ce_grad_oracle(_softmax(LOGITS, 1), LABEL,
                                                 np.full((4, 1), 0.7 / 3.0)))],
}

# the tensor ops (math family, tril/triu with their ctx, scatter writing through out=)
MASK = X > 0.3
CASES.update({
    "sin": [((X,), {}, np.sin(X))], "sin_grad": [((X, Y), {}, Y * np.cos(X))],
    "cos": [((X,), {}, np.cos(X))], "cos_grad": [((X, Y), {}, -Y * np.sin(X))],
    "erf": [((X,), {}, _erf(X))],
    "erf_grad": [((X, Y), {}, Y * 2.0 / math.sqrt(math.pi) * np.exp(-X * X))],
    "square": [((X,), {}, X * X)], "square_grad": [((X, Y), {}, 2.0 * X * Y)],
    "reciprocal": [((POS,), {}, 1.0 / POS)],
    "reciprocal_grad": [((1.0 / POS, Y), {}, -Y / POS ** 2)],
    "log1p": [((POS,), {}, np.log1p(POS))], "log1p_grad": [((POS, Y), {}, Y / (1.0 + POS))],
    "floor": [((X,), {}, np.floor(X))], "sign": [((X,), {}, np.sign(X))],
    "masked_fill": [((X, MASK, np.array(-2.0)), {}, np.where(MASK, -2.0, X))],
    "tril": [((X,), {"diagonal": 0}, np.tril(X)), ((X,), {"diagonal": -1}, np.tril(X, -1))],
    "triu": [((X,), {"diagonal": 1}, np.triu(X, 1))],
    "scatter": [((X, np.array([2, 0]), Y[:2]), {"index": (slice(0, 3, 1), slice(0, 4, 1)),
                                                 "axis": 0, "overwrite": True},
                 np.concatenate([Y[1:2], X[1:2], Y[0:1]]))],
})


def _matmul_oracle(x, y, transpose_x=False, transpose_y=False):
    if transpose_x:
        x = np.swapaxes(x, -1, -2)
    if transpose_y:
        y = np.swapaxes(y, -1, -2)
    return np.einsum("...ik,...kj->...ij", x, y)


def _oracle(name, inputs, attrs, ref):
    if ref is not None:
        return ref
    if name == "matmul":
        return _matmul_oracle(*inputs, **attrs)
    if name == "add":
        return inputs[0] + inputs[1]
    if name == "reshape":  # numpy's C-order reshape of a strided array
        return np.array(inputs[0].tolist()).reshape(attrs["shape"])
    raise AssertionError(name)


def _cases(reusing: bool = False):
    """Every case; with ``reusing``, one per (case, input the op may write its result into)
    that has the result's shape and dtype."""
    for name, cases in sorted(CASES.items()):
        op = OPS[name]
        slots = sorted(set(op.reuse) | {i for i, _ in op.inplace})
        for k, (inputs, attrs, ref) in enumerate(cases):
            if not reusing:
                yield pytest.param(name, inputs, attrs, ref, id=f"{name}-{k}")
                continue
            ref = np.asarray(_oracle(name, inputs, attrs, ref))
            dtype = op.out_dtypes([a.dtype for a in inputs], attrs)[0]
            for i in slots:
                if inputs[i].shape == ref.shape and inputs[i].dtype == dtype:
                    yield pytest.param(name, inputs, attrs, ref, i, id=f"{name}-{k}-in{i}")


def _call(op, inputs, attrs, out):
    extra = {"ctx": DENSE_CTX} if op.needs_ctx else {}
    return op.kernel(np, *inputs, out=out, **attrs, **extra)


def test_every_out_kernel_is_covered():
    declared = {name for name, op in OPS.items() if op.accepts_out}
    assert declared - set(CASES) == set(), "accepts_out ops without an out= test case"
    assert set(CASES) - declared == set(), "cases for ops that do not declare accepts_out"


@pytest.mark.parametrize("name,inputs,attrs,ref", _cases())
def test_out_buffer_gets_the_result(name, inputs, attrs, ref):
    op = OPS[name]
    ref = np.asarray(_oracle(name, inputs, attrs, ref))
    dtype = op.out_dtypes([np.asarray(a).dtype for a in inputs], attrs)[0]
    assert np.dtype(ref.dtype).kind == np.dtype(dtype).kind or dtype.kind == "f"
    out = np.full(ref.shape, 7.0).astype(dtype)
    before = [a.copy() for a in inputs]
    res = _call(op, inputs, attrs, out)
    assert res is out
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(inputs, before):  # the inputs are left alone
        np.testing.assert_array_equal(a, b)
    # without out= the kernel gives the same values in the declared dtype
    fresh = _call(op, inputs, attrs, None)
    assert np.asarray(fresh).dtype == dtype
    np.testing.assert_allclose(fresh, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,inputs,attrs,ref,i", _cases(reusing=True))
def test_out_may_be_a_reused_input(name, inputs, attrs, ref, i):
    """``out`` aliasing an input the op may reuse (or its inplace target) still gives the
    oracle's values."""
    buf = inputs[i].copy()
    args = list(inputs)
    args[i] = buf
    assert _call(OPS[name], tuple(args), attrs, buf) is buf
    np.testing.assert_allclose(buf, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_out_kernels_keep_float32(dtype):
    """In-place passes with Python constants keep the input dtype (no float64 upcast)."""
    x = n(4, 5).astype(dtype)
    for name, attrs in (("gelu", {"approximate": True}), ("gelu", {"approximate": False}),
                        ("softmax", {"axis": 1}), ("log_softmax", {"axis": 1}),
                        ("sigmoid", {}), ("silu", {})):
        assert OPS[name].kernel(np, x, **attrs).dtype == dtype, name
    for name, attrs in (("gelu_grad", {"approximate": True}), ("softmax_grad", {"axis": 1})):
        assert OPS[name].kernel(np, x, x, **attrs).dtype == dtype, name


def test_zero_dim_and_empty_inputs():
    for x in (np.array(0.7), np.zeros((0, 3))):
        np.testing.assert_allclose(OPS["gelu"].kernel(np, x, approximate=True), _gelu_tanh(x))
        np.testing.assert_allclose(OPS["gelu_grad"].kernel(np, x, x, approximate=True),
                                   x * _gelu_tanh_grad(x))
        np.testing.assert_allclose(OPS["sigmoid"].kernel(np, x), _sig(x))
        np.testing.assert_allclose(OPS["rsqrt"].kernel(np, np.abs(x) + 1),
                                   1 / np.sqrt(np.abs(x) + 1))


# -- folded matmul: values and gradients against numpy ------------------------------------------

@pytest.mark.parametrize("ty", [False, True])
@pytest.mark.parametrize("xshape", [(2, 3, 4), (2, 2, 3, 4), (0, 3, 4)])
def test_folded_matmul_values_and_grads(xshape, ty):
    """x [..., k] @ w [k, n]: forward folded into one GEMM, the weight gradient one GEMM over
    the folded rows (numpy oracle: einsum over the batch dims)."""
    k, m = xshape[-1], 5
    xa, wa = n(*xshape), n(m, k) if ty else n(k, m)
    x = dt.to_tensor(xa, stop_gradient=False)
    w = dt.to_tensor(wa, stop_gradient=False)
    out = dt.matmul(x, w, transpose_y=ty)
    wm = wa.T if ty else wa
    np.testing.assert_allclose(out.numpy(), np.einsum("...k,kn->...n", xa, wm), atol=1e-12)
    ga = n(*out.shape)
    (out * dt.to_tensor(ga)).sum().backward()
    gw = xa.reshape(-1, k).T @ ga.reshape(-1, m)
    np.testing.assert_allclose(w.grad.numpy(), gw.T if ty else gw, atol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), np.einsum("...n,kn->...k", ga, wm), atol=1e-12)


def test_folded_matmul_non_contiguous_x():
    """A transposed (non-contiguous) 3-D x takes the batched path; same values and grads."""
    xa, wa = n(3, 4, 2), n(4, 5)
    xt = np.swapaxes(xa, 1, 2)
    x = dt.to_tensor(xa, stop_gradient=False)
    w = dt.to_tensor(wa, stop_gradient=False)
    out = dt.matmul(x.transpose([0, 2, 1]), w)
    np.testing.assert_allclose(out.numpy(), np.einsum("bsk,kn->bsn", xt, wa), atol=1e-12)
    out.sum().backward()
    ones = np.ones((3, 2, 5))
    np.testing.assert_allclose(w.grad.numpy(), np.einsum("bsk,bsn->kn", xt, ones), atol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), np.swapaxes(ones @ wa.T, 1, 2), atol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("xpl", ["S0", "S0-uneven", "S1", "S2", "R"])
def test_folded_weight_grad_distributed(xpl):
    """A batch- (S0; uneven: not foldable), sequence- (S1, not foldable: the per-sample path)
    or feature-sharded x times a 2-D weight: values and gradients equal numpy's on every rank."""
    world = dt.get_world_size()
    mesh = dt.ProcessMesh(list(range(world)))
    rng = np.random.default_rng(5)
    b = 2 * world + (1 if xpl == "S0-uneven" else 0)
    xa, wa = rng.standard_normal((b, world, 2 * world)), rng.standard_normal((2 * world, 3))
    ga = rng.standard_normal((b, world, 3))
    place = {"S0": dt.Shard(0), "S0-uneven": dt.Shard(0), "S1": dt.Shard(1), "S2": dt.Shard(2),
             "R": dt.Replicate()}[xpl]
    x = dt.shard_tensor(xa, mesh, [place], stop_gradient=False)
    w = dt.shard_tensor(wa, mesh, [dt.Replicate()], stop_gradient=False)
    out = dt.matmul(x, w)
    np.testing.assert_allclose(out.numpy(), np.einsum("bsk,kn->bsn", xa, wa), atol=1e-12)
    (out * dt.shard_tensor(ga, mesh, [dt.Replicate()])).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), np.einsum("bsk,bsn->kn", xa, ga), atol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), np.einsum("bsn,kn->bsk", ga, wa), atol=1e-12)


def _ln_oracle(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


@pytest.mark.parametrize("xd,gd", [(np.float32, np.float32), (np.float32, np.float64),
                                   (np.float64, np.float32)])
def test_norm_and_softmax_kernels_mixed_dtypes(xd, gd):
    """float32 activations with a float64 upstream gradient (and back): each output has the
    dtype the schema declares and the oracle's values."""
    x, g = n(6, 8).astype(xd), n(6, 8).astype(gd)
    w, b = n(8).astype(xd), n(8).astype(xd)
    tol = 2e-5 if np.float32 in (xd, gd) else 1e-10
    out, mean, rstd = OPS["layer_norm"].kernel(np, x, w, b, begin_norm_axis=1, epsilon=1e-5)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out, _ln_oracle(x64, w, b), rtol=tol, atol=tol)
    assert out.dtype == mean.dtype == rstd.dtype == xd
    grads = OPS["layer_norm_grad"].kernel(np, x, w, mean, rstd, g, begin_norm_axis=1,
                                          epsilon=1e-5)
    want = OPS["layer_norm_grad"].out_dtypes([xd, xd, xd, xd, gd], {})
    assert tuple(a.dtype for a in grads) == want
    # oracle: the gradient of sum(g * layer_norm(x)) by the closed form on float64
    xhat = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    dxhat = g * w
    dx = (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)) \
        / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    for got, ref in zip(grads, (dx, (g * xhat).sum(0), g.sum(0))):
        np.testing.assert_allclose(got, ref, rtol=10 * tol, atol=10 * tol)
    y = OPS["softmax"].kernel(np, x, axis=1)
    assert y.dtype == xd
    dy = OPS["softmax_grad"].kernel(np, y, g, axis=1)
    assert dy.dtype == OPS["softmax_grad"].out_dtypes([xd, gd], {})[0]
    np.testing.assert_allclose(dy, y * (g - (g * y).sum(1, keepdims=True)), rtol=tol, atol=tol)
