"""Compiled loops (numba) behind :mod:`disttensor.ops.fast`: softmax, layer_norm, relu and gelu
and their gradients, each a few passes over rows that stay in cache (or one elementwise pass);
Adam's update (one pass, in place); cross entropy's rows and gradient; batch_norm's per-channel
sums and normalization.

The loops take non-empty C-contiguous arrays of one dtype, float32 or float64: softmax and
layer_norm (normalized axes flattened into the last) ``[rows, n]`` views, relu, gelu and adam
flat ones. softmax, relu, gelu and their gradients write ``out``, or their last input when
``out`` is None (relu_ writes x, a gradient may overwrite dout); an ``out`` must not overlap the
inputs. Loops are single-threaded (ranks run one thread each) and compiled once per dtype and form
(``out`` given or None), cached on disk (``cache=True``).

Arithmetic stays in the array's dtype. ``exp`` is computed here (range reduction by ln 2, a
polynomial, the power of two built from its exponent bits; one fma adding 1.5 * 2**23 + 127
both rounds x / ln 2 to an integer and leaves that power's exponent bits in the sum) so that
loops calling it vectorize: libm's scalar ``expf`` is several times slower. Row maxima use
LLVM's ``maxnum``, which vectorizes; a NaN in a row still reaches every output of that row
through the sum.
Floating-point flags: reassociation (vectorized sums) and FMA contraction only, so NaN and
infinities keep numpy's meaning.
"""
from __future__ import annotations

import decimal
import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

_SUMS = {"reassoc", "contract", "nsz"}  # vectorized reductions; NaN/inf keep their meaning
_JIT = dict(cache=True, nogil=True, fastmath=_SUMS, error_model="numpy")  # x / 0: inf, no raise


# -- scalar helpers --------------------------------------------------------------------------

@intrinsic
def _maxnum(typingctx, a, b):
    """``max(a, b)`` ignoring a NaN operand (LLVM ``maxnum``: vectorizes as a reduction)."""
    def codegen(context, builder, sig, args):
        t = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maxnum", [t], ir.FunctionType(t, [t, t]))
        return builder.call(fn, args)
    return a(a, b), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM ``fma``: vectorizes; ``fma(a, a, -a * a)`` is the
    rounding error of ``a * a`` exactly)."""
    def codegen(context, builder, sig, args):
        t = args[0].type
        fn = builder.module.declare_intrinsic("llvm.fma", [t], ir.FunctionType(t, [t, t, t]))
        return builder.call(fn, args)
    return a(a, b, c), codegen


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float whose bit pattern is ``bits`` (int32 -> float32, int64 -> float64)."""
    out = {types.int32: types.float32, types.int64: types.float64}.get(bits)
    if out is None:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(out))
    return out(bits), codegen


def _ln2_split(dtype, low_bits: int) -> tuple:
    """ln 2 as hi + lo with hi's last ``low_bits`` mantissa bits zero, so ``k * hi`` is exact
    for the exponents k that occur; lo from ln 2 to 40 digits (float64's ln 2 is off by 2e-17,
    which k = 1000 would make 2e-14)."""
    ints = np.int32 if dtype == np.float32 else np.int64
    hi = np.array(math.log(2.0), dtype)
    hi = (hi.view(ints) & ~ints((1 << low_bits) - 1)).view(dtype)
    ln2 = decimal.Context(prec=40).ln(2)
    return dtype(hi), dtype(float(ln2 - decimal.Decimal(float(hi))))


class _ExpConsts:
    """Per-dtype constants of :func:`_exp`: the input range whose result is a normal number,
    ln 2 split in two, and the polynomial for exp(r) on ``|r| <= ln2 / 2``: ``coef`` (constant
    first), else Taylor's of ``degree``."""

    def __init__(self, dtype, low_bits, degree=0, coef=()):
        info = np.finfo(dtype)
        self.hi = dtype(math.log(float(info.max)))
        self.lo = dtype(math.log(float(info.tiny)) + math.log(2.0))  # 2**(k-1) stays normal
        self.log2e = dtype(1.0 / math.log(2.0))
        self.ln2_hi, self.ln2_lo = _ln2_split(dtype, low_bits)
        self.coef = tuple(dtype(c) for c in coef) or tuple(
            dtype(1.0 / math.factorial(i)) for i in range(degree + 1))


# float32: degree 6, relative-minimax (Lawson-weighted least squares) on |r| <= ln2 / 2 with the
# coefficients rounded to float32 one at a time, the rest refitted: 2e-8 relative (Taylor's
# degree 7 costs one more FMA); float64: Taylor's degree 13, 4e-18
_E32 = _ExpConsts(np.float32, 12, coef=(1.0, 1.0, 0.4999999403953552, 0.16666431725025177,
                                        0.04166800156235695, 0.008374158293008804,
                                        0.0013843649066984653))
_E64 = _ExpConsts(np.float64, 32, 13)
# module-level names numba freezes as typed constants
_HI32, _LO32, _L2E32, _LN2H32, _LN2L32 = _E32.hi, _E32.lo, _E32.log2e, _E32.ln2_hi, _E32.ln2_lo
_HI64, _LO64, _L2E64, _LN2H64, _LN2L64 = _E64.hi, _E64.lo, _E64.log2e, _E64.ln2_hi, _E64.ln2_lo
_P32 = _E32.coef
_P64 = _E64.coef


# y + _ROUND32 (|y| < 2**22) is y rounded to an integer j, held in the float's low mantissa
# bits: one fma both rounds and, with 127 added, carries j's exponent bits for 2**j
_ROUND32 = np.float32(1.5 * 2**23)
_ROUND32_127, _ROUND32_126 = _ROUND32 + np.float32(127), _ROUND32 + np.float32(126)


@intrinsic
def _pow2_rounded32(typingctx, s):
    """``2**j`` for the float32 ``s = _ROUND32 + 127 + j`` (integral j in [-126, 127]): the
    low bits of s, j + 127, shifted into the exponent field; j = -127 gives 0.0 (all bits
    zero), which exact GELU's clamped tail relies on."""
    if s != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.bitcast(args[0], i32), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(s), codegen


@intrinsic
def _sub_strict(typingctx, a, b):
    """``a - b`` without fast-math flags: LLVM neither folds it back into the fma that made a
    (``fma(x, y, b) - b`` is not ``x * y`` in rounding) nor distributes a later product over it
    (``(a - b) * ln2_hi`` is not ``a * ln2_hi - b * ln2_hi``)."""
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return a(a, b), codegen


@njit(inline="always", cache=True)
def _exp32_reduced(s, r):
    """``2**j * exp(r)`` in float32 for ``s = _ROUND32 + 127 + j`` (see _pow2_rounded32) and
    ``|r| <= ln2 / 2``."""
    p = _P32[6]
    for i in range(5, -1, -1):  # constant trip count: unrolled
        p = p * r + _P32[i]
    return p * _pow2_rounded32(s)


@njit(inline="always", cache=True)
def _exp32(x):
    xc = x if x < _HI32 else _HI32
    xc = xc if xc > _LO32 else _LO32
    s = _fma(xc, _L2E32, _ROUND32_126)  # k = round(x / ln2), as (k - 1) + 127 + _ROUND32
    k = _sub_strict(s, _ROUND32_126)
    # 2**(k-1) * 2: k reaches 128 at the top of the range
    r = _fma(k, -_LN2L32, _fma(k, -_LN2H32, xc))  # reassociation cannot merge ln 2's halves
    res = _exp32_reduced(s, r) * np.float32(2)
    res = np.float32(np.inf) if x > _HI32 else res
    res = np.float32(0) if x < _LO32 else res
    return x if x != x else res  # NaN


@njit(inline="always", cache=True)
def _exp64(x):
    xc = x if x < _HI64 else _HI64
    xc = xc if xc > _LO64 else _LO64
    k = np.floor(xc * _L2E64 + 0.5)
    r = _fma(k, -_LN2L64, _fma(k, -_LN2H64, xc))  # reassociation cannot merge ln 2's halves
    p = _P64[13]
    for i in range(12, -1, -1):  # constant trip count: unrolled
        p = p * r + _P64[i]
    res = p * _float_from_bits((np.int64(k) + 1022) << 52) * 2.0
    res = np.inf if x > _HI64 else res
    res = 0.0 if x < _LO64 else res
    return x if x != x else res  # NaN


def _exp(x):
    """``exp(x)`` in x's dtype within 2 units in the last place (results below twice the
    smallest normal number are 0); vectorizes in a loop."""
    return math.exp(x)


@overload(_exp)
def _exp_typed(x):
    if x == types.float32:
        return lambda x: _exp32(x)
    if x == types.float64:
        return lambda x: _exp64(x)
    return None


# -- softmax, relu, gelu: where the result goes ------------------------------------------

def _into(src, out):
    """The array a loop writes: ``out``, or ``src`` itself when ``out`` is None (in place: a
    separate compilation, in which the loop reads and writes one array and still vectorizes;
    with two names for one buffer LLVM's overlap check would choose its scalar loop)."""


@overload(_into)
def _into_typed(src, out):
    if isinstance(out, types.NoneType):
        return lambda src, out: src
    return lambda src, out: out


# -- softmax --------------------------------------------------------------------------------

@njit(**_JIT)
def softmax(x, out):
    """``exp(x - max) / sum(exp(x - max))`` per row: each pass over all rows before the next
    (the rows' reductions are independent chains the CPU overlaps; one row after the other
    costs 1.4x at [64, 64]). Sums never share a loop with a write, whose overlap check could
    pick a scalar loop that adds in another order: results do not depend on ``out``."""
    dst = _into(x, out)
    rows, n = x.shape
    m = np.empty(rows, x.dtype)  # row maxima, then reciprocal row sums
    for i in range(rows):
        mi = x[i, 0]
        for j in range(n):  # from 0: a trip count the vectorized loop takes at n = 64
            mi = _maxnum(mi, x[i, j])
        m[i] = mi
    for i in range(rows):
        mi = m[i]
        for j in range(n):
            dst[i, j] = _exp(x[i, j] - mi)
        s = x.dtype.type(0.0)
        for j in range(n):  # a sum that reads only: the same order whether dst is x or not
            s += dst[i, j]
        m[i] = x.dtype.type(1.0) / s
    for i in range(rows):
        inv = m[i]
        for j in range(n):
            dst[i, j] *= inv


@njit(**_JIT)
def softmax_grad(y, g, out):
    """``y * (g - sum(g * y))`` per row."""
    dst = _into(g, out)
    rows, n = y.shape
    for i in range(rows):
        d = y.dtype.type(0.0)
        for j in range(n):
            d += g[i, j] * y[i, j]
        for j in range(n):
            dst[i, j] = y[i, j] * (g[i, j] - d)


# -- layer_norm -----------------------------------------------------------------------------

@njit(**_JIT)
def layer_norm(x, w, b, eps, out, mean, rstd):
    """Per row of ``[rows, n]``: mean, ``rstd = 1 / sqrt(var + eps)`` (biased variance, two
    passes over the cached row), ``out = (x - mean) * rstd * w + b``."""
    rows, n = x.shape
    one = x.dtype.type(1.0)
    inv_n = one / x.dtype.type(n)  # x.dtype / int would be float64
    e = x.dtype.type(eps)
    for i in range(rows):
        s = x.dtype.type(0.0)
        for j in range(n):
            s += x[i, j]
        mu = s * inv_n
        v = x.dtype.type(0.0)
        for j in range(n):
            c = x[i, j] - mu
            v += c * c
        r = one / math.sqrt(v * inv_n + e)
        mean[i] = mu
        rstd[i] = r
        for j in range(n):
            out[i, j] = (x[i, j] - mu) * r * w[j] + b[j]


@njit(**_JIT)
def layer_norm_grad(x, w, mean, rstd, dout, dx, dw, db):
    """With xhat = (x - mean) * rstd and dxhat = dout * w per row:
    ``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``; ``dw``/``db`` (zeroed
    here) get the column sums of ``dout * xhat`` and ``dout``."""
    rows, n = x.shape
    inv_n = x.dtype.type(1.0) / x.dtype.type(n)
    dw[:] = 0
    db[:] = 0
    for i in range(rows):
        mu, r = mean[i], rstd[i]
        a = x.dtype.type(0.0)
        c = x.dtype.type(0.0)
        for j in range(n):
            dxh = dout[i, j] * w[j]
            a += dxh
            c += dxh * ((x[i, j] - mu) * r)
        a *= inv_n
        c *= inv_n
        for j in range(n):
            xh = (x[i, j] - mu) * r
            dxi = dout[i, j]
            dx[i, j] = r * (dxi * w[j] - a - xh * c)
            dw[j] += dxi * xh
            db[j] += dxi


# -- relu, gelu (flat) ----------------------------------------------------------------------

@njit(**_JIT)
def relu(x, out):
    """x where not ``x < 0``, else 0 (NaN stays NaN)."""
    dst = _into(x, out)
    zero = x.dtype.type(0.0)
    for i in range(x.size):
        v = x[i]
        dst[i] = zero if v < zero else v


@njit(**_JIT)
def relu_grad(y, g, out):
    """``g * (y > 0)``."""
    dst = _into(g, out)
    zero = y.dtype.type(0.0)
    one = y.dtype.type(1.0)
    for i in range(y.size):
        dst[i] = g[i] * (one if y[i] > zero else zero)


# Exact GELU in float32. With a = |x|, Q(a) = Phi(-a) = exp(-a^2 / 2) * M(a), where M (a Mills
# ratio, 0.5 at 0, about 1 / (a sqrt(2 pi)) far out) is smooth: a rational P4(a) / R5(a), fitted
# relative-minimax (Lawson-weighted least squares) to 0.5 * erfc(a / sqrt 2) * exp(a^2 / 2) on
# [0, 13.15] with the coefficients rounded to float32 one at a time, the rest refitted: 2e-8
# relative before float32 evaluation. Then Phi(x) = Q(a) for x < 0 and 1 - Q(a) otherwise: no
# 1 + erf cancellation, so both tails keep float32's relative precision; the exp is shared with
# the gradient's pdf. Error against math.erfc (tests/core/test_fast_kernels): <= 4 float32 eps
# relative for x >= -13 (below, x * Phi(x) < 2e-37 and loses precision to underflow). The loops
# work with b = -a (its powers' coefficients signed to match) and with 2r, twice exp's reduced
# argument (the polynomial's coefficients scaled to match): both save an operation per element.
_MILLS_P = tuple(np.float32(c) for c in (0.5, 0.4353259205818176, 0.18104207515716553,
                                         0.039895497262477875, 0.004007115960121155))
_MILLS_R = tuple(np.float32(c) for c in (1.0, 1.6685367822647095, 1.1933798789978027,
                                         0.46368175745010376, 0.1000107079744339,
                                         0.010044203139841557))
_MILLS_P_NEG = tuple(np.float32(c * (-1) ** i) for i, c in enumerate(_MILLS_P))
_MILLS_R_NEG = tuple(np.float32(c * (-1) ** i) for i, c in enumerate(_MILLS_R))
# |x| is clamped at the a where a^2 / 2 / ln2 = 127: there, and from 13.24 (where it rounds to
# 127), the power of two 2**-127 that _pow2_rounded32 builds has all bits zero, so Q = 0 for
# the clamped tail (|x| beyond 13.24: Phi(-a) < 1e-39) and for +-inf
_B_MIN32 = np.float32(-math.sqrt(2.0 * math.log(2.0) * 127.0))
_HALF_L2E32 = np.float32(-0.5 / math.log(2.0))
_LN2H32_X2, _LN2L32_X2 = np.float32(2) * _LN2H32, np.float32(2) * _LN2L32
_P32_HALF = tuple(np.float32(c / 2.0 ** i) for i, c in enumerate(_P32))  # exp(r) in 2r
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@njit(inline="always", cache=True)
def _tail32(v):
    """``(Phi(-|v|), exp(-v^2 / 2), b)`` for float32 v, with b = -min(|v|, 13.27) (the normal
    CDF's tail, sqrt(2 pi) times its pdf), branch-free. A NaN v gives b = -13.27 and a tail of
    0 (callers carry v's NaN). v^2 is split exactly as hi + lo (FMA), so the exponent
    -v^2 / 2 carries no rounding error into the far tail."""
    b0 = -abs(v)
    b = b0 if b0 > _B_MIN32 else _B_MIN32
    hi = b * b
    lo = _fma(b, b, -hi)
    s = _fma(hi, _HALF_L2E32, _ROUND32_127)  # k = round(-v^2 / 2 / ln2), as k + 127 + _ROUND32
    k = _sub_strict(s, _ROUND32_127)
    r2 = _fma(k, -_LN2L32_X2, _fma(k, -_LN2H32_X2, -hi)) - lo  # 2 (-v^2 / 2 - k ln2)
    e = _P32_HALF[6]
    for i in range(5, -1, -1):  # constant trip count: unrolled
        e = e * r2 + _P32_HALF[i]
    e = e * _pow2_rounded32(s)
    p, c = _MILLS_P_NEG, _MILLS_R_NEG  # Estrin, with hi = b^2: short dependency chains
    num = _fma(hi, _fma(hi, p[4], _fma(b, p[3], p[2])), _fma(b, p[1], p[0]))
    den = _fma(hi, _fma(hi, _fma(b, c[5], c[4]), _fma(b, c[3], c[2])), _fma(b, c[1], c[0]))
    return e * num / den, e, b


@njit(**_JIT)
def gelu_erf(x, out):
    """``x * Phi(x)`` (exact GELU), float32 only; x = -inf gives NaN (0 * -inf), as numpy's
    kernel does. Computed as ``max(x, -0) + min(b, x) * Q``: ``x * Q`` for x < 0 and
    ``x - |x| * Q`` otherwise, signed zeros, infinities and NaN as ``x * Phi(x)`` gives them."""
    dst = _into(x, out)
    neg0 = np.float32(-0.0)
    for i in range(x.size):
        v = x[i]
        q, _, b = _tail32(v)
        dst[i] = _fma(b if b < v else v, q, neg0 if neg0 > v else v)


@njit(**_JIT)
def gelu_erf_grad(x, g, out):
    """``g * (Phi(x) + x * exp(-x^2 / 2) / sqrt(2 pi))``, float32 only."""
    dst = _into(g, out)
    c = np.float32(_INV_SQRT_2PI)
    for i in range(x.size):
        v = x[i]
        q, e, _ = _tail32(v)
        phi = q if v < np.float32(0.0) else np.float32(1.0) - q
        dst[i] = g[i] * _fma(v * c, e, phi)


_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715


@njit(**_JIT)
def gelu_tanh(x, out):
    """``x * sigmoid(2 * C * (x + A x^3))``, which equals ``0.5 x (1 + tanh(C (x + A x^3)))``."""
    one = x.dtype.type(1.0)
    c2 = x.dtype.type(-2.0 * _TANH_C)
    ca2 = x.dtype.type(-2.0 * _TANH_C * _TANH_A)
    dst = _into(x, out)
    for i in range(x.size):
        v = x[i]
        dst[i] = v / (one + _exp(v * (c2 + ca2 * v * v)))


@njit(**_JIT)
def gelu_tanh_grad(x, g, out):
    """``g * (s + 2 x s (1 - s) C (1 + 3 A x^2))`` with s = sigmoid(2 C (x + A x^3))."""
    one = x.dtype.type(1.0)
    c2 = x.dtype.type(-2.0 * _TANH_C)
    ca2 = x.dtype.type(-2.0 * _TANH_C * _TANH_A)
    k = x.dtype.type(2.0 * _TANH_C)
    k3 = x.dtype.type(2.0 * _TANH_C * 3.0 * _TANH_A)
    dst = _into(g, out)
    for i in range(x.size):
        v = x[i]
        s = one / (one + _exp(v * (c2 + ca2 * v * v)))
        dst[i] = g[i] * (s + v * s * (one - s) * (k + k3 * v * v))


# -- optimizer updates ------------------------------------------------------------------------

@njit(**_JIT)
def adam(p, g, m, v, beta1, beta2, eps, l2, decay, step):
    """Adam(W) in place over flat arrays, one pass: ``gi = g + l2 * p``, ``p *= decay``,
    ``m = b1*m + (1-b1)*gi``, ``v = b2*v + (1-b2)*gi*gi``, ``p -= step * m / (sqrt(v) + eps)``;
    the scalars in p's dtype, as numpy's kernel takes them."""
    t = p.dtype.type
    b1, b2, c1, c2 = t(beta1), t(beta2), t(1.0 - beta1), t(1.0 - beta2)
    e, w, d, s = t(eps), t(l2), t(decay), t(step)
    for i in range(p.size):
        pi = p[i]
        gi = g[i] + w * pi if l2 != 0.0 else g[i]
        mi = b1 * m[i] + c1 * gi
        vi = b2 * v[i] + c2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        p[i] = pi * d - s * (mi / (math.sqrt(vi) + e))


# -- cross entropy (hard labels, whole class axis) ------------------------------------------

@njit(**_JIT)
def cross_entropy_rows(x, label, ignore, sm, loss, stats):
    """Per row of ``[rows, n]`` logits with ``label`` [rows]: ``sm`` the softmax, ``loss``
    ``log(sum(exp(x - max))) + max - x[label]`` (0 where the label is ``ignore`` or outside
    [0, n)); ``stats`` = [sum of loss (float64), rows not ignored, of those out of range]."""
    rows, n = x.shape
    total = 0.0
    n_valid = 0
    n_bad = 0
    for i in range(rows):
        mi = x[i, 0]
        for j in range(n):
            mi = _maxnum(mi, x[i, j])
        for j in range(n):
            sm[i, j] = _exp(x[i, j] - mi)
        s = x.dtype.type(0.0)
        for j in range(n):
            s += sm[i, j]
        inv = x.dtype.type(1.0) / s
        for j in range(n):
            sm[i, j] *= inv
        lab = label[i]
        li = x.dtype.type(0.0)
        if lab != ignore:
            n_valid += 1
            if 0 <= lab < n:
                li = np.log(s) + mi - x[i, lab]
            else:
                n_bad += 1
        loss[i] = li
        total += li
    stats[0] = total
    stats[1] = n_valid
    stats[2] = n_bad


@njit(**_JIT)
def cross_entropy_grad_rows(sm, label, ignore, scale, out):
    """``out = (sm - onehot(label)) * scale[row]`` per row of ``[rows, n]`` (``scale`` of one
    entry: the same for every row), 0 on rows labelled ``ignore``; ``out`` may be ``sm``."""
    rows, n = sm.shape
    one = scale.shape[0] == 1
    for i in range(rows):
        lab = label[i]
        k = sm.dtype.type(0.0) if lab == ignore else scale[0 if one else i]
        for j in range(n):
            out[i, j] = sm[i, j] * k
        if lab != ignore and 0 <= lab < n:
            out[i, lab] -= k


# -- batch_norm with the channels on the last axis of [rows, C] (x 2-d, or channels last) -----

@njit(**_JIT)
def bn_moments(x, sums):
    """Per channel of ``[rows, C]`` (rows > 0), in float64: ``sums[0]`` the sum of x,
    ``sums[1]`` the sum of squares, as the sum of squares about the rounded channel mean c plus
    ``c * (2 * sum - rows * c)`` (what ``norm.batch_moments`` all-reduces)."""
    rows, n = x.shape
    c = np.empty(n, x.dtype)
    sums[:, :] = 0.0
    for i in range(rows):
        for j in range(n):
            sums[0, j] += x[i, j]
    for j in range(n):
        c[j] = sums[0, j] / rows
    for i in range(rows):
        for j in range(n):
            d = x[i, j] - c[j]
            sums[1, j] += d * d
    for j in range(n):
        cj = np.float64(c[j])
        sums[1, j] += cj * (2.0 * sums[0, j] - rows * cj)


@njit(**_JIT)
def bn_forward(x, sums, count, w, b, momentum, eps, run_mean, run_var, mean, rstd, out):
    """From the batch's all-reduced ``sums`` (:func:`bn_moments`) over ``count`` elements per
    channel: ``mean``, ``rstd = 1 / sqrt(var + eps)`` (biased var, >= 0), the running statistics
    updated, ``out = (x - mean) * rstd * w + b``."""
    rows, n = x.shape
    scale = np.empty(n, x.dtype)
    for j in range(n):
        m = sums[0, j] / count
        mj = x.dtype.type(m)
        vj = x.dtype.type(max(sums[1, j] / count - m * m, 0.0))
        mean[j] = mj
        run_mean[j] = momentum * run_mean[j] + (1.0 - momentum) * mj
        run_var[j] = momentum * run_var[j] + (1.0 - momentum) * vj
        rstd[j] = x.dtype.type(1.0) / np.sqrt(vj + x.dtype.type(eps))
        scale[j] = rstd[j] * w[j]
    for i in range(rows):
        for j in range(n):
            out[i, j] = (x[i, j] - mean[j]) * scale[j] + b[j]


@njit(**_JIT)
def bn_grad_sums(x, mean, rstd, dout, sums):
    """Per channel: ``sums[0] = sum(dout)``, ``sums[1] = sum(dout * xhat)``, xhat = (x - mean)
    * rstd."""
    rows, n = x.shape
    sums[:, :] = 0.0
    for i in range(rows):
        for j in range(n):
            sums[0, j] += dout[i, j]
            sums[1, j] += dout[i, j] * ((x[i, j] - mean[j]) * rstd[j])


@njit(**_JIT)
def bn_grad_dx(x, mean, rstd, w, dout, sums, count, dx):
    """``dx = k * (dout - (sum_dy + xhat * sum_dy_xhat) / count)``, k = w * rstd."""
    rows, n = x.shape
    k = np.empty(n, x.dtype)
    a = np.empty(n, x.dtype)
    c = np.empty(n, x.dtype)
    for j in range(n):
        k[j] = w[j] * rstd[j]
        a[j] = k[j] * sums[0, j] / count
        c[j] = k[j] * sums[1, j] / count
    for i in range(rows):
        for j in range(n):
            dx[i, j] = dout[i, j] * k[j] - (x[i, j] - mean[j]) * rstd[j] * c[j] - a[j]
