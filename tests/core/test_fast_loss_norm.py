"""The compiled loops of cross entropy (the mean of hard labels and its gradient) and of
training batch_norm (channels last in memory) against numpy oracles written here, beside the
numpy kernels they wrap: values, running statistics and gradients in float32 and float64, the
loops counted as run; the calls a loop does not take (class axis not last, channels first with
spatial axes) give the numpy kernel's result. The fused mean loss takes a single call (one
all-reduce when distributed) and names an out-of-range label."""
from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest

import disttensor as dt
import disttensor.nn.functional as F
from disttensor.ops import fast
from disttensor.ops import loss as loss_mod
from disttensor.schema import DENSE_CTX, OPS

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
DTYPES = [np.float32, np.float64]
CE_SHAPES = [(3, 7), (2, 3, 33), (64, 64)]
BN_CASES = [((16, 32), "NC"), ((5, 3), "NCL"), ((2, 3, 8), "NLC"), ((2, 2, 3, 4), "NHWC")]


def tol(dtype):
    return dict(rtol=3e-5, atol=3e-6) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)


@pytest.fixture(params=["compiled", "numpy"])
def kern(request, monkeypatch):
    """``kern(name)``: op ``name``'s registered kernel, or the numpy kernel it wraps (cross
    entropy's kernels with loss.py's numpy rows and gradient put back)."""
    if request.param == "compiled" and not HAVE_NUMBA:
        pytest.skip("numba not installed (extra 'fast')")
    if request.param == "compiled":
        return lambda name: OPS[name].kernel
    for name in ("_ce_rows", "_ce_grad_kernel"):
        monkeypatch.setattr(loss_mod, name, inspect.unwrap(getattr(loss_mod, name)))
    return lambda name: inspect.unwrap(OPS[name].kernel)


@pytest.fixture
def ran(monkeypatch):
    """The names of the compiled loops called since the test began."""
    calls: list[str] = []
    if not HAVE_NUMBA:
        return calls
    from disttensor.ops import numba_loops
    for name in ("cross_entropy_rows", "cross_entropy_grad_rows", "bn_moments", "bn_forward",
                 "bn_grad_sums", "bn_grad_dx"):
        loop = getattr(numba_loops, name)
        monkeypatch.setattr(numba_loops, name,
                            lambda *a, _loop=loop, _name=name: (calls.append(_name), _loop(*a)))
    return calls


def compiled(kern) -> bool:
    return fast.BACKEND == "numba" and kern("batch_norm") is OPS["batch_norm"].kernel


# -- numpy oracles (float64) ---------------------------------------------------------------------

def ce_ref(x, lab, ignore=-100):
    """(softmax, mean loss over non-ignored rows, count) with the class axis last."""
    e = np.exp(x - x.max(-1, keepdims=True))
    sm = e / e.sum(-1, keepdims=True)
    valid = lab != ignore
    logp = np.log(np.take_along_axis(sm, np.where(valid, lab, 0)[..., None], -1))[..., 0]
    count = valid.sum()
    return sm, -(logp * valid).sum() / max(count, 1), count


def bn_ref(x, rm, rv, w, b, momentum=0.9, eps=1e-5):
    red = tuple(range(x.ndim - 1))
    mean, var = x.mean(red), x.var(red)
    rstd = 1.0 / np.sqrt(var + eps)
    return ((x - mean) * rstd * w + b, momentum * rm + (1 - momentum) * mean,
            momentum * rv + (1 - momentum) * var, mean, rstd)


def bn_grad_ref(x, w, dout, eps=1e-5):
    red = tuple(range(x.ndim - 1))
    n = x.size // x.shape[-1]
    mean, rstd = x.mean(red), 1.0 / np.sqrt(x.var(red) + eps)
    xhat = (x - mean) * rstd
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.sum(red) / n - xhat * (dxhat * xhat).sum(red) / n)
    return dx, (dout * xhat).sum(red), dout.sum(red)


def labels(rng, shape, c):
    lab = rng.integers(0, c, shape[:-1])
    lab.reshape(-1)[0] = -100
    return lab


# -- cross entropy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CE_SHAPES)
def test_cross_entropy_mean_and_grad(shape, dtype, kern, ran):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    lab = labels(rng, shape, shape[-1])
    sm_ref, loss_ref, count = ce_ref(x.astype(np.float64), lab)
    attrs = {"axis": x.ndim - 1, "ignore_index": -100, "ctx": DENSE_CTX}
    sm, loss, n = kern("cross_entropy_mean")(np, x, lab, **attrs)
    assert sm.dtype == loss.dtype == n.dtype == dtype and loss.shape == n.shape == ()
    np.testing.assert_allclose(sm, sm_ref, **tol(dtype))
    np.testing.assert_allclose(float(loss), loss_ref, **tol(dtype))
    assert float(n) == count
    dloss = np.asarray(0.7, dtype)
    hot = np.arange(shape[-1]) == lab[..., None]
    want = (sm - hot) * np.where(lab != -100, 0.7 / count, 0.0)[..., None]
    grad = kern("cross_entropy_mean_grad")
    np.testing.assert_allclose(grad(np, sm, lab, n, dloss, **attrs), want, **tol(dtype))
    buf = sm.copy()  # out= the softmax (the op reuses it)
    assert grad(np, buf, lab, n, dloss, **attrs, out=buf) is buf
    np.testing.assert_allclose(buf, want, **tol(dtype))
    assert ran == (["cross_entropy_rows"] + ["cross_entropy_grad_rows"] * 2
                   if compiled(kern) else [])


def test_cross_entropy_fallbacks_equal_numpy(ran):
    """Classes on axis 0, or int labels of another width: the numpy kernel (or the same
    values)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 4))
    lab = rng.integers(0, 6, (4,))
    sm, loss, _ = OPS["cross_entropy_mean"].kernel(np, x, lab, axis=0, ignore_index=-100,
                                                     ctx=DENSE_CTX)
    _, ref, _ = ce_ref(x.T, lab)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-12)
    assert ran == []
    _, loss32, _ = OPS["cross_entropy_mean"].kernel(np, x.T.copy(), lab.astype(np.int32),
                                                     axis=1, ignore_index=-100, ctx=DENSE_CTX)
    np.testing.assert_allclose(float(loss32), ref, rtol=1e-12)


def test_all_ignored_rows_give_zero_loss_and_zero_grad(kern):
    x = np.random.default_rng(3).standard_normal((3, 5))
    lab = np.full(3, -100)
    attrs = {"axis": 1, "ignore_index": -100, "ctx": DENSE_CTX}
    sm, loss, n = kern("cross_entropy_mean")(np, x, lab, **attrs)
    assert float(loss) == 0.0 and float(n) == 0.0
    g = kern("cross_entropy_mean_grad")(np, sm, lab, n, np.asarray(1.0), **attrs)
    np.testing.assert_array_equal(g, np.zeros_like(x))


@pytest.mark.parametrize("bad", [5, -3])
def test_cross_entropy_mean_names_an_out_of_range_label(bad, kern):
    x = np.zeros((3, 5))
    lab = np.array([1, bad, -100])
    with pytest.raises(ValueError, match=rf"^cross_entropy: label value {bad} is out of range "
                                         r"\[0, 5\) \(ignore_index=-100\)$"):
        kern("cross_entropy_mean")(np, x, lab, axis=1, ignore_index=-100, ctx=DENSE_CTX)


def test_f_cross_entropy_mean_is_one_op_with_the_numpy_value_and_gradient():
    rng = np.random.default_rng(4)
    xg = rng.standard_normal((6, 5))
    lab = labels(rng, (6, 5), 5)
    x, label = dt.to_tensor(xg, stop_gradient=False), dt.to_tensor(lab)
    with dt.jit.record() as calls:
        loss = F.cross_entropy(x, label)
    assert [c.op for c in calls] == ["cross_entropy_mean"]
    sm, ref, count = ce_ref(xg, lab)
    np.testing.assert_allclose(float(loss.numpy()), ref, rtol=1e-12)
    loss.backward()
    hot = np.arange(5) == lab[:, None]
    np.testing.assert_allclose(x.grad.numpy(), (sm - hot) * (lab != -100)[:, None] / count,
                               rtol=1e-10, atol=1e-14)


# -- batch_norm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,fmt", BN_CASES)
def test_batch_norm_training_and_grad(shape, fmt, dtype, kern, ran):
    rng = np.random.default_rng(5)
    c = shape[-1] if fmt != "NCL" else shape[1]
    if fmt == "NCL":  # 2-d NCL: channels on the last axis too
        shape = shape[:2]
    x = (rng.standard_normal(shape) * 3 + 5).astype(dtype)
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    rm, rv = (rng.standard_normal(c) * 0.1).astype(dtype), rng.uniform(0.5, 1.5, c).astype(dtype)
    want = bn_ref(*(a.astype(np.float64) for a in (x, rm, rv, w, b)))
    rm_run, rv_run = rm.copy(), rv.copy()
    got = kern("batch_norm")(np, x, rm_run, rv_run, w, b, training=True, momentum=0.9,
                             epsilon=1e-5, data_format=fmt, ctx=DENSE_CTX)
    assert got[1] is rm_run and got[2] is rv_run  # updated in place
    for g, r in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, r, **tol(dtype))
    dout = rng.standard_normal(shape).astype(dtype)
    dx, dw, db = kern("batch_norm_grad")(np, x, w, got[3], got[4], dout, use_global_stats=False,
                                         data_format=fmt, ctx=DENSE_CTX)
    for g, r in zip((dx, dw, db), bn_grad_ref(x.astype(np.float64), w, dout)):
        np.testing.assert_allclose(g, r, **tol(dtype))
    assert ran == (["bn_moments", "bn_forward", "bn_grad_sums", "bn_grad_dx"]
                   if compiled(kern) else [])


def test_batch_norm_channels_first_with_spatial_axes_takes_numpy(ran):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 4))
    rm, rv = np.zeros(3), np.ones(3)
    out, *_ = OPS["batch_norm"].kernel(np, x, rm, rv, None, None, training=True, momentum=0.9,
                                       epsilon=1e-5, data_format="NCL", ctx=DENSE_CTX)
    xl = np.moveaxis(x, 1, -1)
    ref = bn_ref(xl, np.zeros(3), np.ones(3), np.ones(3), np.zeros(3))[0]
    np.testing.assert_allclose(np.moveaxis(out, 1, -1), ref, rtol=1e-10, atol=1e-12)
    assert ran == []


@pytest.mark.mpi
@pytest.mark.parametrize("rows_per_rank", [4, 1])
def test_batch_norm_statistics_of_far_from_zero_data_on_uneven_pieces(rows_per_rank):
    """x of mean 1e4 and spread 1 (float32), rows sharded unevenly over every rank: the batch
    mean, variance, running statistics and output equal numpy's float64 ones (the pieces'
    sums of squares are about their own means: no E[x^2] - mean^2 cancellation)."""
    world = dt.get_world_size()
    mesh = dt.ProcessMesh(list(range(world)), dim_names=["dp"])
    rng = np.random.default_rng(7)
    rows = rows_per_rank * world + 1
    xg = (1e4 + rng.standard_normal((rows, 6))).astype(np.float32)
    rm = dt.shard_tensor(np.zeros(6, np.float32), mesh, [dt.Replicate()])
    rv = dt.shard_tensor(np.ones(6, np.float32), mesh, [dt.Replicate()])
    out = F.batch_norm(dt.shard_tensor(xg, mesh, [dt.Shard(0)]), rm, rv, training=True,
                       momentum=0.9, data_format="NC")
    x64 = xg.astype(np.float64)
    want = bn_ref(x64, np.zeros(6), np.ones(6), np.ones(6), np.zeros(6))
    var = x64.var(0)
    # the batch variance, read back from the running one (0.9 * 1 + 0.1 * var)
    np.testing.assert_allclose((rv.numpy().astype(np.float64) - 0.9) / 0.1, var, rtol=1e-3,
                               atol=1e-5)
    np.testing.assert_allclose(rm.numpy(), want[1], rtol=1e-6)
    # out: within what rounding the mean to float32 (ulp(1e4) ~ 1e-3) costs, times rstd
    assert np.all(np.abs(out.numpy() - want[0]) <= 1e-3 * want[4] + 1e-4)
