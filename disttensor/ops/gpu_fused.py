"""Fused cupy kernels for the GPU path: one launch where the numpy-style kernel makes several
passes (a kernel launch costs more than the arithmetic at these sizes). Each factory here takes
an op's numpy kernel and returns one of the same signature that runs the fused kernel on cupy
arrays and the numpy kernel otherwise (``__wrapped__``). The kernels compute in the arrays'
dtype, as the numpy kernels do; cupy compiles each once per dtype (and caches it on disk).
GELU (exact and tanh) and its gradient; Adam's elementwise update; and, over rows (the last
axis of softmax, the trailing axes of layer_norm), one thread block per row for softmax,
layer_norm and their gradients (layer_norm's weight and bias gradients are two column sums).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from collectives._common import is_cupy

__all__ = ["gelu", "gelu_grad", "adam", "softmax", "softmax_grad", "layer_norm",
           "layer_norm_grad"]

Kernel = Callable[..., Any]

_C = repr(math.sqrt(2.0 / math.pi))     # the tanh approximation: tanh(C * (x + A * x**3))
_A = repr(0.044715)
_R2 = repr(1.0 / math.sqrt(2.0))
_P = repr(1.0 / math.sqrt(2.0 * math.pi))

# name -> (inputs, outputs, body): CUDA elementwise code over type T
_SOURCES = {
    # with u = C (x + A x^3) and e = exp(-2u): (1 + tanh u) / 2 = 1 / (1 + e) = s and
    # (1 - tanh^2 u) / 4 = s (1 - s), with 1 - s taken as e s where s is near 1 (e <= 1) and
    # as 1 - s elsewhere (e may overflow to inf there): precise in both tails, never inf * 0
    "gelu_tanh": ("T x", "T y",
                  f"y = x / ((T)1 + exp((T)-2 * (T){_C} * (x + (T){_A} * x * x * x)));"),
    "gelu_erf": ("T x", "T y", f"y = (T)0.5 * x * erfc(-x * (T){_R2});"),
    "gelu_tanh_grad": ("T x, T g", "T y",
                       f"T e = exp((T)-2 * (T){_C} * (x + (T){_A} * x * x * x));"
                       f"T s = (T)1 / ((T)1 + e);"
                       f"T w = e > (T)1 ? (T)1 - s : e * s;"
                       f"y = g * (s + (T)2 * (T){_C} * x"
                       f" * ((T)1 + (T)3 * (T){_A} * x * x) * w * s);"),
    "gelu_erf_grad": ("T x, T g", "T y",
                      f"y = g * ((T)0.5 * erfc(-x * (T){_R2})"
                      f" + x * (T){_P} * exp((T)-0.5 * x * x));"),
    # g = grad + l2 * param (before the decay), param *= decay, m1 = b1 m1 + (1-b1) g,
    # m2 = b2 m2 + (1-b2) g g, param -= step * m1 / (sqrt(m2) + eps)
    "adam": ("T grad, float64 b1, float64 b2, float64 eps, float64 l2, float64 decay, "
             "float64 step", "T param, T m1, T m2",
             "T g = grad + (T)l2 * param; param = param * (T)decay;"
             "m1 = m1 * (T)b1 + g * (T)(1.0 - b1); m2 = m2 * (T)b2 + g * g * (T)(1.0 - b2);"
             "param = param - m1 / (sqrt(m2) + (T)eps) * (T)step;"),
}


@functools.cache
def _kernel(name: str):
    import cupy
    return cupy.ElementwiseKernel(*_SOURCES[name], name=f"disttensor_{name}")


def _fusable(x, *others) -> bool:
    """cupy arrays, x float32/float64 and non-empty, the others (None skipped) of x's dtype."""
    if not is_cupy(x) or x.dtype not in (np.float32, np.float64) or not x.size:
        return False
    return all(a is None or (is_cupy(a) and a.dtype == x.dtype) for a in others)


def _into(kernel, out, *args):
    """``kernel(*args)`` into ``out`` when given (which may be one of the inputs)."""
    return kernel(*args) if out is None else kernel(*args, out)


def gelu(numpy_kernel: Kernel) -> Kernel:
    """``gelu(xp, x, approximate=False, out=None)``."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, x, approximate=False, out=None):
        if not _fusable(x, out):
            return numpy_kernel(xp, x, approximate=approximate, out=out)
        return _into(_kernel("gelu_tanh" if approximate else "gelu_erf"), out, x)
    return kernel


def gelu_grad(numpy_kernel: Kernel) -> Kernel:
    """``gelu_grad(xp, x, dout, approximate=False, out=None)``."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, x, dout, approximate=False, out=None):
        if not _fusable(x, dout, out):
            return numpy_kernel(xp, x, dout, approximate=approximate, out=out)
        return _into(_kernel("gelu_tanh_grad" if approximate else "gelu_erf_grad"), out, x, dout)
    return kernel


def adam(numpy_kernel: Kernel) -> Kernel:
    """``adam(xp, param, grad, moment1, moment2, beta1, beta2, eps, l2, decay, step)`` in place."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, param, grad, moment1, moment2, *scalars):
        if not _fusable(param, grad, moment1, moment2):
            return numpy_kernel(xp, param, grad, moment1, moment2, *scalars)
        _kernel("adam")(grad, *(float(c) for c in scalars), param, moment1, moment2)
    return kernel


# -- row kernels: one block of _THREADS per row of n (C-contiguous), sums by warp shuffles ------

_THREADS = 256
_ROWS = r"""
__device__ T combine(T a, T b, bool is_max) { return is_max ? (a > b ? a : b) : a + b; }
// the block's total (or maximum) of v, on every thread; sh holds 33 values
__device__ T block_reduce(T v, T* sh, bool is_max) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = combine(v, __shfl_down_sync(0xffffffffu, v, o), is_max);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = threadIdx.x < (blockDim.x >> 5) ? sh[lane] : (is_max ? sh[0] : (T)0);
        for (int o = 16; o > 0; o >>= 1)
            v = combine(v, __shfl_down_sync(0xffffffffu, v, o), is_max);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    v = sh[32];
    __syncthreads();
    return v;
}
extern "C" __global__ void dt_softmax(const T* x, T* y, int n) {
    __shared__ T sh[33];
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    T m = xr[0];
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = xr[i] > m ? xr[i] : m;
    m = block_reduce(m, sh, true);
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += exp(xr[i] - m);
    s = (T)1 / block_reduce(s, sh, false);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = exp(xr[i] - m) * s;
}
extern "C" __global__ void dt_softmax_grad(const T* y, const T* g, T* out, int n) {
    __shared__ T sh[33];
    long long o = (long long)blockIdx.x * n;
    T d = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d += y[o + i] * g[o + i];
    d = block_reduce(d, sh, false);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[o + i] = y[o + i] * (g[o + i] - d);
}
extern "C" __global__ void dt_layer_norm(const T* x, const T* w, const T* b, T* y, T* mean,
                                         T* rstd, int n, double eps, int has_w, int has_b) {
    __shared__ T sh[33];
    long long o = (long long)blockIdx.x * n;
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[o + i];
    T m = block_reduce(s, sh, false) / (T)n;
    T v = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { T c = x[o + i] - m; v += c * c; }
    T r = (T)(1.0 / sqrt((double)(block_reduce(v, sh, false) / (T)n) + eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T out = (x[o + i] - m) * r;
        if (has_w) out *= w[i];
        if (has_b) out += b[i];
        y[o + i] = out;
    }
    if (threadIdx.x == 0) { mean[blockIdx.x] = m; rstd[blockIdx.x] = r; }
}
// dx = r * (dout * w - a - xhat * c), a = mean(dout * w), c = mean(dout * w * xhat)
extern "C" __global__ void dt_layer_norm_grad(const T* x, const T* w, const T* mean,
                                              const T* rstd, const T* dout, T* dx, int n,
                                              int has_w) {
    __shared__ T sh[33];
    long long o = (long long)blockIdx.x * n;
    T m = mean[blockIdx.x], r = rstd[blockIdx.x], a = 0, c = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T d = has_w ? dout[o + i] * w[i] : dout[o + i];
        a += d;
        c += d * (x[o + i] - m) * r;
    }
    a = block_reduce(a, sh, false) / (T)n;
    c = block_reduce(c, sh, false) / (T)n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T d = has_w ? dout[o + i] * w[i] : dout[o + i];
        dx[o + i] = r * (d - a - (x[o + i] - m) * r * c);
    }
}
"""


@functools.cache
def _row_kernel(name: str, dtype: np.dtype):
    import cupy
    ctype = {"float32": "float", "float64": "double"}[np.dtype(dtype).name]
    return cupy.RawModule(code=f"typedef {ctype} T;\n" + _ROWS).get_function(name)


@functools.cache
def _column_sums():
    """``sum over rows of dout * (x - mean) * rstd`` (layer_norm's weight gradient)."""
    import cupy
    return cupy.ReductionKernel("T d, T x, T m, T r", "T y", "d * (x - m) * r", "a + b", "y = a",
                                "0", "disttensor_ln_dweight")


def _launch(name: str, rows: int, *args) -> None:
    _row_kernel(name, args[0].dtype)((rows,), (_THREADS,), args)


def _contiguous(a):
    import cupy
    return cupy.ascontiguousarray(a)


def _rows_into(name: str, xp, out, *arrays):
    """The row kernel ``name`` over the last axis of ``arrays`` (made C-contiguous) into ``out``
    (which may be one of them; a strided ``out`` gets the result copied in) or a new array."""
    arrays = [_contiguous(a) for a in arrays]
    x = arrays[0]
    res = out if out is not None and out.flags.c_contiguous else xp.empty_like(x)
    _launch(name, x.size // x.shape[-1], *arrays, res, np.int32(x.shape[-1]))
    if out is not None and res is not out:
        out[...] = res
        return out
    return res


def softmax(numpy_kernel: Kernel) -> Kernel:
    """``softmax(xp, x, axis, out=None)``: the row kernel over the last axis."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, x, axis, out=None):
        if axis != x.ndim - 1 or not _fusable(x, out):
            return numpy_kernel(xp, x, axis, out=out)
        return _rows_into("dt_softmax", xp, out, x)
    return kernel


def softmax_grad(numpy_kernel: Kernel) -> Kernel:
    """``softmax_grad(xp, y, dout, axis, out=None)``: the row kernel over the last axis."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, y, dout, axis, out=None):
        if axis != y.ndim - 1 or not _fusable(y, dout, out) or dout.shape != y.shape:
            return numpy_kernel(xp, y, dout, axis, out=out)
        return _rows_into("dt_softmax_grad", xp, out, y, dout)
    return kernel


def layer_norm(numpy_kernel: Kernel) -> Kernel:
    """``layer_norm(xp, x, weight, bias, begin_norm_axis, epsilon) -> (out, mean, rstd)``."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, x, weight, bias, begin_norm_axis, epsilon):
        if not _fusable(x, weight, bias):
            return numpy_kernel(xp, x, weight, bias, begin_norm_axis, epsilon)
        lead = x.shape[:begin_norm_axis]
        rows = math.prod(lead)
        x = _contiguous(x)
        out = xp.empty_like(x)
        mean, rstd = xp.empty(lead, x.dtype), xp.empty(lead, x.dtype)
        w = x if weight is None else _contiguous(weight)
        b = x if bias is None else _contiguous(bias)
        _launch("dt_layer_norm", rows, x, w, b, out, mean, rstd, np.int32(x.size // rows),
                np.float64(epsilon), np.int32(weight is not None), np.int32(bias is not None))
        return out, mean, rstd
    return kernel


def layer_norm_grad(numpy_kernel: Kernel) -> Kernel:
    """``layer_norm_grad(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon) ->
    (dx, dweight, dbias)``: the row kernel for dx, two column sums for dweight and dbias."""
    @functools.wraps(numpy_kernel)
    def kernel(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon):
        if not (_fusable(x, weight, mean, rstd, dout) and dout.shape == x.shape):
            return numpy_kernel(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon)
        tail = x.shape[begin_norm_axis:]
        rows = math.prod(x.shape[:begin_norm_axis])
        n = x.size // rows
        x, dout = _contiguous(x), _contiguous(dout)
        mean, rstd = _contiguous(mean).reshape(rows, 1), _contiguous(rstd).reshape(rows, 1)
        dx = xp.empty_like(x)
        w = x if weight is None else _contiguous(weight)
        _launch("dt_layer_norm_grad", rows, x, w, mean, rstd, dout, dx, np.int32(n),
                np.int32(weight is not None))
        x2, d2 = x.reshape(rows, n), dout.reshape(rows, n)
        shape = tail if weight is None else weight.shape
        dw = _column_sums()(d2, x2, mean, rstd, axis=0).reshape(shape)
        db = d2.sum(axis=0).reshape(shape)
        return dx, dw, db
    return kernel
