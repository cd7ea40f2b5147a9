"""Elementwise ops (numpy broadcasting): arithmetic, comparisons, unary math, scale, cast, clip,
where, full_like. Rule: ``elementwise``. Kernels built on ufuncs accept ``out=`` (the inplace
variants write straight into their target) and may reuse a dying input's buffer."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dispatch import apply, apply_inplace
from ..dtype import to_np_dtype
from ..schema import (OPS, attr_dtype, fixed_dtype, paddle_promote, promoting, public, register,
                      same_dtype, ufunc_dtype)
from ..tensor import Tensor
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
              dtype=paddle_promote)
register("add", _ufunc_kernel(np.add), backward=_add_bwd, no_need_buffer=(0, 1),
         rule_attrs={"linear": "add"}, **_ARITH)
register("subtract", _ufunc_kernel(np.subtract), backward=_sub_bwd, no_need_buffer=(0, 1),
         rule_attrs={"linear": "add"}, **_ARITH)
register("multiply", _ufunc_kernel(np.multiply), backward=_mul_bwd, save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0, 1)}, **_ARITH)
register("divide", _ufunc_kernel(np.true_divide), backward=_div_bwd, save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0,)},
         **{**_ARITH, "dtype": promoting(ufunc_dtype(np.true_divide))})
register("pow", lambda xp, x, y: xp.power(x, y), backward=_pow_bwd, rule="elementwise",
         save_inputs=(0, 1), save_outputs=(0,), dtype=paddle_promote)
register("maximum", lambda xp, x, y: xp.maximum(x, y), backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1), reuse=(0, 1), dtype=paddle_promote, rule_attrs={"linear": "max"})
register("minimum", lambda xp, x, y: xp.minimum(x, y), backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1), reuse=(0, 1), dtype=paddle_promote, rule_attrs={"linear": "min"})


def _minmax_mask_kernel(xp, x, y, pick):
    """1 where ``maximum``/``minimum`` picked x (x wins ties), else 0; in x's dtype."""
    m = (x >= y) if pick == "maximum" else (x <= y)
    return xp.broadcast_to(m, np.broadcast_shapes(x.shape, y.shape)).astype(x.dtype)


register("minmax_mask", _minmax_mask_kernel, rule="elementwise", dtype=same_dtype(0))

# -- comparisons (no grad) ---------------------------------------------------------------------

_COMPARE = {"equal": "equal", "not_equal": "not_equal", "less_than": "less",
            "less_equal": "less_equal", "greater_than": "greater",
            "greater_equal": "greater_equal", "logical_and": "logical_and",
            "logical_or": "logical_or"}
for _name, _fn in _COMPARE.items():
    register(_name, lambda xp, x, y, _fn=_fn: getattr(xp, _fn)(x, y), rule="elementwise",
             dtype=fixed_dtype(np.bool_))
register("logical_not", lambda xp, x: xp.logical_not(x), rule="elementwise",
         dtype=fixed_dtype(np.bool_))

# -- unary math ----------------------------------------------------------------------------------


def _unary(name: str, kernel, grad_kernel=None, save: str = "out", linear: bool = False,
           inplace: bool = False, dtype=None, backward=None):
    """Register ``name`` and, when it has a gradient, ``name_grad(saved, dout)`` (elementwise)."""
    if grad_kernel is not None:
        register(f"{name}_grad", grad_kernel, rule="elementwise", reuse=(1,))
        backward = grad_op_backward(f"{name}_grad")
    register(name, kernel, rule="elementwise", backward=backward,
             save_inputs=(0,) if save == "x" and grad_kernel else (),
             save_outputs=(0,) if save == "out" and grad_kernel else (),
             inplace=_INPLACE if inplace else (), accepts_out=inplace, reuse=(0,),
             dtype=dtype or same_dtype(0),
             rule_attrs={"linear": "unary"} if linear else {})


def _ufunc1(ufunc):
    """``ufunc(x)``, into ``out`` when given."""
    def kernel(xp, x, out=None):
        return ufunc(x) if out is None else ufunc(x, out=out)
    return kernel


def _erf(xp, x):
    if xp is np:
        try:
            from scipy.special import erf
        except ImportError:
            return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy()
        return erf(x).astype(x.dtype, copy=False)
    from cupyx.scipy.special import erf

    return erf(x)


_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu(xp, x, approximate=False):
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + xp.tanh(c * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + _erf(xp, x / _SQRT_2))


def _gelu_grad(xp, x, g, approximate=False):
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        inner = c * (x + 0.044715 * x ** 3)
        t = xp.tanh(inner)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x))
    cdf = 0.5 * (1.0 + _erf(xp, x / _SQRT_2))
    return g * (cdf + x * _INV_SQRT_2PI * xp.exp(-0.5 * x * x))


def _sigmoid(xp, x):
    return 0.5 * (xp.tanh(0.5 * x) + 1.0)


def _relu(xp, x, out=None):
    if out is None:
        return xp.maximum(x, 0).astype(x.dtype, copy=False)
    return xp.maximum(x, 0, out=out)


def _float_dtype(dtypes, attrs) -> tuple:
    """Floating inputs keep their dtype; integer and bool inputs compute in float64."""
    d = np.dtype(dtypes[0])
    return (d if d.kind == "f" else np.dtype(np.float64),)


def _floating(kernel):
    """``kernel`` on x converted to float64 when x is not floating (see :func:`_float_dtype`)."""
    def k(xp, x, *rest, **attrs):
        if x.dtype.kind != "f":
            x = x.astype(np.float64)
        return kernel(xp, x, *rest, **attrs)
    return k


_FLOAT = _float_dtype
_unary("neg", lambda xp, x: -x, None, linear=True, backward=lambda node, g: neg(g))
_unary("abs", lambda xp, x: xp.abs(x), lambda xp, x, g: g * xp.sign(x), save="x")
_unary("exp", _floating(_ufunc1(np.exp)), lambda xp, out, g: g * out, inplace=True,
       dtype=_FLOAT)
_unary("log", _floating(lambda xp, x: xp.log(x)), lambda xp, x, g: g / x, save="x",
       dtype=_FLOAT)
_unary("sqrt", _floating(lambda xp, x: xp.sqrt(x)), lambda xp, out, g: g * 0.5 / out,
       dtype=_FLOAT)
_unary("rsqrt", _floating(lambda xp, x: 1.0 / xp.sqrt(x)),
       lambda xp, out, g: g * -0.5 * out * out * out, dtype=_FLOAT)
_unary("tanh", _floating(lambda xp, x: xp.tanh(x)), lambda xp, out, g: g * (1.0 - out * out),
       dtype=_FLOAT)
_unary("sigmoid", _floating(_sigmoid), lambda xp, out, g: g * out * (1.0 - out), dtype=_FLOAT)
_unary("relu", _relu, lambda xp, out, g: g * (out > 0), inplace=True)
_unary("silu", _floating(lambda xp, x: x * _sigmoid(xp, x)),
       lambda xp, x, g: g * _sigmoid(xp, x) * (1.0 + x * (1.0 - _sigmoid(xp, x))), save="x",
       dtype=_FLOAT)
register("gelu_grad", _gelu_grad, rule="elementwise", reuse=(1,))
register("gelu", _floating(_gelu), backward=grad_op_backward("gelu_grad"), rule="elementwise",
         save_inputs=(0,), reuse=(0,), dtype=_FLOAT)


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


register("cast", lambda xp, x, dtype, src_dtype: x.astype(dtype), backward=_cast_bwd,
         rule="elementwise", dtype=attr_dtype(),
         rule_attrs=lambda a: {"linear": "unary" if np.dtype(a["dtype"]).kind == "f"
                               and np.dtype(a["src_dtype"]).kind == "f" else None})


def _clip_kernel(xp, x, min=None, max=None, out=None):
    if out is not None:
        return xp.clip(x, min, max, out=out)
    return xp.clip(x, min, max).astype(x.dtype, copy=False)


def _clip_grad_kernel(xp, out, g, min=None, max=None):
    """Gradient passes where the output is strictly inside (min, max), as in Paddle."""
    m = xp.ones(out.shape, dtype=bool)
    if min is not None:
        m &= out > min
    if max is not None:
        m &= out < max
    return g * m


register("clip", _clip_kernel, backward=grad_op_backward("clip_grad"), rule="elementwise",
         inplace=_INPLACE, accepts_out=True, reuse=(0,), save_outputs=(0,),
         dtype=same_dtype(0))
register("clip_grad", _clip_grad_kernel, rule="elementwise", reuse=(1,), dtype=same_dtype(1))


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
register("full_like", lambda xp, x, fill_value, dtype: xp.full(x.shape, fill_value, dtype=dtype),
         rule="elementwise", rule_attrs={"linear": "like"}, no_need_buffer=(0,),
         dtype=attr_dtype())


# -- public functions --------------------------------------------------------------------------

def _with_scalar(x: Any, y: Any) -> tuple[Tensor, Tensor]:
    """Both operands as Tensors; a Python scalar operand follows Paddle's Tensor-Scalar rule:
    it takes the tensor's dtype, except a float with an int/bool tensor (float32) and an int
    with a bool tensor (int64), where the tensor is cast to that dtype first."""
    sx, sy = not isinstance(x, Tensor), not isinstance(y, Tensor)
    x, y = as_tensor(x, y), as_tensor(y, x)
    if sy and not sx and y.dtype != x.dtype:
        x = cast(x, y.dtype)
    elif sx and not sy and x.dtype != y.dtype:
        y = cast(y, x.dtype)
    return x, y


def _binary(name: str, methods=(), rmethods=()):
    op = OPS[name]

    def f(x: Any, y: Any, name: str | None = None) -> Tensor:
        return apply(op, _with_scalar(x, y), {})
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
    if np.dtype(x.dtype) == d:
        return assign(x)
    out = apply(OPS["cast"], (x,), {"dtype": d, "src_dtype": np.dtype(x.dtype)})
    if d.kind != "f":
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
            raise TypeError(f"clip: {arg} must be a number or None, got {type(v).__name__} "
                            f"{v!r}")
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
