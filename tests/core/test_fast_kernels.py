"""The compiled kernels (disttensor.ops.fast, numba) and the numpy kernels they wrap against
numpy oracles written here: values and gradients of softmax, layer_norm, relu (relu_ in place)
and gelu (tanh and exact) in float32 and float64 over several leading shapes, with ``out=``
fresh, the input itself and dout; the compiled loops must have run (counted); the cases a loop does
not take (non-contiguous, another axis, float16, float64 exact gelu) must give numpy's result
from the fallback. The backend switch (``DISTTENSOR_KERNELS``) is checked in a subprocess whether or
not numba is installed; the compiled cases need numba."""
from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from disttensor.ops import fast
from disttensor.schema import OPS

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
COMPILED = fast.BACKEND == "numba"  # numba installed and not switched off by DISTTENSOR_KERNELS
NOT_COMPILED = "compiled kernels not selected (numba not installed, or DISTTENSOR_KERNELS=numpy)"
needs_numba = pytest.mark.skipif(not COMPILED, reason=NOT_COMPILED)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

C, A = math.sqrt(2.0 / math.pi), 0.044715
SHAPES = [(5,), (3, 7), (2, 3, 33), (64, 64)]
DTYPES = [np.float32, np.float64]


def tol(dtype, scale=1.0):
    return dict(rtol=3e-5, atol=3e-6 * scale) if dtype == np.float32 else \
        dict(rtol=1e-12, atol=1e-13 * scale)


# -- numpy oracles (float64) --------------------------------------------------------------------

def softmax_ref(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_grad_ref(y, g):
    return y * (g - (g * y).sum(axis=-1, keepdims=True))


def gelu_ref(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + A * x ** 3)))


def phi_ref(x):
    return 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2.0))  # no 1 + erf cancellation


def gelu_exact_ref(x):
    return x * phi_ref(x)


def gelu_exact_grad_ref(x, g):
    return g * (phi_ref(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def gelu_grad_ref(x, g):
    t = np.tanh(C * (x + A * x ** 3))
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * A * x * x))


def layer_norm_ref(x, w, b, k, eps=1e-5):
    axes = tuple(range(x.ndim - k, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    out = (x - mean) * rstd * (1.0 if w is None else w) + (0.0 if b is None else b)
    lead = x.shape[:x.ndim - k]
    return out, mean.reshape(lead), rstd.reshape(lead)


def layer_norm_grad_ref(x, w, dout, k, eps=1e-5):
    axes = tuple(range(x.ndim - k, x.ndim))
    _, mean, rstd = layer_norm_ref(x, None, None, k, eps)
    mean = mean.reshape(mean.shape + (1,) * k)
    rstd = rstd.reshape(mean.shape)
    xhat = (x - mean) * rstd
    dxhat = dout * (1.0 if w is None else w)
    dx = rstd * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))
    lead = tuple(range(x.ndim - k))
    return dx, (dout * xhat).sum(axis=lead), dout.sum(axis=lead)


def data(shape, dtype, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(dtype)


@pytest.fixture(params=["compiled", "numpy"])
def kern(request):
    """``kern(name)``: op ``name``'s registered kernel (compiled: needs numba) or the numpy
    kernel it wraps."""
    if request.param == "compiled" and not COMPILED:
        pytest.skip(NOT_COMPILED)
    if request.param == "compiled":
        return lambda name: OPS[name].kernel
    return lambda name: inspect.unwrap(OPS[name].kernel)


def loops_ran(kern, names):
    """The loops a test of ``kern``'s kind must have run."""
    return names if kern("relu") is OPS["relu"].kernel and fast.BACKEND == "numba" else []


@pytest.fixture
def ran(monkeypatch):
    """The names of the compiled loops called since the test began."""
    calls = []
    if not COMPILED:
        return calls
    from disttensor.ops import numba_loops
    for name in ("softmax", "softmax_grad", "relu", "relu_grad", "gelu_tanh", "gelu_tanh_grad",
                 "gelu_erf", "gelu_erf_grad", "layer_norm", "layer_norm_grad", "adam"):
        loop = getattr(numba_loops, name)
        monkeypatch.setattr(numba_loops, name,
                            lambda *a, _loop=loop, _name=name: (calls.append(_name), _loop(*a)))
    return calls


def check(got, want, dtype, scale=1.0):
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, **tol(dtype, scale))


# -- the backend switch ---------------------------------------------------------------------------

def _backend_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = ("from disttensor.ops import fast; from disttensor.schema import OPS; "
            "k = OPS['softmax'].kernel.__wrapped__; "  # inside the bfloat16 wrapper
            "print(fast.BACKEND, k.__code__.co_filename == fast.__file__)")
    env = dict(os.environ, DISTTENSOR_KERNELS=value, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_backend_switch_numpy_registers_the_numpy_kernels():
    r = _backend_in_subprocess("numpy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["numpy", "False"]


def test_backend_switch_auto_and_numba():
    auto = _backend_in_subprocess("auto")
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.split() == (["numba", "True"] if HAVE_NUMBA else ["numpy", "False"])
    forced = _backend_in_subprocess("numba")
    if HAVE_NUMBA:
        assert forced.stdout.split() == ["numba", "True"], forced.stderr
    else:
        assert forced.returncode != 0
        assert "DISTTENSOR_KERNELS=numba, but numba is not installed" in forced.stderr


def test_backend_switch_rejects_unknown_values():
    r = _backend_in_subprocess("fortran")
    assert r.returncode != 0
    assert "DISTTENSOR_KERNELS must be 'auto', 'numba' or 'numpy', got 'fortran'" in r.stderr


def _vector_setting_in_subprocess(env_extra: dict) -> list:
    """[numba's code-generator features, NUMBA_CPU_FEATURES after the loops loaded, host
    features] from a fresh process."""
    code = ("import os, llvmlite.binding as ll; from disttensor.ops import fast; fast._loops(); "
            "from numba.core.registry import cpu_target; "
            "print(cpu_target.target_context.codegen()._tm_features); "
            "print(os.environ.get('NUMBA_CPU_FEATURES')); "
            "print(ll.get_host_cpu_features().flatten())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(PYTHONPATH=ROOT, DISTTENSOR_KERNELS="numba", **env_extra)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")[:3]


@needs_numba
def test_loops_get_512_bit_vectors_exactly_where_the_host_has_avx512():
    codegen, left, host = _vector_setting_in_subprocess({})
    avx512 = {"+avx512f", "+avx512bw", "+avx512dq", "+avx512vl"} <= set(host.split(","))
    assert codegen == (host + ",-prefer-256-bit" if avx512 else host)
    assert left == "None"  # set for the code generator only: children do not inherit it


@needs_numba
def test_a_users_numba_cpu_features_are_kept():
    codegen, left, host = _vector_setting_in_subprocess({"NUMBA_CPU_FEATURES": "+sse2"})
    assert codegen == left == "+sse2"


FLOAT32_LOOPS = {  # loop: float32 arguments (arrays and scalars) that compile it
    "softmax": lambda a, v: (a, a), "softmax_grad": lambda a, v: (a, a, a),
    "layer_norm": lambda a, v: (a, v, v, 1e-5, a, v, v),
    "layer_norm_grad": lambda a, v: (a, v, v, v, a, a, v, v),
    "relu": lambda a, v: (v, v), "relu_grad": lambda a, v: (v, v, v),
    "gelu_erf": lambda a, v: (v, v), "gelu_erf_grad": lambda a, v: (v, v, v),
    "gelu_tanh": lambda a, v: (v, v), "gelu_tanh_grad": lambda a, v: (v, v, v),
}


@needs_numba
@pytest.mark.parametrize("name", sorted(FLOAT32_LOOPS))
def test_float32_loops_do_their_arithmetic_in_float32(name):
    """A float32 loop has no double arithmetic (``float32 / int`` is float64 in numba: a
    layer_norm whose 1 / n was one ran its passes in double at 1.6x the time). Compiled afresh
    from the source, since cached code cannot be inspected."""
    import numba

    from disttensor.ops import numba_loops

    fn = numba.njit(fastmath=numba_loops._SUMS, error_model="numpy")(
        getattr(numba_loops, name).py_func)
    a, v = np.ones((4, 8), np.float32), np.ones(8, np.float32)
    fn(*FLOAT32_LOOPS[name](a, v))
    ir = "\n".join(fn.inspect_llvm().values())
    doubles = [ln.strip() for ln in ir.splitlines()
               if re.search(r"= (fadd|fsub|fmul|fdiv|fpext)\b.* (double|float) ", ln)
               and re.search(r"\bdouble\b", ln)]
    assert not doubles, doubles[:5]


# -- values and gradients (numba) ----------------------------------------------------------------


@needs_numba
def test_the_registered_kernels_are_the_compiled_ones():
    assert fast.BACKEND == "numba"
    for name in ("softmax", "softmax_grad", "layer_norm", "layer_norm_grad", "relu", "relu_grad",
                 "gelu_grad"):
        # (inside the wrapper that runs bfloat16 inputs in float32)
        assert OPS[name].kernel.__wrapped__.__code__.co_filename == fast.__file__, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_and_grad(shape, dtype, kern, ran):
    x, g = data(shape, dtype, 1, 10.0), data(shape, dtype, 2)
    x64 = x.astype(np.float64)
    y = softmax_ref(x64)
    kernel, grad = kern("softmax"), kern("softmax_grad")
    axis = len(shape) - 1
    check(kernel(np, x, axis=axis), y, dtype)
    out = np.empty_like(x)
    assert kernel(np, x, axis=axis, out=out) is out
    check(out, y, dtype)
    buf = x.copy()  # the memory planner's reuse: out is x
    assert kernel(np, buf, axis=axis, out=buf) is buf
    check(buf, y, dtype)
    fresh = kernel(np, x, axis=axis)
    buf = x.copy()  # or another array over x's buffer (a planned replay): the same bits
    view = buf.reshape(buf.shape)
    assert kernel(np, buf, axis=axis, out=view) is view
    np.testing.assert_array_equal(view, fresh)
    np.testing.assert_array_equal(out, fresh)
    y_d = y.astype(dtype)
    want = softmax_grad_ref(y_d.astype(np.float64), g.astype(np.float64))
    check(grad(np, y_d, g, axis=axis), want, dtype, 10.0)
    g2 = g.copy()
    assert grad(np, y_d, g2, axis=axis, out=g2) is g2
    check(g2, want, dtype, 10.0)
    assert ran == loops_ran(kern, ["softmax"] * 5 + ["softmax_grad"] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_relu_and_grad(shape, dtype, kern, ran):
    x, g = data(shape, dtype, 3), data(shape, dtype, 4)
    x.reshape(-1)[0] = np.nan
    kernel, grad = kern("relu"), kern("relu_grad")
    want = np.where(x < 0, 0.0, x.astype(np.float64))  # NaN stays NaN
    np.testing.assert_array_equal(kernel(np, x), want.astype(dtype))
    buf = x.copy()
    assert kernel(np, buf, out=buf) is buf  # relu_: written into x itself
    np.testing.assert_array_equal(buf, want.astype(dtype))
    y = np.nan_to_num(buf)
    dwant = (g * (y > 0)).astype(dtype)
    np.testing.assert_array_equal(grad(np, y, g), dwant)
    g2 = g.copy()
    assert grad(np, y, g2, out=g2) is g2
    np.testing.assert_array_equal(g2, dwant)
    assert ran == loops_ran(kern, ["relu"] * 2 + ["relu_grad"] * 2)


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_and_grad(shape, dtype, approximate, kern, ran):
    x, g = data(shape, dtype, 5, 4.0), data(shape, dtype, 6)
    x.reshape(-1)[:3] = [-12.0, 30.0, 0.0][:x.size]
    kernel, grad = kern("gelu"), kern("gelu_grad")
    x64 = x.astype(np.float64)
    ref, grad_ref = (gelu_ref, gelu_grad_ref) if approximate else \
        (gelu_exact_ref, gelu_exact_grad_ref)
    check(kernel(np, x, approximate=approximate), ref(x64), dtype, 10.0)
    buf = x.copy()
    assert kernel(np, buf, approximate=approximate, out=buf) is buf
    check(buf, ref(x64), dtype, 10.0)
    want = grad_ref(x64, g.astype(np.float64))
    check(grad(np, x, g, approximate=approximate), want, dtype, 10.0)
    g2 = g.copy()
    assert grad(np, x, g2, approximate=approximate, out=g2) is g2
    check(g2, want, dtype, 10.0)
    # compiled: tanh in both dtypes, exact in float32 (float64 keeps numpy's kernel)
    loop = "gelu_tanh" if approximate else "gelu_erf"
    compiled = approximate or dtype == np.float32
    assert ran == loops_ran(kern, [loop] * 2 + [f"{loop}_grad"] * 2 if compiled else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k,affine", [((7,), 1, "wb"), ((4, 9), 1, "w"), ((4, 9), 1, ""),
                                            ((2, 3, 33), 1, "b"), ((2, 3, 5), 2, "wb"),
                                            ((64, 64), 1, "wb")])
def test_layer_norm_and_grad(shape, k, affine, dtype, kern, ran):
    x, dout = data(shape, dtype, 7, 2.0) + dtype(5.0), data(shape, dtype, 8)
    tail = shape[len(shape) - k:]
    w = data(tail, dtype, 9) if "w" in affine else None
    b = data(tail, dtype, 10) if "b" in affine else None
    f64 = (lambda a: None if a is None else a.astype(np.float64))
    out, mean, rstd = kern("layer_norm")(np, x, w, b, begin_norm_axis=len(shape) - k,
                                               epsilon=1e-5)
    want, wmean, wrstd = layer_norm_ref(f64(x), f64(w), f64(b), k)
    check(out, want, dtype, 10.0)
    check(mean, wmean, dtype, 10.0)
    check(rstd, wrstd, dtype)
    dx, dw, db = kern("layer_norm_grad")(np, x, w, mean, rstd, dout,
                                               begin_norm_axis=len(shape) - k, epsilon=1e-5)
    wdx, wdw, wdb = layer_norm_grad_ref(f64(x), f64(w), f64(dout), k)
    check(dx, wdx, dtype, 10.0)
    assert dw.shape == db.shape == tail
    check(dw, wdw, dtype, 100.0)
    check(db, wdb, dtype, 100.0)
    assert ran == loops_ran(kern, ["layer_norm", "layer_norm_grad"])


@pytest.mark.parametrize("path", ["registered", "numpy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2,wd", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.2)])
def test_adam_update(l2, wd, dtype, path, ran, monkeypatch):
    """adam_update's kernel — one compiled pass when numba is chosen, or numpy's passes — in
    place against Adam(W)'s third step in float64; a non-contiguous parameter takes numpy's."""
    from disttensor.ops import optim
    if path == "numpy":
        monkeypatch.setattr(optim, "_adam_pass", inspect.unwrap(optim._adam_pass))
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    shape = (33, 65)
    p, g, m = data(shape, dtype, 20), data(shape, dtype, 21), data(shape, dtype, 22, 0.1)
    v = np.abs(data(shape, dtype, 23, 0.1))
    p64, g64, m64, v64 = (a.astype(np.float64) for a in (p, g, m, v))
    gi = g64 + l2 * p64
    wm = b1 * m64 + (1 - b1) * gi
    wv = b2 * v64 + (1 - b2) * gi * gi
    wp = p64 * (1 - lr * wd) - lr / (1 - b1 ** 3) * wm / (np.sqrt(wv / (1 - b2 ** 3)) + eps)

    def step(p, g, m, v):
        b1p, b2p = np.array([b1 ** 2], dtype), np.array([b2 ** 2], dtype)
        out = OPS["adam_update"].kernel(np, p, g, m, v, b1p, b2p, np.array(lr, dtype),
                                        beta1=b1, beta2=b2, epsilon=eps, l2=l2,
                                        weight_decay=wd, lr_scale=1.0)
        assert out[0] is p and out[1] is m and out[2] is v
        check(b1p, [b1 ** 3], dtype)
        check(b2p, [b2 ** 3], dtype)

    step(p, g, m, v)
    check(m, wm, dtype)
    check(v, wv, dtype)
    check(p, wp, dtype)
    wide = np.zeros((shape[0], 2 * shape[1]), dtype)
    strided = wide[:, ::2]
    strided[...] = p64.astype(dtype)
    step(strided, g, m64.astype(dtype), v64.astype(dtype))
    check(strided, wp, dtype)
    assert ran == (["adam"] if path == "registered" and fast.BACKEND == "numba" else [])


@needs_numba
def test_exp_is_accurate_over_the_normal_range():
    """The loops' exp (vectorizable, not libm's) within 2 units in the last place of numpy's
    float64 exp wherever the result is a normal number, inf above, 0 far below; compiled with
    the loops' floating-point flags, under which reassociation once merged ln 2's two halves
    (4.5 units off near x = 88)."""
    from numba import njit

    from disttensor.ops.numba_loops import _JIT, _exp

    @njit(fastmath=_JIT["fastmath"])
    def exp_all(a, out):
        for i in range(a.size):
            out[i] = _exp(a[i])

    for dtype, lo, hi in ((np.float32, -86.6, 88.7), (np.float64, -707.7, 709.7)):
        a = np.linspace(lo, hi, 400_001).astype(dtype)
        got = np.empty_like(a)
        exp_all(a, got)
        want = np.exp(a.astype(np.float64))
        rel = np.abs(got - want) / want
        assert rel.max() < 2 * np.finfo(dtype).eps, (dtype, a[rel.argmax()], rel.max())
        ends = np.array([-1e4, 1e4, np.inf, -np.inf, np.nan], dtype)
        got = np.empty_like(ends)
        exp_all(ends, got)
        np.testing.assert_array_equal(got, [0.0, np.inf, np.inf, 0.0, np.nan])


@pytest.mark.skipif(fast.BACKEND != "numba", reason="compiled kernels not chosen")
def test_exact_gelu_float32_is_within_a_few_eps_of_math_erfc(ran):
    """The compiled exact GELU and its gradient in float32 on a dense grid, both tails included,
    against math.erfc in float64: within 4 eps relative wherever x >= -13 (below, x * Phi(x) <
    2e-37 and its gradient < 2e-36 underflow); the gradient, which crosses 0 near x = -0.75,
    relative to ``|Phi(x)| + |x pdf(x)|``. Signed zeros, infinities and NaN as numpy's kernel
    gives them."""
    rng = np.random.default_rng(12)
    x = np.concatenate([np.linspace(-13.0, 13.5, 400_001), rng.standard_normal(100_000) * 3,
                        np.geomspace(1e-30, 1.0, 2_001), -np.geomspace(1e-30, 1.0, 2_001)])
    x = x.astype(np.float32)
    x = x[x >= -13.0]
    x64 = x.astype(np.float64)
    phi = phi_ref(x64)
    x_pdf = x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    eps = np.finfo(np.float32).eps
    got = OPS["gelu"].kernel(np, x, approximate=False)
    want = x64 * phi
    nonzero = want != 0
    rel = np.abs(got[nonzero] - want[nonzero]) / np.abs(want[nonzero])
    assert rel.max() <= 4 * eps, (x[nonzero][rel.argmax()], rel.max() / eps)
    assert np.array_equal(got == 0, x == 0)
    dgot = OPS["gelu_grad"].kernel(np, x, np.ones_like(x), approximate=False)
    drel = np.abs(dgot - (phi + x_pdf)) / (phi + np.abs(x_pdf))
    assert drel.max() <= 4 * eps, (x[drel.argmax()], drel.max() / eps)
    far = np.array([-13.0, -13.1, -13.2, -13.25, -13.27, -13.3, -14.0, -30.0], np.float32)
    assert np.all(np.abs(OPS["gelu"].kernel(np, far, approximate=False)) < 2e-37)
    assert np.all(np.abs(OPS["gelu_grad"].kernel(np, far, np.ones_like(far),
                                                 approximate=False)) < 2e-36)

    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e30, 20.0, -20.0],
                       np.float32)
    numpy_gelu, numpy_grad = inspect.unwrap(OPS["gelu"].kernel), \
        inspect.unwrap(OPS["gelu_grad"].kernel)
    with np.errstate(invalid="ignore", over="ignore"):
        want_s = numpy_gelu(np, special, approximate=False)
        dwant_s = numpy_grad(np, special, np.ones_like(special), approximate=False)
    got_s = OPS["gelu"].kernel(np, special, approximate=False)
    np.testing.assert_array_equal(got_s, want_s)  # NaN at -inf (0 * -inf) and NaN
    np.testing.assert_array_equal(np.signbit(got_s), np.signbit(want_s))  # -0.0 stays -0.0
    np.testing.assert_array_equal(
        OPS["gelu_grad"].kernel(np, special, np.ones_like(special), approximate=False), dwant_s)
    assert ran == ["gelu_erf", "gelu_erf_grad"] * 3


@needs_numba
def test_softmax_special_values_match_numpy(ran):
    x = np.array([[1.0, np.nan, 2.0], [0.0, -np.inf, 1.0], [1e4, 1e4, -1e4], [np.inf, 0.0, 1.0]],
                 np.float32)
    got = OPS["softmax"].kernel(np, x, axis=1)
    with np.errstate(invalid="ignore"):
        want = softmax_ref(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # NaN rows: NaN in both
    assert ran == ["softmax"]


@needs_numba
def test_cases_the_loops_do_not_take_fall_back_to_numpy(ran):
    x = data((6, 8), np.float32, 11)
    strided = x[:, ::2]
    np.testing.assert_array_equal(OPS["relu_grad"].kernel(np, x, x[:1]), x[:1] * (x > 0))
    check(OPS["softmax"].kernel(np, strided, axis=1), softmax_ref(strided.astype(np.float64)),
          np.float32)
    check(OPS["softmax"].kernel(np, x, axis=0), softmax_ref(x.T.astype(np.float64)).T,
          np.float32)
    np.testing.assert_array_equal(OPS["relu"].kernel(np, strided), np.maximum(strided, 0))
    half = x.astype(np.float16)
    assert OPS["relu"].kernel(np, half).dtype == np.float16
    exact = OPS["gelu"].kernel(np, x.astype(np.float64), approximate=False)  # float64: numpy
    np.testing.assert_allclose(exact, gelu_exact_ref(x.astype(np.float64)), rtol=1e-12,
                               atol=1e-14)
    with np.errstate(divide="ignore"):  # numpy's kernel on rows of no elements
        assert OPS["softmax"].kernel(np, np.zeros((3, 0), np.float32), axis=1).shape == (3, 0)
    assert ran == []
