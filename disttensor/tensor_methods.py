"""Binds ops to :class:`Tensor` as methods and Python operators."""
from __future__ import annotations

from . import ops
from .ops.common import as_tensor
from .tensor import Tensor


def _rev(f):
    return lambda self, other: f(as_tensor(other, self), self)


_METHODS = {
    "__add__": ops.add, "__radd__": _rev(ops.add), "__sub__": ops.subtract,
    "__rsub__": _rev(ops.subtract), "__mul__": ops.multiply, "__rmul__": _rev(ops.multiply),
    "__truediv__": ops.divide, "__rtruediv__": _rev(ops.divide), "__pow__": ops.pow,
    "__rpow__": _rev(ops.pow), "__matmul__": ops.matmul, "__rmatmul__": _rev(ops.matmul),
    "__neg__": ops.neg, "__abs__": ops.abs,
    "__eq__": ops.equal, "__ne__": ops.not_equal, "__lt__": ops.less_than,
    "__le__": ops.less_equal, "__gt__": ops.greater_than, "__ge__": ops.greater_equal,
    "__getitem__": ops.getitem, "__setitem__": lambda self, i, v: ops.setitem(self, i, v),
    "__iadd__": ops.add_, "__isub__": ops.subtract_, "__imul__": ops.multiply_,
    "__itruediv__": ops.divide_,
    "add_": ops.add_, "subtract_": ops.subtract_, "multiply_": ops.multiply_,
    "divide_": ops.divide_, "scale_": ops.scale_, "relu_": ops.relu_, "exp_": ops.exp_,
    "clip_": ops.clip_, "zero_": ops.zero_, "fill_": ops.fill_, "copy_": ops.copy_,
}
for _name in ("add", "subtract", "multiply", "divide", "pow", "maximum", "minimum", "equal",
              "not_equal", "less_than", "less_equal", "greater_than", "greater_equal", "abs",
              "neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu",
              "scale", "cast", "clip", "matmul", "sum", "mean", "max", "min", "argmax", "argmin",
              "reshape", "flatten", "squeeze", "unsqueeze", "transpose", "split", "chunk",
              "expand", "broadcast_to", "tile", "logical_not", "logical_and", "logical_or",
              "gather", "index_select"):
    _METHODS.setdefault(_name, getattr(ops, _name))
_METHODS["astype"] = ops.cast

for _name, _fn in _METHODS.items():
    setattr(Tensor, _name, _fn)
