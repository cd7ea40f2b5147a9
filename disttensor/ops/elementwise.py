"""Elementwise ops (numpy broadcasting): arithmetic, comparisons, unary math, scale, cast, clip,
where. Rule: ``elementwise``."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..dtype import to_np_dtype
from ..tensor import Tensor
from .common import as_tensor, sum_to_shape
from .registry import OPS, apply, apply_inplace, grad_op_backward, register

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


register("add", backward=_add_bwd, rule="elementwise", inplace=(0, 0),
         rule_attrs={"linear": "add"})(lambda xp, x, y: x + y)
register("subtract", backward=_sub_bwd, rule="elementwise", inplace=(0, 0),
         rule_attrs={"linear": "add"})(lambda xp, x, y: x - y)
register("multiply", backward=_mul_bwd, rule="elementwise", inplace=(0, 0), save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0, 1)})(lambda xp, x, y: x * y)
register("divide", backward=_div_bwd, rule="elementwise", inplace=(0, 0), save_inputs=(0, 1),
         rule_attrs={"linear": "mul", "linear_inputs": (0,)})(lambda xp, x, y: x / y)
register("pow", backward=_pow_bwd, rule="elementwise", save_inputs=(0, 1),
         save_outputs=(0,))(lambda xp, x, y: xp.power(x, y))
register("maximum", backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1))(lambda xp, x, y: xp.maximum(x, y))
register("minimum", backward=_minmax_bwd, rule="elementwise",
         save_inputs=(0, 1))(lambda xp, x, y: xp.minimum(x, y))


@register("minmax_mask", rule="elementwise")
def _minmax_mask_kernel(xp, x, y, pick):
    """1 where ``maximum``/``minimum`` picked x (x wins ties), else 0; in x's dtype."""
    m = (x >= y) if pick == "maximum" else (x <= y)
    return xp.broadcast_to(m, np.broadcast_shapes(x.shape, y.shape)).astype(x.dtype)


# -- comparisons (no grad) ---------------------------------------------------------------------

_COMPARE = {"equal": "equal", "not_equal": "not_equal", "less_than": "less",
            "less_equal": "less_equal", "greater_than": "greater",
            "greater_equal": "greater_equal", "logical_and": "logical_and",
            "logical_or": "logical_or"}
for _name, _fn in _COMPARE.items():
    register(_name, rule="elementwise")(lambda xp, x, y, _fn=_fn: getattr(xp, _fn)(x, y))
register("logical_not", rule="elementwise")(lambda xp, x: xp.logical_not(x))

# -- unary math ----------------------------------------------------------------------------------


def _unary(name: str, kernel, grad_kernel=None, save: str = "out", linear: bool = False,
           inplace: bool = False):
    """Register ``name`` and, when it has a gradient, ``name_grad(saved, dout)`` (elementwise)."""
    if grad_kernel is not None:
        register(f"{name}_grad", rule="elementwise")(grad_kernel)
    bwd = None if grad_kernel is None else grad_op_backward(f"{name}_grad")
    register(name, backward=bwd, rule="elementwise",
             save_inputs=(0,) if save == "x" and grad_kernel else (),
             save_outputs=(0,) if save == "out" and grad_kernel else (),
             inplace=(0, 0) if inplace else None,
             rule_attrs={"linear": "unary"} if linear else {})(kernel)


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


_unary("neg", lambda xp, x: -x, None, linear=True)
_unary("abs", lambda xp, x: xp.abs(x), lambda xp, x, g: g * xp.sign(x), save="x")
_unary("exp", lambda xp, x: xp.exp(x), lambda xp, out, g: g * out, inplace=True)
_unary("log", lambda xp, x: xp.log(x), lambda xp, x, g: g / x, save="x")
_unary("sqrt", lambda xp, x: xp.sqrt(x), lambda xp, out, g: g * 0.5 / out)
_unary("rsqrt", lambda xp, x: 1.0 / xp.sqrt(x), lambda xp, out, g: g * -0.5 * out * out * out)
_unary("tanh", lambda xp, x: xp.tanh(x), lambda xp, out, g: g * (1.0 - out * out))
_unary("sigmoid", _sigmoid, lambda xp, out, g: g * out * (1.0 - out))
_unary("relu", lambda xp, x: xp.maximum(x, 0).astype(x.dtype, copy=False),
       lambda xp, out, g: g * (out > 0), inplace=True)
_unary("silu", lambda xp, x: x * _sigmoid(xp, x),
       lambda xp, x, g: g * _sigmoid(xp, x) * (1.0 + x * (1.0 - _sigmoid(xp, x))), save="x")


register("gelu", backward=grad_op_backward("gelu_grad"), rule="elementwise", save_inputs=(0,))(_gelu)
register("gelu_grad", rule="elementwise")(_gelu_grad)
# The neg op is linear: its backward is neg itself.
OPS["neg"].backward = lambda node, g: neg(g)


# -- scale, cast, clip, where ------------------------------------------------------------------

def _scale_kernel(xp, x, scale=1.0, bias=0.0, bias_after_scale=True):
    if bias_after_scale:
        out = x * scale + bias if bias else x * scale
    else:
        out = (x + bias) * scale
    return out.astype(x.dtype, copy=False)


register("scale", backward=lambda node, g: scale(g, node.attrs.get("scale", 1.0)),
         rule="elementwise", inplace=(0, 0),
         # a Partial(sum) input stays Partial only without a bias (sum of biases != bias)
         rule_attrs=lambda a: {"linear": "unary" if not a.get("bias") else None})(_scale_kernel)


def _cast_bwd(node, g):
    return cast(g, node.attrs["src_dtype"])


register("cast", backward=_cast_bwd, rule="elementwise",
         rule_attrs=lambda a: {"linear": "unary" if np.dtype(a["dtype"]).kind == "f"
                               and np.dtype(a["src_dtype"]).kind == "f" else None})(lambda xp, x, dtype, src_dtype: x.astype(dtype))


def _clip_kernel(xp, x, min=None, max=None):
    return xp.clip(x, min, max).astype(x.dtype, copy=False)


def _clip_grad_kernel(xp, out, g, min=None, max=None):
    """Gradient passes where the output is strictly inside (min, max), as in Paddle."""
    m = xp.ones(out.shape, dtype=bool)
    if min is not None:
        m &= out > min
    if max is not None:
        m &= out < max
    return g * m


register("clip", backward=grad_op_backward("clip_grad"),
         rule="elementwise", inplace=(0, 0), save_outputs=(0,))(_clip_kernel)
register("clip_grad", rule="elementwise")(_clip_grad_kernel)


def _where_bwd(node, g):
    c = node.saved_tensor(0)
    _, sx, sy = node.in_shapes
    z = zeros_like(g)
    return (None,
            sum_to_shape(where(c, g, z), sx) if node.needs_grad(1) else None,
            sum_to_shape(where(c, z, g), sy) if node.needs_grad(2) else None)


register("where", backward=_where_bwd, rule="elementwise", save_inputs=(0,),
         grad_inputs=(1, 2))(lambda xp, c, x, y: xp.where(c, x, y))


@register("full_like", rule="elementwise", rule_attrs={"linear": "like"})
def _full_like_kernel(xp, x, fill_value, dtype):
    return xp.full(x.shape, fill_value, dtype=dtype)


# -- public functions --------------------------------------------------------------------------

def _binary(name: str):
    op = OPS[name]

    def f(x: Any, y: Any, name: str | None = None) -> Tensor:
        x, y = as_tensor(x, y), as_tensor(y, x)
        return apply(op, (x, y), {})
    f.__name__ = name
    f.__doc__ = f"Elementwise {name} of x and y with numpy broadcasting."
    return f


add = _binary("add")
subtract = _binary("subtract")
multiply = _binary("multiply")
divide = _binary("divide")
pow = _binary("pow")
maximum = _binary("maximum")
minimum = _binary("minimum")
equal = _binary("equal")
not_equal = _binary("not_equal")
less_than = _binary("less_than")
less_equal = _binary("less_equal")
greater_than = _binary("greater_than")
greater_equal = _binary("greater_equal")
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")


def minmax_mask(x: Tensor, y: Tensor, pick: str) -> Tensor:
    return apply(OPS["minmax_mask"], (x, y), {"pick": pick})


def _unary_fn(name: str):
    op = OPS[name]

    def f(x: Tensor, name: str | None = None) -> Tensor:
        return apply(op, (as_tensor(x),), {})
    f.__name__ = name
    f.__doc__ = f"Elementwise {name}."
    return f


neg = _unary_fn("neg")
abs = _unary_fn("abs")
exp = _unary_fn("exp")
log = _unary_fn("log")
sqrt = _unary_fn("sqrt")
rsqrt = _unary_fn("rsqrt")
tanh = _unary_fn("tanh")
sigmoid = _unary_fn("sigmoid")
relu = _unary_fn("relu")
silu = _unary_fn("silu")
logical_not = _unary_fn("logical_not")


def gelu(x: Tensor, approximate: bool = False, name: str | None = None) -> Tensor:
    """GELU, exact (erf) or with the tanh approximation."""
    return apply(OPS["gelu"], (as_tensor(x),), {"approximate": bool(approximate)})


def scale(x: Tensor, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True,
          name: str | None = None) -> Tensor:
    """``x * scale + bias`` (or ``(x + bias) * scale`` when bias_after_scale is False)."""
    return apply(OPS["scale"], (as_tensor(x),), _scale_attrs(scale, bias, bias_after_scale))


def _scale_attrs(s, bias, bias_after_scale) -> dict:
    for arg, v in (("scale", s), ("bias", bias)):
        if not isinstance(v, (int, float)):
            raise TypeError(f"scale: {arg} must be a Python number, got {type(v).__name__}")
    return {"scale": float(s), "bias": float(bias), "bias_after_scale": bool(bias_after_scale)}


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


def clip(x: Tensor, min: float | None = None, max: float | None = None,
         name: str | None = None) -> Tensor:
    """Clamp to [min, max] (either bound may be None)."""
    return apply(OPS["clip"], (as_tensor(x),), _clip_attrs(min, max))


def _clip_attrs(lo, hi) -> dict:
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"clip: min ({lo}) is greater than max ({hi})")
    return {"min": None if lo is None else float(lo), "max": None if hi is None else float(hi)}


def where(condition: Tensor, x: Any, y: Any, name: str | None = None) -> Tensor:
    """Elementwise ``x if condition else y`` with broadcasting."""
    condition = as_tensor(condition)
    if np.dtype(condition.dtype) != np.bool_:
        raise TypeError(f"where: condition must be bool, got {np.dtype(condition.dtype).name}")
    x = as_tensor(x, y if isinstance(y, Tensor) else condition)
    y = as_tensor(y, x)
    return apply(OPS["where"], (condition, x, y), {})


def full_like(x: Tensor, fill_value: Any, dtype: Any = None, name: str | None = None) -> Tensor:
    """A new tensor shaped (and, when distributed, placed) like ``x`` filled with ``fill_value``."""
    d = np.dtype(x.dtype) if dtype is None else to_np_dtype(dtype)
    return apply(OPS["full_like"], (x,), {"fill_value": fill_value, "dtype": d})


def zeros_like(x: Tensor, dtype: Any = None, name: str | None = None) -> Tensor:
    return full_like(x, 0, dtype)


def ones_like(x: Tensor, dtype: Any = None, name: str | None = None) -> Tensor:
    return full_like(x, 1, dtype)


def assign(x: Tensor) -> Tensor:
    """A copy of ``x`` (differentiable)."""
    return scale(x, 1.0)


# -- inplace variants ----------------------------------------------------------------------------

def _inplace_binary(name: str):
    op = OPS[name]

    def f(x: Tensor, y: Any, name: str | None = None) -> Tensor:
        return apply_inplace(op, (x, as_tensor(y, x)), {})
    f.__name__ = name + "_"
    f.__doc__ = f"Inplace {name}: writes the result into x and returns x."
    return f


add_ = _inplace_binary("add")
subtract_ = _inplace_binary("subtract")
multiply_ = _inplace_binary("multiply")
divide_ = _inplace_binary("divide")


def relu_(x: Tensor, name: str | None = None) -> Tensor:
    return apply_inplace(OPS["relu"], (x,), {})


def exp_(x: Tensor, name: str | None = None) -> Tensor:
    return apply_inplace(OPS["exp"], (x,), {})


def scale_(x: Tensor, scale: float = 1.0, bias: float = 0.0, bias_after_scale: bool = True,
           name: str | None = None) -> Tensor:
    return apply_inplace(OPS["scale"], (x,), _scale_attrs(scale, bias, bias_after_scale))


def clip_(x: Tensor, min: float | None = None, max: float | None = None,
          name: str | None = None) -> Tensor:
    return apply_inplace(OPS["clip"], (x,), _clip_attrs(min, max))
