"""Forward values of every public op against numpy (edge shapes included) and bad-input errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import disttensor as dt

RNG = np.random.default_rng(7)


def T(a, **k):
    return dt.to_tensor(np.asarray(a), **k)


def close(t, ref, **k):
    got = t.numpy() if isinstance(t, dt.Tensor) else t
    assert list(np.shape(got)) == list(np.shape(ref)), (np.shape(got), np.shape(ref))
    np.testing.assert_allclose(got, ref, rtol=k.get("rtol", 1e-6), atol=k.get("atol", 1e-7))


def n(*shape):
    return RNG.standard_normal(shape)


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x) if x.size else x.copy()


# -- elementwise -----------------------------------------------------------------------------

BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "equal": np.equal, "not_equal": np.not_equal,
    "less_than": np.less, "less_equal": np.less_equal, "greater_than": np.greater,
    "greater_equal": np.greater_equal,
}
SHAPE_PAIRS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 5)), ((0, 4), (4,)),
               ((2, 0, 3), (1, 1, 3)), ((), (3,)), ((), ())]


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("sx,sy", SHAPE_PAIRS)
def test_binary_broadcasting(name, sx, sy):
    x, y = n(*sx), n(*sy) + (3.0 if name == "divide" else 0.0)
    close(getattr(dt, name)(T(x), T(y)), BINARY[name](x, y))


def test_pow_and_scalars():
    x = np.abs(n(3, 4)) + 0.1
    y = n(4)
    close(dt.pow(T(x), T(y)), np.power(x, y))
    close(T(x) ** 2, x ** 2)
    close(2.0 ** T(x), 2.0 ** x)
    close(1 - T(x), 1 - x)
    close(T(x) / 4, x / 4)
    close(3 * T(x), 3 * x)
    it = T(np.arange(5))
    assert (it + 1).numpy().dtype == np.int64
    close(it + 1, np.arange(5) + 1)
    b = T(np.array([True, False]))
    close(b + 2, np.array([3, 2]))


def test_logical():
    a, b = np.array([True, False, True]), np.array([True, True, False])
    close(dt.logical_and(T(a), T(b)), a & b)
    close(dt.logical_or(T(a), T(b)), a | b)
    close(dt.logical_not(T(a)), ~a)


UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "tanh": np.tanh,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
}
POSITIVE = {"log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x)}


@pytest.mark.parametrize("shape", [(3, 4), (0, 3), (), (5,)])
@pytest.mark.parametrize("name", sorted(UNARY) + sorted(POSITIVE))
def test_unary(name, shape):
    x = n(*shape)
    if name in POSITIVE:
        x = np.abs(x) + 0.1
    ref = {**UNARY, **POSITIVE}[name](x)
    close(getattr(dt, name)(T(x)), ref, rtol=1e-6)


def test_gelu_tanh_and_float32():
    x = n(4, 3)
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    close(dt.gelu(T(x), approximate=True), ref)
    x32 = x.astype(np.float32)
    for name in ("exp", "tanh", "sigmoid", "relu", "gelu", "silu"):
        assert getattr(dt, name)(T(x32)).numpy().dtype == np.float32, name


def test_scale_cast_clip_where_like():
    x = n(3, 4)
    close(dt.scale(T(x), 2.0, 1.0), x * 2 + 1)
    close(dt.scale(T(x), 2.0, 1.0, bias_after_scale=False), (x + 1) * 2)
    c = dt.cast(T(x), "float32")
    assert c.dtype == np.float32
    close(c, x.astype(np.float32))
    ci = dt.cast(T(np.array([1.7, -2.2])), "int64")
    close(ci, np.array([1, -2]))
    assert ci.stop_gradient
    close(dt.clip(T(x), -0.5, 0.5), np.clip(x, -0.5, 0.5))
    close(dt.clip(T(x), min=0.1), np.clip(x, 0.1, None))
    close(dt.clip(T(np.zeros((0, 2))), 0, 1), np.zeros((0, 2)))
    cond = x > 0
    close(dt.where(T(cond), T(x), T(n(4)[None] * 0 - 1)), np.where(cond, x, -1.0))
    w = dt.where(T(cond), 2, 0)
    assert w.numpy().dtype.kind == "i"
    close(w, np.where(cond, 2, 0))
    close(dt.where(T(cond), 1.5, 0), np.where(cond, 1.5, 0))
    for like, val in ((dt.zeros_like, 0), (dt.ones_like, 1)):
        out = like(T(x))
        close(out, np.full_like(x, val))
    f = dt.full_like(T(x), 7, dtype="int32")
    assert f.dtype == np.int32 and f.shape == [3, 4]
    close(f, np.full((3, 4), 7))
    a = dt.assign(T(x))
    close(a, x)
    assert not np.shares_memory(a._value.array, x)


# -- matmul ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sx,sy,tx,ty", [
    ((3, 4), (4, 5), False, False), ((4,), (4,), False, False), ((4,), (4, 2), False, False),
    ((3, 4), (4,), False, False), ((2, 1, 3, 4), (5, 4, 2), False, False),
    ((4, 3), (4, 2), True, False), ((3, 4), (2, 4), False, True), ((2, 4, 3), (2, 5, 4), True,
                                                                   True),
    ((0, 4), (4, 3), False, False), ((3, 0), (0, 2), False, False)])
def test_matmul(sx, sy, tx, ty):
    x, y = n(*sx), n(*sy)
    xr = np.swapaxes(x, -1, -2) if tx and x.ndim > 1 else x
    yr = np.swapaxes(y, -1, -2) if ty and y.ndim > 1 else y
    close(dt.matmul(T(x), T(y), tx, ty), np.matmul(xr, yr), rtol=1e-10)
    if not tx and not ty:
        close(T(x) @ T(y), np.matmul(x, y), rtol=1e-10)


# -- reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("shape,axis", [((3, 4), None), ((3, 4), 1), ((3, 4), -1),
                                        ((2, 3, 4), [0, 2]), ((2, 3, 4), (-1, 0)), ((5,), 0),
                                        ((0, 3), 1), ((), None)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions(name, shape, axis, keepdim):
    x = n(*shape)
    ax = None if axis is None else tuple(np.atleast_1d(axis))
    ref = getattr(np, {"sum": "sum", "mean": "mean", "max": "max", "min": "min"}[name])(
        x, axis=ax, keepdims=keepdim)
    close(getattr(dt, name)(T(x), axis=axis, keepdim=keepdim), ref, rtol=1e-10)


def test_reduction_dtypes_and_args():
    xi = np.arange(12).reshape(3, 4)
    s = dt.sum(T(xi))
    assert s.dtype == np.int64 and s.item() == 66
    sb = dt.sum(T(xi > 4), axis=0)
    close(sb, (xi > 4).sum(0))
    x32 = n(3, 2).astype(np.float32)
    s64 = dt.sum(T(x32), axis=0, dtype="float64")
    assert s64.dtype == np.float64
    close(s64, x32.sum(axis=0, dtype=np.float64))
    x = n(3, 4)
    for name in ("argmax", "argmin"):
        f = getattr(np, name)
        close(getattr(dt, name)(T(x), axis=1), f(x, axis=1))
        close(getattr(dt, name)(T(x), axis=-2, keepdim=True), f(x, axis=0)[None])
        close(getattr(dt, name)(T(x)), f(x))
        assert getattr(dt, name)(T(x), axis=1).dtype == np.int64


# -- shape ops ---------------------------------------------------------------------------------

def test_shape_ops():
    x = n(2, 3, 4)
    close(dt.reshape(T(x), [4, -1]), x.reshape(4, -1))
    close(dt.reshape(T(x), [0, 12]), x.reshape(2, 12))
    close(dt.reshape(T(np.zeros((0, 3))), [3, -1]), np.zeros((3, 0)))  # 0 would copy a dim
    close(dt.flatten(T(x), 1), x.reshape(2, 12))
    close(dt.flatten(T(x)), x.reshape(-1))
    close(dt.flatten(T(np.array(3.0))), np.array([3.0]))
    y = n(1, 3, 1)
    close(dt.squeeze(T(y)), y.reshape(3))
    close(dt.squeeze(T(y), -1), y.reshape(1, 3))
    close(dt.unsqueeze(T(x), [0, -1]), x[None, ..., None])
    close(dt.transpose(T(x), [2, 0, 1]), x.transpose(2, 0, 1))
    close(T(x).T, x.T)
    close(T(x)[1, :, ::2], x[1, :, ::2])
    close(T(x)[..., None, 1:3], x[..., None, 1:3])
    close(T(x)[-1], x[-1])
    close(T(x)[:, 5:], x[:, 5:])
    parts = dt.split(T(x), [1, -1, 1], axis=2)
    for p, r in zip(parts, np.split(x, [1, 3], axis=2)):
        close(p, r)
    for p, r in zip(dt.chunk(T(x), 3, axis=-2), np.split(x, 3, axis=1)):
        close(p, r)
    close(dt.concat([T(x), T(n(2, 0, 4)), T(x[:, :1])], axis=1),
          np.concatenate([x, np.zeros((2, 0, 4)), x[:, :1]], axis=1))
    close(dt.stack([T(x), T(x * 2)], axis=-1), np.stack([x, x * 2], axis=-1))
    close(dt.expand(T(n(3, 1)) * 0 + T(np.ones((3, 1))), [2, 3, 4]), np.ones((2, 3, 4)))
    z = n(3, 1)
    close(dt.expand(T(z), [2, -1, 4]), np.broadcast_to(z, (2, 3, 4)))
    close(dt.broadcast_to(T(z), [3, 5]), np.broadcast_to(z, (3, 5)))
    close(dt.tile(T(z), [2, 3]), np.tile(z, [2, 3]))
    close(dt.tile(T(z), [2, 1, 1]), np.tile(z, [2, 1, 1]))
    d = dt.detach(T(x, stop_gradient=False))
    assert d.stop_gradient
    close(d, x)


def test_setitem_values():
    x = n(3, 4)
    t = T(x)
    t[1] = 5.0
    t[:, 2:] = T(np.array([7.0, 8.0]))
    ref = x.copy()
    ref[1] = 5.0
    ref[:, 2:] = [7.0, 8.0]
    close(t, ref)


# -- creation ------------------------------------------------------------------------------------

def test_creation():
    close(dt.full([2, 3], 1.5), np.full((2, 3), 1.5, np.float32))
    assert dt.zeros([0, 2]).shape == [0, 2]
    assert dt.ones([2], dtype="int64").dtype == np.int64
    close(dt.arange(5), np.arange(5))
    close(dt.arange(1, 2, 0.25), np.arange(1, 2, 0.25, dtype=np.float32))
    dt.seed(5)
    a = dt.rand([3, 2]).numpy()
    dt.seed(5)
    assert np.array_equal(a, dt.rand([3, 2]).numpy())
    assert dt.randn([4]).shape == [4]
    u = dt.uniform([100], min=2.0, max=3.0).numpy()
    assert u.min() >= 2.0 and u.max() < 3.0
    nm = dt.numel(T(n(3, 5)))
    assert nm.shape == [] and nm.dtype == np.int64 and nm.item() == 15
    assert dt.numel(T(np.zeros((0, 3)))).item() == 0
    assert dt.to_tensor(2.0).shape == []


# -- softmax family ------------------------------------------------------------------------

def _np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("shape,axis", [((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1), ((4,), 0),
                                        ((0, 3), -1), ((3, 0), 0), ((1, 1), -1)])
def test_softmax_log_softmax(shape, axis):
    x = n(*shape) * 5
    close(dt.softmax(T(x), axis), _np_softmax(x, axis), rtol=1e-10)
    ref = x - x.max(axis=axis, keepdims=True) if x.size else x
    ref = ref - np.log(np.exp(ref).sum(axis=axis, keepdims=True)) if x.size else ref
    close(dt.log_softmax(T(x), axis), ref, rtol=1e-10)


def test_softmax_stable_and_dtype():
    x = np.array([[1000.0, 1001.0, 999.0], [-1e4, 0.0, 1e4]])
    close(dt.softmax(T(x)), _np_softmax(x, -1))
    assert np.isfinite(dt.log_softmax(T(x)).numpy()).all()
    assert dt.softmax(T(x.astype(np.float32))).dtype == np.float32
    assert dt.softmax(T(np.arange(3)), dtype="float64").dtype == np.float64


# -- norms ---------------------------------------------------------------------------------

def _np_layer_norm(x, k, w, b, eps=1e-5):
    axes = tuple(range(x.ndim - k, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    out = (x - mu) / np.sqrt(var + eps)
    tail = x.shape[x.ndim - k:]
    if w is not None:
        out = out * w.reshape(tail)
    if b is not None:
        out = out + b.reshape(tail)
    return out


@pytest.mark.parametrize("shape,ns", [((3, 4), [4]), ((2, 3, 4), [3, 4]), ((0, 5), 5),
                                      ((2, 1), [1])])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(shape, ns, affine):
    x = n(*shape)
    k = 1 if isinstance(ns, int) else len(ns)
    tail = shape[len(shape) - k:]
    w = n(*tail) if affine else None
    b = n(int(np.prod(tail))) if affine else None  # bias given flattened
    out = dt.layer_norm(T(x), ns, None if w is None else T(w), None if b is None else T(b))
    close(out, _np_layer_norm(x, k, w, b), rtol=1e-8, atol=1e-8)


def _np_batch_norm(x, rm, rv, w, b, training, momentum, eps, c_axis):
    red = tuple(a for a in range(x.ndim) if a != c_axis)
    bs = [1] * x.ndim
    bs[c_axis] = x.shape[c_axis]
    if training:
        mean, var = x.mean(axis=red), x.var(axis=red)  # biased, as Paddle
        rm = momentum * rm + (1 - momentum) * mean
        rv = momentum * rv + (1 - momentum) * var
    else:
        mean, var = rm, rv
    out = (x - mean.reshape(bs)) / np.sqrt(var.reshape(bs) + eps)
    if w is not None:
        out = out * w.reshape(bs) + b.reshape(bs)
    return out, rm, rv


@pytest.mark.parametrize("shape,fmt", [((4, 3), "NC"), ((2, 3, 5), "NCL"), ((2, 3, 2, 2), "NCHW"),
                                       ((2, 2, 2, 3), "NHWC"), ((3, 4, 2), "NLC"),
                                       ((1, 3, 1, 1, 2), "NCDHW")])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm(shape, fmt, training, affine):
    x = n(*shape)
    c_axis = 1 if fmt in ("NC", "NCL", "NCHW", "NCDHW") else len(shape) - 1
    c = shape[c_axis]
    rm0, rv0 = n(c) * 0.1, RNG.uniform(0.5, 1.5, c)
    w, b = (n(c), n(c)) if affine else (None, None)
    rm, rv = T(rm0), T(rv0)
    out = dt.batch_norm(T(x), rm, rv, None if w is None else T(w), None if b is None else T(b),
                        training=training, momentum=0.8, epsilon=1e-5, data_format=fmt)
    ref, rm1, rv1 = _np_batch_norm(x, rm0, rv0, w, b, training, 0.8, 1e-5, c_axis)
    close(out, ref, rtol=1e-8, atol=1e-8)
    close(rm, rm1, rtol=1e-10)
    close(rv, rv1, rtol=1e-10)
    assert rm.inplace_version == (1 if training else 0)


def test_batch_norm_use_global_stats():
    x = n(4, 3)
    rm0, rv0 = n(3), RNG.uniform(0.5, 1.5, 3)
    rm, rv = T(rm0), T(rv0)
    out = dt.batch_norm(T(x), rm, rv, training=True, use_global_stats=True)
    close(out, (x - rm0) / np.sqrt(rv0 + 1e-5))
    close(rm, rm0)
    # training=False with use_global_stats=False: batch statistics (and the running update)
    out = dt.batch_norm(T(x), rm, rv, training=False, use_global_stats=False, momentum=0.5)
    close(out, (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-5), rtol=1e-8)
    close(rm, 0.5 * rm0 + 0.5 * x.mean(0))


# -- embedding / indexing ------------------------------------------------------------------

def test_embedding():
    w = n(6, 4)
    ids = np.array([[0, 5, 2], [2, 2, 1]])
    close(dt.embedding(T(ids), T(w)), w[ids])
    ref = w[ids].copy()
    ref[ids == 2] = 0
    close(dt.embedding(T(ids), T(w), padding_idx=2), ref)
    close(dt.embedding(T(ids), T(w), padding_idx=-4), ref)
    close(dt.embedding(T(np.zeros((0,), np.int64)), T(w)), np.zeros((0, 4)))
    close(dt.embedding(T(ids.astype(np.int32)), T(w)), w[ids])


def test_gather_index_select_one_hot():
    x = n(5, 3)
    idx = np.array([4, 0, 4])
    close(dt.gather(T(x), T(idx)), x[idx])
    close(dt.gather(T(x), [2, 1], axis=1), x[:, [2, 1]])
    close(dt.index_select(T(x), T(idx), axis=0), x[idx])
    close(dt.index_select(T(x), T(np.array([], np.int64)), axis=-1), x[:, []])
    oh = dt.one_hot(T(np.array([[0, 2], [1, 1]])), 3)
    assert oh.dtype == np.float32
    close(oh, np.eye(3, dtype=np.float32)[[[0, 2], [1, 1]]])
    assert oh.stop_gradient


# -- losses --------------------------------------------------------------------------------

def _np_ce(x, lab, axis, ignore=-100):
    logp = np.log(_np_softmax(x, axis))
    lab_k = lab.reshape(x.shape[:axis] + (1,) + x.shape[axis + 1:])
    safe = np.where(lab_k == ignore, 0, lab_k)
    loss = -np.take_along_axis(logp, safe, axis)
    return np.where(lab_k == ignore, 0.0, loss), lab_k != ignore


@pytest.mark.parametrize("shape,axis", [((4, 5), -1), ((3, 4, 2), 1), ((2, 3, 4), -1), ((0, 3), 1)])
def test_softmax_with_cross_entropy(shape, axis):
    x = n(*shape) * 3
    ax = axis % len(shape)
    batch = shape[:ax] + shape[ax + 1:]
    lab = RNG.integers(0, shape[ax], batch)
    if lab.size:
        lab.reshape(-1)[0] = -100
    ref, _ = _np_ce(x, lab, ax)
    close(dt.softmax_with_cross_entropy(T(x), T(lab), axis=axis), ref, rtol=1e-10)
    loss, sm = dt.softmax_with_cross_entropy(T(x), T(np.expand_dims(lab, ax)), axis=axis,
                                             return_softmax=True)
    close(loss, ref, rtol=1e-10)
    close(sm, _np_softmax(x, ax), rtol=1e-10)
    soft = _np_softmax(n(*shape), ax)
    close(dt.softmax_with_cross_entropy(T(x), T(soft), soft_label=True, axis=axis),
          -(soft * np.log(_np_softmax(x, ax))).sum(axis=ax, keepdims=True), rtol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("keep", [False, True])
def test_cross_entropy(reduction, keep):
    x = n(6, 4)
    lab = RNG.integers(0, 4, 6)
    lab[[1, 4]] = -100
    per, valid = _np_ce(x, lab, 1)
    label = T(lab[:, None] if keep else lab)
    out = dt.cross_entropy(T(x), label, reduction=reduction)
    ref = {"mean": per.sum() / valid.sum(), "sum": per.sum(),
           "none": per if keep else per[:, 0]}[reduction]
    close(out, ref, rtol=1e-10)
    # class weights
    w = RNG.uniform(0.5, 2.0, 4)
    wi = np.where(lab == -100, 0.0, w[np.where(lab == -100, 0, lab)])[:, None]
    out = dt.cross_entropy(T(x), label, weight=T(w), reduction=reduction)
    ref = {"mean": (per * wi).sum() / wi.sum(), "sum": (per * wi).sum(),
           "none": per * wi if keep else (per * wi)[:, 0]}[reduction]
    close(out, ref, rtol=1e-10)
    # probabilities input (use_softmax=False)
    p = _np_softmax(x, 1)
    out = dt.cross_entropy(T(p), label, use_softmax=False, reduction=reduction)
    ref = {"mean": per.sum() / valid.sum(), "sum": per.sum(),
           "none": per if keep else per[:, 0]}[reduction]
    close(out, ref, rtol=1e-8)


def test_cross_entropy_soft_smoothing_and_all_ignored():
    x = n(5, 3)
    soft = _np_softmax(n(5, 3), 1)
    per = -(soft * np.log(_np_softmax(x, 1))).sum(1, keepdims=True)
    close(dt.cross_entropy(T(x), T(soft), soft_label=True), per.mean(), rtol=1e-10)
    close(dt.cross_entropy(T(x), T(soft), soft_label=True, reduction="none"), per, rtol=1e-10)
    lab = np.array([0, 2, 1, 1, 0])
    sm = np.eye(3)[lab] * 0.9 + 0.1 / 3
    ref = -(sm * np.log(_np_softmax(x, 1))).sum(1).mean()
    close(dt.cross_entropy(T(x), T(lab), label_smoothing=0.1), ref, rtol=1e-10)
    allign = T(np.full(5, -100))
    close(dt.cross_entropy(T(x), allign), np.float64(0.0))
    # axis other than last
    x3 = n(2, 3, 4)
    lab3 = RNG.integers(0, 3, (2, 4))
    per3, _ = _np_ce(x3, lab3, 1)
    close(dt.cross_entropy(T(x3), T(lab3), axis=1), per3.mean(), rtol=1e-10)
    close(dt.cross_entropy(T(_np_softmax(x3, 1)), T(lab3), axis=1, use_softmax=False),
          per3.mean(), rtol=1e-8)


def test_mse_loss():
    x, y = n(3, 4), n(3, 4)
    close(dt.mse_loss(T(x), T(y)), ((x - y) ** 2).mean())
    close(dt.mse_loss(T(x), T(y), "sum"), ((x - y) ** 2).sum())
    close(dt.mse_loss(T(x), T(y), "none"), (x - y) ** 2)


# -- dropout -----------------------------------------------------------------------------

def test_dropout_values():
    x = n(40, 50) + 3.0
    out = dt.dropout(T(x), 0.3, seed=11).numpy()
    kept = out != 0
    assert 0.6 < kept.mean() < 0.8
    close(out[kept], x[kept] / 0.7, rtol=1e-12)
    assert np.array_equal(dt.dropout(T(x), 0.3, seed=11).numpy(), out)
    assert not np.array_equal(dt.dropout(T(x), 0.3, seed=12).numpy(), out)
    down = dt.dropout(T(x), 0.3, seed=11, mode="downscale_in_infer").numpy()
    close(down, np.where(kept, x, 0.0))
    close(dt.dropout(T(x), 0.3, training=False, mode="downscale_in_infer"), x * 0.7)
    ev = dt.dropout(T(x), 0.3, training=False)
    close(ev, x)
    assert not np.shares_memory(ev._value.array, x)
    close(dt.dropout(T(x), 0.0), x)
    close(dt.dropout(T(x), 1.0), np.zeros_like(x))
    # axis: one draw per index of the listed axes
    ax = dt.dropout(T(np.ones((6, 7, 5))), 0.5, axis=[0, 2], seed=3).numpy()
    assert (ax == ax[:, :1, :]).all()
    dt.seed(4)
    a = dt.dropout(T(x), 0.5).numpy()
    dt.seed(4)
    assert np.array_equal(dt.dropout(T(x), 0.5).numpy(), a)
    assert dt.dropout(T(np.zeros((0, 3))), 0.5).shape == [0, 3]


def test_dropout_mask_is_a_function_of_global_index():
    """The mask of a piece computed with its global offsets equals the slice of the dense mask
    (what the distributed kernel relies on)."""
    from disttensor.ops.random import keep_mask

    full = keep_mask(np, 99, 0.5, (7, 5), (7, 5), (0, 0))
    piece = keep_mask(np, 99, 0.5, (3, 2), (7, 5), (2, 3))
    assert np.array_equal(piece, full[2:5, 3:5])


# -- errors --------------------------------------------------------------------------------

X = n(3, 4)
ERRORS = [
    (lambda: dt.add(T(X), T(n(3, 5))), ValueError, None),
    (lambda: dt.matmul(T(X), T(n(5, 2))), ValueError, "matmul"),
    (lambda: dt.matmul(T(np.array(1.0)), T(X)), ValueError, "matmul"),
    (lambda: dt.sum(T(X), axis=2), ValueError, "sum"),
    (lambda: dt.mean(T(X), axis=[0, 0]), ValueError, "mean"),
    (lambda: dt.mean(T(np.arange(3))), TypeError, "mean"),
    (lambda: dt.max(T(np.zeros((0, 3))), axis=0), ValueError, "max"),
    (lambda: dt.reshape(T(X), [5, -1]), ValueError, "reshape"),
    (lambda: dt.reshape(T(X), [-1, -1]), ValueError, "reshape"),
    (lambda: dt.transpose(T(X), [0, 0]), ValueError, "transpose"),
    (lambda: dt.flatten(T(X), 1, 0), ValueError, "flatten"),
    (lambda: dt.split(T(X), 3, axis=1), ValueError, "split"),
    (lambda: dt.split(T(X), [1, 1], axis=0), ValueError, "split"),
    (lambda: dt.concat([T(X), T(n(2, 5))], axis=0), ValueError, "concat"),
    (lambda: dt.stack([T(X), T(n(4, 3))]), ValueError, "stack"),
    (lambda: dt.expand(T(X), [3, 5]), ValueError, "expand"),
    (lambda: dt.expand(T(n(3)), [-1, 3]), ValueError, "expand"),
    (lambda: dt.tile(T(X), [-1]), ValueError, "tile"),
    (lambda: T(X)[5], IndexError, "slice"),
    (lambda: dt.clip(T(X), 1.0, 0.0), ValueError, "clip"),
    (lambda: dt.where(T(X), T(X), T(X)), TypeError, "where"),
    (lambda: dt.softmax(T(X), axis=2), ValueError, "softmax"),
    (lambda: dt.log_softmax(T(np.arange(3))), TypeError, "log_softmax"),
    (lambda: dt.layer_norm(T(X), [3]), ValueError, "layer_norm"),
    (lambda: dt.layer_norm(T(X), [4], weight=T(n(3))), ValueError, "layer_norm"),
    (lambda: dt.batch_norm(T(X), T(n(3)), T(n(4))), ValueError, "batch_norm"),
    (lambda: dt.batch_norm(T(X), T(n(4)), T(n(4)), data_format="NWC"), ValueError, "batch_norm"),
    (lambda: dt.batch_norm(T(n(4)), T(n(4)), T(n(4))), ValueError, "batch_norm"),
    (lambda: dt.batch_norm(T(np.zeros((0, 4))), T(n(4)), T(n(4)), training=True), ValueError,
     "batch_norm"),
    (lambda: dt.embedding(T(np.array([0, 6])), T(n(6, 2))), ValueError, "embedding"),
    (lambda: dt.embedding(T(np.array([-1])), T(n(6, 2))), ValueError, "embedding"),
    (lambda: dt.embedding(T(np.array([0.5])), T(n(6, 2))), TypeError, "embedding"),
    (lambda: dt.embedding(T(np.array([0])), T(n(6, 2)), padding_idx=6), ValueError, "embedding"),
    (lambda: dt.gather(T(X), T(np.array([3]))), ValueError, "gather"),
    (lambda: dt.gather(T(X), T(np.array([[0]]))), ValueError, "gather"),
    (lambda: dt.index_select(T(X), T(np.array([-1])), axis=1), ValueError, "index_select"),
    (lambda: dt.one_hot(T(np.array([3])), 3), ValueError, "one_hot"),
    (lambda: dt.one_hot(T(np.array([0.0])), 3), TypeError, "one_hot"),
    (lambda: dt.cross_entropy(T(X), T(np.array([0, 1, 4]))), ValueError, "cross_entropy"),
    (lambda: dt.cross_entropy(T(X), T(np.array([0, 1]))), ValueError, "cross_entropy"),
    (lambda: dt.cross_entropy(T(X), T(np.array([0, 1, 2])), reduction="avg"), ValueError,
     "cross_entropy"),
    (lambda: dt.cross_entropy(T(X), T(np.array([0.0, 1, 2]))), TypeError, "cross_entropy"),
    (lambda: dt.cross_entropy(T(X), T(n(3, 3)), soft_label=True), ValueError, "cross_entropy"),
    (lambda: dt.cross_entropy(T(X), T(np.array([0, 1, 2])), weight=T(n(3))), ValueError,
     "cross_entropy"),
    (lambda: dt.softmax_with_cross_entropy(T(X), T(np.array([[0], [1], [-3]]))), ValueError,
     "cross_entropy"),
    (lambda: dt.mse_loss(T(X), T(n(2, 4))), ValueError, "mse_loss"),
    (lambda: dt.dropout(T(X), 1.5), ValueError, "dropout"),
    (lambda: dt.dropout(T(X), -0.1), ValueError, "dropout"),
    (lambda: dt.dropout(T(X), 0.5, mode="bad"), ValueError, "dropout"),
    (lambda: dt.dropout(T(X), 0.5, axis=3), ValueError, "dropout"),
    (lambda: dt.numel(X), TypeError, "numel"),
]


@pytest.mark.parametrize("k", range(len(ERRORS)))
def test_bad_input_errors(k):
    fn, exc, name = ERRORS[k]
    with pytest.raises(exc) as info:
        fn()
    if name is not None:
        assert name in str(info.value), str(info.value)


def test_size_zero_shapes_through_shape_ops_and_backward():
    """Internal reshapes take size-0 dims literally (Paddle's "0 copies a dim" is for users)."""
    assert dt.squeeze(dt.zeros([1, 0, 1])).shape == [0]
    assert dt.unsqueeze(dt.zeros([0, 3]), 0).shape == [1, 0, 3]
    assert dt.flatten(dt.zeros([3, 0, 2]), 0, 1).shape == [0, 2]
    for shape, axis in (((3, 0), 0), ((0, 3), 1), ((2, 0, 4), (0, 2))):
        a = dt.zeros(list(shape), "float64")
        a.stop_gradient = False
        dt.sum(dt.sum(a, axis=axis)).backward()
        assert a.grad.shape == list(shape)
    a = dt.zeros([0, 3], "float64")
    a.stop_gradient = False
    b = dt.ones([3], "float64")
    b.stop_gradient = False
    dt.sum(dt.multiply(a, b)).backward()
    assert a.grad.shape == [0, 3]
    close(b.grad, np.zeros(3))
    c = dt.zeros([3, 0], "float64")
    c.stop_gradient = False
    dt.sum(dt.reshape(dt.transpose(c, [1, 0]), [0, 3])).backward()
    assert c.grad.shape == [3, 0]


# -- dtype promotion (Paddle's table) ----------------------------------------------------------

_FLOATS = [np.float16, np.float32, np.float64]
_INTS = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64]


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide", "maximum", "minimum"])
def test_tensor_tensor_promotion_table(name):
    """Tensor-Tensor: one dtype, or floating only (the larger one); every other mix raises a
    TypeError naming the op, both dtypes and the shapes."""
    ref = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
           "divide": np.true_divide, "maximum": np.maximum, "minimum": np.minimum}[name]
    for a in _FLOATS:
        for b in _FLOATS:
            x, y = (n(2, 3) + 3).astype(a), (n(3) + 3).astype(b)
            out = getattr(dt, name)(T(x), T(y))
            assert out.dtype == np.promote_types(a, b), (a, b, out.dtype)
            close(out, ref(x, y), rtol=1e-2 if np.float16 in (a, b) else 1e-6)
    for a in _INTS:
        for b in _INTS + _FLOATS:
            if a == b:
                continue
            with pytest.raises(TypeError, match=rf"{name}: inputs of different dtypes \(input 0: "
                                                rf"{np.dtype(a).name}, input 1: "
                                                rf"{np.dtype(b).name}\).*shapes \[\[2\], \[2\]\]"):
                getattr(dt, name)(T(np.ones(2, a)), T(np.ones(2, b)))
            with pytest.raises(TypeError, match=f"{name}: inputs of different dtypes"):
                getattr(dt, name)(T(np.ones(2, b)), T(np.ones(2, a)))


def test_tensor_scalar_promotion():
    """Tensor-Scalar: an int scalar takes the tensor's dtype; a float scalar keeps a floating
    tensor's dtype and turns an int/bool tensor into float32; an int scalar turns a bool tensor
    into int64 (Paddle's Tensor-Scalar table)."""
    h = T(np.array([1.5, 2.0], np.float16))
    assert (h + 1).dtype == np.float16 and (h * 2.5).dtype == np.float16
    i32 = T(np.array([1, 2], np.int32))
    assert (i32 + 1).dtype == np.int32 and (3 - i32).dtype == np.int32
    r = i32 * 1.5
    assert r.dtype == np.float32
    close(r, np.array([1.5, 3.0]))
    close(2.5 + i32, np.array([3.5, 4.5]))
    b = T(np.array([True, False]))
    assert (b + 1).dtype == np.int64 and (b * 0.5).dtype == np.float32
    close(b + 1, np.array([2, 1]))
    assert (i32 < 1.5).dtype == np.bool_


def test_matmul_concat_stack_refuse_mixed_dtypes():
    x32, x64 = T(np.ones((2, 3), np.float32)), T(np.ones((3, 2), np.float64))
    with pytest.raises(TypeError, match=r"matmul: inputs of different dtypes \(input 0: float32, "
                                        r"input 1: float64\).*shapes \[\[2, 3\], \[3, 2\]\]"):
        dt.matmul(x32, x64)
    with pytest.raises(TypeError, match="concat: inputs of different dtypes"):
        dt.concat([x32, T(np.ones((2, 3), np.float64))])
    with pytest.raises(TypeError, match="stack: inputs of different dtypes"):
        dt.stack([x32, T(np.ones((2, 3), np.int64))])
    with pytest.raises(TypeError, match="where: inputs of different dtypes"):
        dt.where(T(np.array([True, False])), T(np.ones(2, np.int32)), T(np.ones(2, np.float32)))
    out = dt.matmul(x32, T(np.ones((3, 2), np.float32)))
    assert out.dtype == np.float32
    close(out, np.full((2, 2), 3.0))
