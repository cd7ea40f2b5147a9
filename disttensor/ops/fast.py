"""Compiled kernels for softmax, layer_norm, relu (relu_ included) and gelu and their gradients,
the row passes of fused attention's key blocks,
and Adam's elementwise update; cross entropy's rows and gradient (class axis last and whole on
the rank) and training batch_norm and its gradient (channels last in memory: x 2-d or
channels-last), chosen once at import: the numba loops of :mod:`.numba_loops` when numba is
installed (``pip install "disttensor[fast]"``), else the numpy kernels.

``DISTTENSOR_KERNELS`` picks: ``auto`` (the default: numba when importable), ``numba`` (an
ImportError without it) or ``numpy``. :data:`BACKEND` says which was chosen.

Each factory here takes an op's numpy kernel and returns the kernel to register: with numba,
one of the same signature that runs the compiled loop when the call fits it — numpy arrays
(not cupy) of one float dtype (float32 or float64), C-contiguous, non-empty, of one shape,
reducing over the last axis (softmax) or trailing axes (layer_norm), exact gelu in float32 only,
Adam's four arrays disjoint — and calls the numpy kernel otherwise (its ``__wrapped__``).
Results equal the numpy kernels' within rounding (tests/core/test_fast_kernels).
The loops are single-threaded, like ranks run (``OMP_NUM_THREADS=1``). ``import numba`` (about
a second) waits for the first compiled call; each loop compiles once per dtype (and in-place
form) into numba's on-disk cache (``cache=True``), so later processes load it.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
from typing import Any, Callable

import numpy as np

__all__ = ["BACKEND", "softmax", "softmax_grad", "layer_norm", "layer_norm_grad", "relu",
           "relu_grad", "gelu", "gelu_grad", "adam", "cross_entropy_rows", "cross_entropy_grad",
           "batch_norm", "batch_norm_grad", "attention_softmax", "attention_grad_rows"]

Kernel = Callable[..., Any]


def _choose() -> str:
    want = os.environ.get("DISTTENSOR_KERNELS", "auto").strip().lower() or "auto"
    if want not in ("auto", "numba", "numpy"):
        raise ValueError(f"DISTTENSOR_KERNELS must be 'auto', 'numba' or 'numpy', got {want!r}")
    if want == "numpy":
        return "numpy"
    if importlib.util.find_spec("numba") is None:
        if want == "numba":
            raise ImportError("DISTTENSOR_KERNELS=numba, but numba is not installed: "
                              "pip install 'disttensor[fast]'")
        return "numpy"
    return "numba"


#: "numba" or "numpy": the kernels this process registered
BACKEND: str = _choose()


@functools.cache
def _loops():
    _allow_512_bit_vectors()
    from . import numba_loops
    return numba_loops


@functools.cache
def _attention_loops():
    _loops()
    from . import numba_attention
    return numba_attention


def _allow_512_bit_vectors() -> None:
    """Let numba's LLVM use 512-bit vectors where the host has AVX-512 (F, BW, DQ and VL, the
    set PyTorch's CPU kernels require for theirs): LLVM's tuning for Intel's server CPUs
    prefers 256-bit ones (exact GELU at [1024, 1024] runs 1.4x faster with 512). Done only
    when this process has not imported numba and NUMBA_CPU_NAME / NUMBA_CPU_FEATURES are
    unset (they stay the user's choice). numba fixes its code generator's features when it
    first makes it, here, so the variable is set for that moment only: child processes do not
    inherit it."""
    if "numba" in sys.modules or {"NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"} & set(os.environ):
        return
    import llvmlite.binding as ll

    features = ll.get_host_cpu_features().flatten()
    if not {"+avx512f", "+avx512bw", "+avx512dq", "+avx512vl"} <= set(features.split(",")):
        return
    os.environ["NUMBA_CPU_FEATURES"] = features + ",-prefer-256-bit"
    try:
        from numba.core.registry import cpu_target

        cpu_target.target_context  # makes the code generator with these features
    except (ImportError, AttributeError):  # a numba laid out otherwise: its default vectors
        pass
    finally:
        del os.environ["NUMBA_CPU_FEATURES"]


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _floats(xp, x, *others) -> bool:
    """numpy arrays of one dtype, float32 or float64, C-contiguous, x non-empty (None among
    ``others`` skipped)."""
    if xp is not np or type(x) is not np.ndarray or not x.size or not x.flags.c_contiguous:
        return False
    d = x.dtype
    if d is not _F32 and d is not _F64:
        return False
    for a in others:
        if a is not None and (type(a) is not np.ndarray or a.dtype is not d
                              or not a.flags.c_contiguous):
            return False
    return True


def _fits(xp, x, a, b=None) -> bool:
    """:func:`_floats` for an elementwise call: ``a`` and ``b`` (None or arrays) also of x's
    shape. The check every call of the elementwise kernels pays, so written out."""
    if xp is not np or type(x) is not np.ndarray or not x.flags.c_contiguous or not x.size:
        return False
    d = x.dtype
    if d is not _F32 and d is not _F64:
        return False
    if a is not None and a is not x and (type(a) is not np.ndarray or a.dtype is not d
                                         or a.shape != x.shape or not a.flags.c_contiguous):
        return False
    return b is None or (type(b) is np.ndarray and b.dtype is d and b.shape == x.shape
                         and b.flags.c_contiguous)


def _rows(a: np.ndarray, lead: int) -> np.ndarray:
    """``a`` as ``[rows, n]``: the axes from ``lead`` on flattened into n."""
    return a.reshape(-1, math.prod(a.shape[lead:]))




def _compiled(numpy_kernel: Kernel):
    """Decorator: the decorated kernel when numba was chosen (``__wrapped__`` = the numpy
    kernel), else ``numpy_kernel`` itself."""
    def deco(kernel: Kernel) -> Kernel:
        return functools.wraps(numpy_kernel)(kernel) if BACKEND == "numba" else numpy_kernel
    return deco


def _same_buffer(out, a) -> bool:
    """``out`` another array over ``a``'s very elements (a planned replay's reused block)."""
    return (out is not None and np.may_share_memory(out, a)
            and out.__array_interface__["data"][0] == a.__array_interface__["data"][0])


def _run1(loop, x, out, shape) -> np.ndarray:
    """``loop(x, dest)`` on the arrays reshaped to ``shape``: ``dest`` None when ``out`` is x
    or x's buffer (the loop's in-place form, which vectorizes where two names for one buffer
    would not), else ``out`` (fresh when None); returns the result."""
    if out is x or _same_buffer(out, x):
        loop(x.reshape(shape), None)
        return out
    if out is None:
        out = np.empty_like(x)
    loop(x.reshape(shape), out.reshape(shape))
    return out


def _run2(loop, y, g, out, shape) -> np.ndarray:
    """``loop(y, g, dest)``, in place into g when ``out`` is g (as :func:`_run1`)."""
    if out is g or _same_buffer(out, g):
        loop(y.reshape(shape), g.reshape(shape), None)
        return out
    if out is None:
        out = np.empty_like(y)
    loop(y.reshape(shape), g.reshape(shape), out.reshape(shape))
    return out


def softmax(numpy_kernel: Kernel) -> Kernel:
    """``softmax(xp, x, axis, out=None)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, axis, out=None):
        if axis == x.ndim - 1 and _fits(xp, x, out):
            return _run1(_loops().softmax, x, out, (-1, x.shape[-1]))
        return numpy_kernel(xp, x, axis, out=out)
    return kernel


def softmax_grad(numpy_kernel: Kernel) -> Kernel:
    """``softmax_grad(xp, y, dout, axis, out=None)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, y, dout, axis, out=None):
        if axis == y.ndim - 1 and _fits(xp, y, dout, out):
            return _run2(_loops().softmax_grad, y, dout, out, (-1, y.shape[-1]))
        return numpy_kernel(xp, y, dout, axis, out=out)
    return kernel


def _params(x, weight, bias, n: int):
    """(w, b) as length-n arrays; ones and zeros for the absent ones."""
    w = np.ones(n, x.dtype) if weight is None else weight.reshape(n)
    b = np.zeros(n, x.dtype) if bias is None else bias.reshape(n)
    return w, b


def layer_norm(numpy_kernel: Kernel) -> Kernel:
    """``layer_norm(xp, x, weight, bias, begin_norm_axis, epsilon) -> (out, mean, rstd)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, weight, bias, begin_norm_axis, epsilon):
        if not _floats(xp, x, weight, bias):
            return numpy_kernel(xp, x, weight, bias, begin_norm_axis, epsilon)
        x2 = _rows(x, begin_norm_axis)
        w, b = _params(x, weight, bias, x2.shape[1])
        out = np.empty_like(x)
        mean = np.empty(x.shape[:begin_norm_axis], x.dtype)
        rstd = np.empty_like(mean)
        _loops().layer_norm(x2, w, b, float(epsilon), _rows(out, begin_norm_axis),
                            mean.reshape(-1), rstd.reshape(-1))
        return out, mean, rstd
    return kernel


def layer_norm_grad(numpy_kernel: Kernel) -> Kernel:
    """``layer_norm_grad(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon) ->
    (dx, dweight, dbias)``; dweight/dbias shaped like weight (else ``x.shape[b:]``)."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon):
        if not (_floats(xp, x, weight, mean, rstd, dout) and dout.shape == x.shape):
            return numpy_kernel(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon)
        x2 = _rows(x, begin_norm_axis)
        n = x2.shape[1]
        w, _ = _params(x, weight, None, n)
        dx = np.empty_like(x)
        dw = np.empty(x.shape[begin_norm_axis:] if weight is None else weight.shape, x.dtype)
        db = np.empty_like(dw)
        _loops().layer_norm_grad(x2, w, mean.reshape(-1), rstd.reshape(-1),
                                 _rows(dout, begin_norm_axis), _rows(dx, begin_norm_axis),
                                 dw.reshape(n), db.reshape(n))
        return dx, dw, db
    return kernel


def relu(numpy_kernel: Kernel) -> Kernel:
    """``relu(xp, x, out=None)``; ``out`` may be x (``relu_`` writes x directly)."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, out=None):
        if _fits(xp, x, out):
            return _run1(_loops().relu, x, out, -1)
        return numpy_kernel(xp, x, out=out)
    return kernel


def relu_grad(numpy_kernel: Kernel) -> Kernel:
    """``relu_grad(xp, out, dout, out=None)``: dout where the forward's output is > 0."""
    @_compiled(numpy_kernel)
    def kernel(xp, y, dout, out=None):
        if _fits(xp, y, dout, out):
            return _run2(_loops().relu_grad, y, dout, out, -1)
        return numpy_kernel(xp, y, dout, out=out)
    return kernel


def _gelu_loop(approximate, dtype) -> bool:
    """GELU's compiled forms: the tanh approximation (float32/float64) and the exact one in
    float32 (its normal CDF is fitted to float32 precision; float64 keeps numpy's kernel)."""
    return bool(approximate) or dtype is _F32


def gelu(numpy_kernel: Kernel) -> Kernel:
    """``gelu(xp, x, approximate=False, out=None)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, approximate=False, out=None):
        if _fits(xp, x, out) and _gelu_loop(approximate, x.dtype):
            loop = _loops().gelu_tanh if approximate else _loops().gelu_erf
            return _run1(loop, x, out, -1)
        return numpy_kernel(xp, x, approximate=approximate, out=out)
    return kernel


def gelu_grad(numpy_kernel: Kernel) -> Kernel:
    """``gelu_grad(xp, x, dout, approximate=False, out=None)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, dout, approximate=False, out=None):
        if _fits(xp, x, dout, out) and _gelu_loop(approximate, x.dtype):
            loop = _loops().gelu_tanh_grad if approximate else _loops().gelu_erf_grad
            return _run2(loop, x, dout, out, -1)
        return numpy_kernel(xp, x, dout, approximate=approximate, out=out)
    return kernel


def adam(numpy_kernel: Kernel) -> Kernel:
    """``adam(xp, param, grad, moment1, moment2, beta1, beta2, eps, l2, decay, step)``: Adam's
    elementwise update in place, one pass (numpy's takes ten)."""
    @_compiled(numpy_kernel)
    def kernel(xp, param, grad, moment1, moment2, *scalars):
        if _fits(xp, param, grad, moment1) and _fits(xp, param, moment2) and not any(
                np.may_share_memory(a, b) for a, b in ((param, grad), (param, moment1),
                                                       (param, moment2), (moment1, moment2))):
            _loops().adam(param.reshape(-1), grad.reshape(-1), moment1.reshape(-1),
                          moment2.reshape(-1), *(float(c) for c in scalars))
            return
        numpy_kernel(xp, param, grad, moment1, moment2, *scalars)
    return kernel


# -- cross entropy (hard labels, whole class axis) ------------------------------------------

def _whole_classes(xp, x, label, axis, ctx) -> bool:
    """The rows of a cross entropy call a loop can take: float x (see :func:`_floats`) whose
    last axis holds the classes, not split across ranks (no class offset, no collective; decided
    alike on every rank), and a numpy integer label with one entry per row."""
    return (axis == x.ndim - 1 and _floats(xp, x) and type(label) is np.ndarray
            and label.dtype.kind in "iu" and label.size * x.shape[-1] == x.size
            and not ctx.is_split(0, axis))


def cross_entropy_rows(numpy_rows: Kernel) -> Kernel:
    """``rows(xp, logits, label, axis, ignore_index, ctx) -> (softmax, loss, stats)``."""
    @_compiled(numpy_rows)
    def rows(xp, logits, label, axis, ignore_index, ctx):
        if not _whole_classes(xp, logits, label, axis, ctx):
            return numpy_rows(xp, logits, label, axis, ignore_index, ctx)
        n = logits.shape[-1]
        sm = np.empty_like(logits)
        loss = np.empty(logits.shape[:-1] + (1,), logits.dtype)
        stats = np.empty(3, np.float64)
        _loops().cross_entropy_rows(logits.reshape(-1, n), label.reshape(-1),
                                    int(ignore_index), sm.reshape(-1, n), loss.reshape(-1),
                                    stats)
        return sm, loss, stats
    return rows


def cross_entropy_grad(numpy_kernel: Kernel) -> Kernel:
    """``cross_entropy_grad(xp, softmax, label, dloss, axis, ignore_index, ctx, out=None)``;
    ``out`` may be softmax."""
    @_compiled(numpy_kernel)
    def kernel(xp, softmax, label, dloss, axis, ignore_index, ctx, out=None):
        if not (_whole_classes(xp, softmax, label, axis, ctx) and _fits(xp, softmax, out)):
            return numpy_kernel(xp, softmax, label, dloss, axis, ignore_index, ctx, out=out)
        n = softmax.shape[-1]
        scale = np.asarray(dloss, softmax.dtype).reshape(-1)  # per row, or one for all
        if scale.size != 1 and scale.size * n != softmax.size:
            scale = np.broadcast_to(dloss, softmax.shape[:-1] + (1,)).astype(softmax.dtype)
        if out is None:
            out = np.empty_like(softmax)
        _loops().cross_entropy_grad_rows(softmax.reshape(-1, n), label.reshape(-1),
                                         int(ignore_index), scale.reshape(-1),
                                         out.reshape(-1, n))
        return out
    return kernel


# -- batch_norm (training) with the channels last in memory --------------------------------

def _bn_rows(xp, x, data_format, *params) -> bool:
    """A training batch_norm call the loops take: float x (:func:`_floats`) of at least 2 dims
    whose channel axis is its last axis in memory (2-d, or a channels-last format), the
    per-channel arrays (None among them skipped) of x's dtype and contiguous."""
    return (x.ndim >= 2 and (x.ndim == 2 or data_format in ("NLC", "NHWC", "NDHWC"))
            and _floats(xp, x, *params))


def batch_norm(numpy_kernel: Kernel) -> Kernel:
    """``batch_norm(xp, x, running_mean, running_var, weight, bias, training, momentum, epsilon,
    data_format, ctx) -> (out, running_mean, running_var, mean, rstd)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, running_mean, running_var, weight, bias, training, momentum, epsilon,
               data_format, ctx):
        if not (training and _bn_rows(xp, x, data_format, running_mean, running_var, weight,
                                      bias)):
            return numpy_kernel(xp, x, running_mean, running_var, weight, bias, training,
                                momentum, epsilon, data_format, ctx)
        red = tuple(range(x.ndim - 1))
        count = math.prod(ctx.global_shape(0, x.shape)[a] for a in red)
        x2 = _rows(x, x.ndim - 1)
        loops = _loops()
        n = x2.shape[1]
        sums = np.empty((2, n), np.float64)
        loops.bn_moments(x2, sums)
        sums = ctx.allreduce(sums, "sum", 0, red)
        w, b = _params(x, weight, bias, n)
        mean, rstd = np.empty(n, x.dtype), np.empty(n, x.dtype)
        out = np.empty_like(x)
        loops.bn_forward(x2, sums, float(count), w, b, float(momentum), float(epsilon),
                         running_mean, running_var, mean, rstd, _rows(out, x.ndim - 1))
        return out, running_mean, running_var, mean, rstd
    return kernel


def batch_norm_grad(numpy_kernel: Kernel) -> Kernel:
    """``batch_norm_grad(xp, x, weight, saved_mean, saved_rstd, dout, use_global_stats,
    data_format, ctx) -> (dx, dweight, dbias)``."""
    @_compiled(numpy_kernel)
    def kernel(xp, x, weight, saved_mean, saved_rstd, dout, use_global_stats, data_format, ctx):
        if use_global_stats or dout.shape != x.shape or not _bn_rows(
                xp, x, data_format, weight, saved_mean, saved_rstd, dout):
            return numpy_kernel(xp, x, weight, saved_mean, saved_rstd, dout, use_global_stats,
                                data_format, ctx)
        red = tuple(range(x.ndim - 1))
        count = math.prod(ctx.global_shape(0, x.shape)[a] for a in red)
        x2, dout2 = _rows(x, x.ndim - 1), _rows(dout, x.ndim - 1)
        n = x2.shape[1]
        loops = _loops()
        sums = np.empty((2, n), x.dtype)
        loops.bn_grad_sums(x2, saved_mean, saved_rstd, dout2, sums)
        sums = ctx.allreduce(sums, "sum", 0, red)
        w, _ = _params(x, weight, None, n)
        dx = np.empty_like(x)
        loops.bn_grad_dx(x2, saved_mean, saved_rstd, w, dout2, sums, float(count),
                         _rows(dx, x.ndim - 1))
        return dx, sums[1], sums[0]
    return kernel


def attention_softmax(numpy_kernel: Kernel) -> Kernel:
    """``attention_softmax(xp, s, m, lsum) -> alpha`` (one key block of the online softmax,
    in place; see :mod:`.attention`)."""
    @_compiled(numpy_kernel)
    def kernel(xp, s, m, lsum):
        if _floats(xp, s, m, lsum):
            alpha = np.empty_like(m)
            _attention_loops().attention_softmax(_rows(s, s.ndim - 1), m.reshape(-1),
                                                 lsum.reshape(-1),
                                       alpha.reshape(-1))
            return alpha
        return numpy_kernel(xp, s, m, lsum)
    return kernel


def attention_grad_rows(numpy_kernel: Kernel) -> Kernel:
    """``attention_grad_rows(xp, p, dp, lse, delta)`` (one key block of the backward, in
    place; see :mod:`.attention`)."""
    @_compiled(numpy_kernel)
    def kernel(xp, p, dp, lse, delta):
        if _floats(xp, p, dp, lse, delta):
            _attention_loops().attention_grad_rows(_rows(p, p.ndim - 1), _rows(dp, dp.ndim - 1),
                                         lse.reshape(-1), delta.reshape(-1))
            return
        numpy_kernel(xp, p, dp, lse, delta)
    return kernel
