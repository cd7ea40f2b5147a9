"""Elementwise ops (numpy broadcasting): arithmetic, comparisons, unary math, scale, cast, clip,
where, full_like. Rule: ``elementwise``. Kernels built on ufuncs accept ``out=`` (the inplace
variants write straight into their target) and may reuse a dying input's buffer."""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from spmd_rules import broadcast_notations

from ..dispatch import apply, apply_inplace
from ..dtype import bfloat16, is_floating, promote_floating, to_np_dtype
from ..schema import (
    OPS,
    attr_dtype,
    fixed_dtype,
    paddle_promote,
    promoting,
    public,
    register,
    same_dtype,
    ufunc_dtype,
)
from ..tensor import Tensor
from . import fast, gpu_fused
from .common import as_tensor, grad_op_backward, sum_to_shape

# -- binary arithmetic -------------------------------------------------------------------------


def _add_bwd(node, g):
    sx, sy = node.in_shapes
    return sum_to_shape(g, sx), sum_to_shape(g, sy)


def _sub_bwd(node, g):
    sx, sy = node.in_shapes
    return sum_to_shape(g, sx), sum_to_shape(neg(g), sy)


def _mul_bwd(node, g):
    sx, sy = node.in_shapes
    return (sum_to_shape(multiply(g, node.saved_tensor(1)), sx) if node.needs_grad(0) else None,
            sum_to_shape(multiply(g, node.saved_tensor(0)), sy) if node.needs_grad(1) else None)


def _div_bwd(node, g):
    y = node.saved_tensor(1)
    sx, sy = node.in_shapes
    gx = divide(g, y)
    gy = None
    if node.needs_grad(1):  # only then is x read (divide_ may have overwritten it)
        gy = sum_to_shape(neg(multiply(gx, divide(node.saved_tensor(0), y))), sy)
    return (sum_to_shape(gx, sx) if node.needs_grad(0) else None), gy


def _pow_bwd(node, g):
    x, y = node.saved_tensor(0), node.saved_tensor(1)
    out = node.saved_tensor(2)
    sx, sy = node.in_shapes
    gx = gy = None
    if node.needs_grad(0):
        gx = sum_to_shape(multiply(g, multiply(y, pow(x, subtract(y, as_tensor(1.0, y))))), sx)
    if node.needs_grad(1):
        gy = sum_to_shape(multiply(g, multiply(out, log(x))), sy)
    return gx, gy


def _minmax_bwd(node, g):
    x, y = node.saved_tensor(0), node.saved_tensor(1)
    sx, sy = node.in_shapes
    pick_x = minmax_mask(x, y, pick=node.op.name)
    return (sum_to_shape(multiply(g, pick_x), sx),
            sum_to_shape(multiply(g, subtract(as_tensor(1.0, pick_x), pick_x)), sy))


def _ufunc_kernel(ufunc):
    """``ufunc(x, y)``, into ``out`` when given."""
    def kernel(xp, x, y, out=None):
        return ufunc(x, y) if out is None else ufunc(x, y, out=out)
    return kernel


_INPLACE = ((0, 0),)
_ARITH = dict(rule="elementwise", inplace=_INPLACE, accepts_out=True, reuse=(0, 1),
              recompute=True, dtype=paddle_promote)
register("add", _ufunc_kernel(np.add), backward=_add_bwd, no_need_buffer=(0, 1),
         rule_attrs={"linear": "add"}, **_ARITH)
register("subtract", _ufunc_kernel(np.subtract), backward=_sub_bwd, no_need_buffer=(0, 1),
         rule_attrs={"linear": "add"}, **_ARITH)
register("multiply", _ufunc_kernel(np.multiply), backward=_mul_bwd, save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0, 1)}, **_ARITH)
register("divide", _ufunc_kernel(np.true_divide), backward=_div_bwd, save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0,)},
         **{**_ARITH, "dtype": promoting(ufunc_dtype(np.true_divide))})
register("pow", _ufunc_kernel(np.power), backward=_pow_bwd, rule="elementwise",
         save_inputs=(0, 1), save_outputs=(0,), accepts_out=True, dtype=paddle_promote)
register("maximum", _ufunc_kernel(np.maximum), backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1), reuse=(0, 1), accepts_out=True, dtype=paddle_promote,
         rule_attrs={"linear": "max"})
register("minimum", _ufunc_kernel(np.minimum), backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1), reuse=(0, 1), accepts_out=True, dtype=paddle_promote,
         rule_attrs={"linear": "min"})


def _minmax_mask_kernel(xp, x, y, pick, out=None):
    """1 where ``maximum``/``minimum`` picked x (x wins ties), else 0; in x's dtype."""
    m = (x >= y) if pick == "maximum" else (x <= y)
    if out is not None:
        xp.copyto(out, m, casting="unsafe")
        return out
    return xp.broadcast_to(m, np.broadcast_shapes(x.shape, y.shape)).astype(x.dtype)


register("minmax_mask", _minmax_mask_kernel, rule="elementwise", dtype=same_dtype(0),
         accepts_out=True)

# -- comparisons (no grad) ---------------------------------------------------------------------

_COMPARE = {"equal": "equal", "not_equal": "not_equal", "less_than": "less",
            "less_equal": "less_equal", "greater_than": "greater",
            "greater_equal": "greater_equal", "logical_and": "logical_and",
            "logical_or": "logical_or"}
for _name, _fn in _COMPARE.items():
    register(_name, _ufunc_kernel(getattr(np, _fn)), rule="elementwise",
             dtype=fixed_dtype(np.bool_), accepts_out=True)
register("logical_not", lambda xp, x, out=None: xp.logical_not(x, out=out), rule="elementwise",
         dtype=fixed_dtype(np.bool_), accepts_out=True)

# -- unary math ----------------------------------------------------------------------------------


def _unary(name: str, kernel, grad_kernel=None, save: str = "out", linear: bool = False,
           inplace: bool = False, dtype=None, backward=None):
    """Register ``name`` and, when it has a gradient, ``name_grad(saved, dout)`` (elementwise)."""
    if grad_kernel is not None:
        register(f"{name}_grad", grad_kernel, rule="elementwise", reuse=(1,), accepts_out=True)
        backward = grad_op_backward(f"{name}_grad")
    register(name, kernel, rule="elementwise", backward=backward,
             save_inputs=(0,) if save == "x" and grad_kernel else (),
             save_outputs=(0,) if save == "out" and grad_kernel else (),
             inplace=_INPLACE if inplace else (), accepts_out=True, reuse=(0,),
             recompute=True, dtype=dtype or same_dtype(0),
             rule_attrs={"linear": "unary"} if linear else {})


def _ufunc1(ufunc):
    """``ufunc(x)``, into ``out`` when given."""
    def kernel(xp, x, out=None):
        return ufunc(x) if out is None else ufunc(x, out=out)
    return kernel


def _erf(xp, x, out=None):
    """``erf(x)``, into ``out`` when given (scipy's ufunc; math.erf without scipy)."""
    if xp is np:
        try:
            from scipy.special import erf
        except ImportError:
            res = np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy()
            if out is None:
                return res
            out[...] = res
            return out
    else:
        from cupyx.scipy.special import erf
    return erf(x) if out is None else erf(x, out=out)


_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_C = math.sqrt(2.0 / math.pi)  # gelu's tanh approximation: tanh(C * (x + A * x**3))
_TANH_A = 0.044715


def _gelu_cdf(xp, x):
    """``0.5 * (1 + erf(x / sqrt(2)))`` in a fresh array (in-place passes)."""
    t = xp.multiply(x, 1.0 / _SQRT_2, out=xp.empty_like(x))
    _erf(xp, t, out=t)
    t += 1.0
    t *= 0.5
    return t


def _gelu_tanh(xp, x):
    """``tanh(C * x * (1 + A * x * x))`` in a fresh array: no power, no temporary besides it."""
    t = xp.multiply(x, x, out=xp.empty_like(x))
    t *= _TANH_C * _TANH_A
    t += _TANH_C
    t *= x
    return xp.tanh(t, out=t)


def _gelu(xp, x, approximate=False, out=None):
    """``x * cdf(x)``: the exact ``0.5 * (1 + erf(x / sqrt 2))`` or the tanh approximation
    ``0.5 * (1 + tanh(C * (x + A * x**3)))``; ``out`` may be x itself."""
    if approximate:
        t = _gelu_tanh(xp, x)
        t += 1.0
        t *= 0.5
    else:
        t = _gelu_cdf(xp, x)
    if out is None:
        t *= x
        return t
    return xp.multiply(t, x, out=out)


def _gelu_grad(xp, x, g, approximate=False, out=None):
    """``g * d gelu / dx``; ``out`` may be g itself. Exact: ``cdf(x) + x * pdf(x)``. Tanh:
    ``0.5 * (1 + t) + 0.5 * x * (1 - t * t) * C * (1 + 3 * A * x * x)`` with t the tanh (two
    temporaries the size of x)."""
    if approximate:  # (1 + t) * (q * (1 - t) + 0.5) with q = 0.5 * x * C * (1 + 3 * A * x * x)
        t = _gelu_tanh(xp, x)
        d = xp.multiply(x, x, out=xp.empty_like(x))
        d *= 0.5 * _TANH_C * 3.0 * _TANH_A
        d += 0.5 * _TANH_C
        d *= x
        xp.subtract(1.0, t, out=t)
        d *= t
        d += 0.5
        xp.subtract(2.0, t, out=t)
        d *= t
    else:
        d = xp.multiply(x, x, out=xp.empty_like(x))
        d *= -0.5
        xp.exp(d, out=d)
        d *= _INV_SQRT_2PI
        d *= x
        d += _gelu_cdf(xp, x)
    if out is None:
        d *= g
        return d
    return xp.multiply(g, d, out=out)


def _sigmoid(xp, x, out=None):
    """``0.5 * (tanh(0.5 * x) + 1)`` (no overflow); ``out`` may be x itself."""
    r = xp.multiply(x, 0.5, out=xp.empty_like(x) if out is None else out)
    xp.tanh(r, out=r)
    r += 1.0
    r *= 0.5
    return r


def _relu(xp, x, out=None):
    if out is None:
        return xp.maximum(x, 0).astype(x.dtype, copy=False)
    return xp.maximum(x, 0, out=out)


def _silu(xp, x, out=None):
    """``x * sigmoid(x)``."""
    s = _sigmoid(xp, x)
    return xp.multiply(x, s, out=s if out is None else out)


def _silu_grad(xp, x, g, out=None):
    """``g * s * (1 + x * (1 - s))`` with s = sigmoid(x)."""
    s = _sigmoid(xp, x)
    d = xp.subtract(1.0, s, out=xp.empty_like(s))
    d *= x
    d += 1.0
    d *= s
    return xp.multiply(g, d, out=d if out is None else out)


def _times_g(derivative):
    """The grad kernel ``g * derivative(xp, saved)``, into ``out`` when given (which may be g:
    the derivative is a fresh array)."""
    def kernel(xp, saved, g, out=None):
        d = derivative(xp, saved)
        return xp.multiply(g, d, out=out)
    return kernel


def _tanh_derivative(xp, out):
    d = xp.multiply(out, out, out=xp.empty_like(out))
    return xp.subtract(1.0, d, out=d)


def _sigmoid_derivative(xp, out):
    d = xp.subtract(1.0, out, out=xp.empty_like(out))
    d *= out
    return d


def _rsqrt(xp, x, out=None):
    r = xp.sqrt(x, out=xp.empty_like(x) if out is None else out)
    return xp.divide(1.0, r, out=r)


def _float_dtype(dtypes, attrs) -> tuple:
    """Floating inputs keep their dtype; integer and bool inputs compute in float64."""
    d = np.dtype(dtypes[0])
    return (d if is_floating(d) else np.dtype(np.float64),)


def _floating(kernel):
    """``kernel`` on x converted to float64 when x is not floating (see :func:`_float_dtype`)."""
    @functools.wraps(kernel)
    def k(xp, x, *rest, **attrs):
        if not is_floating(x.dtype):
            x = x.astype(np.float64)
        return kernel(xp, x, *rest, **attrs)
    return k


_FLOAT = _float_dtype
_unary("neg", _ufunc1(np.negative), None, linear=True, backward=lambda node, g: neg(g))
_unary("abs", _ufunc1(np.absolute), _times_g(lambda xp, x: xp.sign(x)), save="x")
_unary("exp", _floating(_ufunc1(np.exp)), _times_g(lambda xp, out: out), inplace=True,
       dtype=_FLOAT)
_unary("log", _floating(_ufunc1(np.log)), lambda xp, x, g, out=None: xp.divide(g, x, out=out),
       save="x", dtype=_FLOAT)
_unary("sqrt", _floating(_ufunc1(np.sqrt)), _times_g(lambda xp, out: xp.divide(0.5, out)),
       dtype=_FLOAT)
_unary("rsqrt", _floating(_rsqrt), _times_g(lambda xp, out: -0.5 * out * out * out),
       dtype=_FLOAT)
_unary("tanh", _floating(_ufunc1(np.tanh)), _times_g(_tanh_derivative), dtype=_FLOAT)
_unary("sigmoid", _floating(_sigmoid), _times_g(_sigmoid_derivative), dtype=_FLOAT)
_unary("relu", fast.relu(_relu), fast.relu_grad(_times_g(lambda xp, out: out > 0)),
       inplace=True)
_unary("silu", _floating(_silu), _silu_grad, save="x", dtype=_FLOAT)
register("gelu_grad", fast.gelu_grad(gpu_fused.gelu_grad(_gelu_grad)), rule="elementwise",
         reuse=(1,), accepts_out=True)
register("gelu", _floating(fast.gelu(gpu_fused.gelu(_gelu))),
         backward=grad_op_backward("gelu_grad"), rule="elementwise", save_inputs=(0,),
         reuse=(0,), dtype=_FLOAT, accepts_out=True, recompute=True)


# -- scale, cast, clip, where ------------------------------------------------------------------

def _scale_kernel(xp, x, scale=1.0, bias=0.0, bias_after_scale=True, out=None):
    if out is not None:
        if bias_after_scale:
            xp.multiply(x, scale, out=out)
            if bias:
                xp.add(out, bias, out=out)
        else:
            xp.add(x, bias, out=out)
            xp.multiply(out, scale, out=out)
        return out
    if bias_after_scale:
        res = x * scale + bias if bias else x * scale
    else:
        res = (x + bias) * scale
    return res.astype(x.dtype, copy=False)


register("scale", _scale_kernel, backward=lambda node, g: scale(g, node.attrs.get("scale", 1.0)),
         rule="elementwise", inplace=_INPLACE, accepts_out=True, reuse=(0,),
         dtype=same_dtype(0),
         # a Partial(sum) input stays Partial only without a bias (sum of biases != bias)
         rule_attrs=lambda a: {"linear": "unary" if not a.get("bias") else None})


def _cast_bwd(node, g):
    return cast(g, node.attrs["src_dtype"])


def _cast_kernel(xp, x, dtype, src_dtype, out=None):
    if out is None:
        return x.astype(dtype)
    xp.copyto(out, x, casting="unsafe")
    return out


def _full_like_kernel(xp, x, fill_value, dtype, out=None):
    if out is None:
        return xp.full(x.shape, fill_value, dtype=dtype)
    out.fill(fill_value)
    return out


# a Partial input stays Partial only through a cast that keeps every value (float16 ->
# float32): a rounding cast reduces first, so the sum is rounded once
register("cast", _cast_kernel, backward=_cast_bwd, accepts_out=True,
         rule="elementwise", dtype=attr_dtype(),
         rule_attrs=lambda a: {"linear": "unary" if is_floating(a["dtype"])
                               and is_floating(a["src_dtype"])
                               and promote_floating(a["dtype"], a["src_dtype"]) == a["dtype"]
                               else None})


def _clip_kernel(xp, x, min=None, max=None, out=None):
    if out is not None:
        return xp.clip(x, min, max, out=out)
    return xp.clip(x, min, max).astype(x.dtype, copy=False)


def _clip_grad_kernel(xp, y, g, min=None, max=None, out=None):
    """Gradient passes where the output y is strictly inside (min, max), as in Paddle."""
    if min is None and max is None:
        return xp.multiply(g, 1, out=out)
    m = xp.greater(y, min) if min is not None else xp.less(y, max)
    if min is not None and max is not None:
        m &= y < max
    return xp.multiply(g, m, out=out)


register("clip", _clip_kernel, backward=grad_op_backward("clip_grad"), rule="elementwise",
         inplace=_INPLACE, accepts_out=True, reuse=(0,), save_outputs=(0,),
         dtype=same_dtype(0))
register("clip_grad", _clip_grad_kernel, rule="elementwise", reuse=(1,), dtype=same_dtype(1),
         accepts_out=True)


def _where_bwd(node, g):
    c = node.saved_tensor(0)
    _, sx, sy = node.in_shapes
    z = zeros_like(g)
    return (None,
            sum_to_shape(where(c, g, z), sx) if node.needs_grad(1) else None,
            sum_to_shape(where(c, z, g), sy) if node.needs_grad(2) else None)


def _where_dtype(dtypes, attrs):
    """Paddle's promotion of x and y (the bool condition takes no part)."""
    return paddle_promote(dtypes[1:], attrs)


_where_dtype.strict = True
register("where", lambda xp, c, x, y: xp.where(c, x, y), backward=_where_bwd,
         rule="elementwise", save_inputs=(0,), grad_inputs=(1, 2), no_need_buffer=(1, 2),
         dtype=_where_dtype)
register("full_like", _full_like_kernel, accepts_out=True,
         rule="elementwise", rule_attrs={"linear": "like"}, no_need_buffer=(0,),
         dtype=attr_dtype())


# -- public functions --------------------------------------------------------------------------

def _with_scalar(x: Any, y: Any) -> tuple[Tensor, Tensor]:
    """Both operands as Tensors; a Python scalar operand follows Paddle's Tensor-Scalar rule:
    it takes the tensor's dtype, except a float with an int/bool tensor (float32) and an int
    with a bool tensor (int64), where the tensor is cast to that dtype first."""
    sx, sy = not isinstance(x, Tensor), not isinstance(y, Tensor)
    if not (sx or sy):
        return x, y
    x, y = as_tensor(x, y), as_tensor(y, x)
    if sy and not sx and y.dtype != x.dtype:
        x = cast(x, y.dtype)
    elif sx and not sy and x.dtype != y.dtype:
        y = cast(y, x.dtype)
    return x, y


def _binary(name: str, methods=(), rmethods=()):
    op = OPS[name]

    def f(x: Any, y: Any, name: str | None = None) -> Tensor:
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
            x, y = _with_scalar(x, y)
        try:
            return apply(op, (x, y), {})
        except ValueError:
            if x.is_dist() or y.is_dist():  # the rule's message names shapes and placements
                raise
            try:  # numpy's broadcast error names neither op nor arguments
                broadcast_notations(op.name, (x._value.shape, y._value.shape),
                                    ("input 0", "input 1"))
            except ValueError as e:
                raise ValueError(str(e)) from None
            raise
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Elementwise {name} of x and y with numpy broadcasting."
    return public(name, methods=(name,) + tuple(methods), rmethods=rmethods)(f)


add = _binary("add", ("__add__",), ("__radd__",))
subtract = _binary("subtract", ("__sub__",), ("__rsub__",))
multiply = _binary("multiply", ("__mul__",), ("__rmul__",))
divide = _binary("divide", ("__truediv__",), ("__rtruediv__",))
pow = _binary("pow", ("__pow__",), ("__rpow__",))
maximum = _binary("maximum")
minimum = _binary("minimum")
equal = _binary("equal", ("__eq__",))
not_equal = _binary("not_equal", ("__ne__",))
less_than = _binary("less_than", ("__lt__",))
less_equal = _binary("less_equal", ("__le__",))
greater_than = _binary("greater_than", ("__gt__",))
greater_equal = _binary("greater_equal", ("__ge__",))
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")


def minmax_mask(x: Tensor, y: Tensor, pick: str) -> Tensor:
    return apply(OPS["minmax_mask"], (x, y), {"pick": pick})


def _unary_fn(name: str, methods=()):
    op = OPS[name]

    def f(x: Tensor, name: str | None = None) -> Tensor:
        return apply(op, (as_tensor(x),), {})
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Elementwise {name}."
    return public(name, methods=(name,) + tuple(methods))(f)


neg = _unary_fn("neg", ("__neg__",))
abs = _unary_fn("abs", ("__abs__",))
exp = _unary_fn("exp")
log = _unary_fn("log")
sqrt = _unary_fn("sqrt")
rsqrt = _unary_fn("rsqrt")
tanh = _unary_fn("tanh")
sigmoid = _unary_fn("sigmoid")
relu = _unary_fn("relu")
silu = _unary_fn("silu")
logical_not = _unary_fn("logical_not")


@public(methods=True)
def gelu(x: Tensor, approximate: bool = False, name: str | None = None) -> Tensor:
    """GELU, exact (erf) or with the tanh approximation."""
    return apply(OPS["gelu"], (as_tensor(x),), {"approximate": bool(approximate)})


@public(methods=True)
def scale(x: Tensor, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True,
          name: str | None = None) -> Tensor:
    """``x * scale + bias`` (or ``(x + bias) * scale`` when bias_after_scale is False)."""
    return apply(OPS["scale"], (as_tensor(x),), _scale_attrs(scale, bias, bias_after_scale))


def _scale_attrs(s, bias, bias_after_scale) -> dict:
    for arg, v in (("scale", s), ("bias", bias)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale: {arg} must be a Python number, got {type(v).__name__} "
                            f"{v!r}")
    return {"scale": float(s), "bias": float(bias), "bias_after_scale": bool(bias_after_scale)}


@public(methods=("cast", "astype"))
def cast(x: Tensor, dtype: Any) -> Tensor:
    """``x`` converted to ``dtype`` (differentiable between floating dtypes)."""
    d = to_np_dtype(dtype)
    x = as_tensor(x)
    if d == bfloat16 and x.place != "cpu":
        raise TypeError(f"cast: bfloat16 tensors live on the CPU only (cupy has no bfloat16); "
                        f"x of shape {x.shape} is on {x.place}: use float16 on the GPU")
    if np.dtype(x.dtype) == d:
        return assign(x)
    out = apply(OPS["cast"], (x,), {"dtype": d, "src_dtype": np.dtype(x.dtype)})
    if not is_floating(d):
        out.stop_gradient = True
        out._node = None
    return out


@public(methods=True)
def clip(x: Tensor, min: float | None = None, max: float | None = None,
         name: str | None = None) -> Tensor:
    """Clamp to [min, max] (either bound may be None)."""
    return apply(OPS["clip"], (as_tensor(x),), _clip_attrs(min, max))


def _clip_attrs(lo, hi) -> dict:
    for arg, v in (("min", lo), ("max", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(
                v, (int, float, np.integer, np.floating))):
            raise TypeError(f"clip: argument '{arg}' must be a number or None, got "
                            f"{type(v).__name__} {v!r}")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clip: min ({lo}) is greater than max ({hi})")
    return {"min": None if lo is None else float(lo), "max": None if hi is None else float(hi)}


@public()
def where(condition: Tensor, x: Any, y: Any, name: str | None = None) -> Tensor:
    """Elementwise ``x if condition else y`` with broadcasting."""
    condition = as_tensor(condition)
    if np.dtype(condition.dtype) != np.bool_:
        raise TypeError(f"where: condition must be bool, got {np.dtype(condition.dtype).name}")
    x = as_tensor(x, y if isinstance(y, Tensor) else condition)
    y = as_tensor(y, x)
    return apply(OPS["where"], (condition, x, y), {})


@public()
def full_like(x: Tensor, fill_value: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """A new tensor shaped (and, when distributed, placed) like ``x`` filled with ``fill_value``."""
    d = np.dtype(x.dtype) if dtype is None else to_np_dtype(dtype)
    return apply(OPS["full_like"], (x,), {"fill_value": fill_value, "dtype": d})


@public()
def zeros_like(x: Tensor, dtype: Any = None, name: str | None = None) -> Tensor:
    """Zeros shaped (and placed) like ``x``."""
    return full_like(x, 0, dtype)


@public()
def ones_like(x: Tensor, dtype: Any = None, name: str | None = None) -> Tensor:
    """Ones shaped (and placed) like ``x``."""
    return full_like(x, 1, dtype)


@public(methods=("clone",))
def assign(x: Tensor) -> Tensor:
    """A copy of ``x`` (differentiable)."""
    return scale(x, 1.0)


# -- inplace variants ----------------------------------------------------------------------------

def _inplace_binary(name: str, operator: str):
    op = OPS[name]

    def f(x: Tensor, y: Any, name: str | None = None) -> Tensor:
        return apply_inplace(op, (x, as_tensor(y, x)), {})  # x keeps its dtype
    f.__name__ = f.__qualname__ = name + "_"
    f.__doc__ = f"Inplace {name}: writes the result into x and returns x."
    return public(name + "_", methods=(name + "_", operator))(f)


add_ = _inplace_binary("add", "__iadd__")
subtract_ = _inplace_binary("subtract", "__isub__")
multiply_ = _inplace_binary("multiply", "__imul__")
divide_ = _inplace_binary("divide", "__itruediv__")


@public(methods=True)
def relu_(x: Tensor, name: str | None = None) -> Tensor:
    """Inplace relu: writes into x and returns x."""
    return apply_inplace(OPS["relu"], (x,), {})


@public(methods=True)
def exp_(x: Tensor, name: str | None = None) -> Tensor:
    """Inplace exp: writes into x and returns x."""
    return apply_inplace(OPS["exp"], (x,), {})


@public(methods=True)
def scale_(x: Tensor, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True,
           name: str | None = None) -> Tensor:
    """Inplace scale: writes into x and returns x."""
    return apply_inplace(OPS["scale"], (x,), _scale_attrs(scale, bias, bias_after_scale))


@public(methods=True)
def clip_(x: Tensor, min: float | None = None, max: float | None = None,
          name: str | None = None) -> Tensor:
    """Inplace clip: writes into x and returns x."""
    return apply_inplace(OPS["clip"], (x,), _clip_attrs(min, max))
