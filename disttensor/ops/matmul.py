"""Matrix product with numpy matmul semantics (1-d operands, broadcast batch dims) and optional
transposes of the last two axes. Rule: ``matmul``."""
from __future__ import annotations

from ..dispatch import apply
from ..schema import OPS, equal_dtypes, public, register
from ..tensor import Tensor
from .common import as_tensor, sum_to_shape
from .shape import reshape_to as reshape


def _matmul_kernel(xp, x, y, transpose_x=False, transpose_y=False, out=None):
    if transpose_x and x.ndim >= 2:
        x = xp.swapaxes(x, -1, -2)
    if transpose_y and y.ndim >= 2:
        y = xp.swapaxes(y, -1, -2)
    return xp.matmul(x, y) if out is None else xp.matmul(x, y, out=out)


def _matmul_bwd(node, g):
    x, y = node.saved_tensor(0), node.saved_tensor(1)
    tx = node.attrs.get("transpose_x", False) and x.ndim > 1
    ty = node.attrs.get("transpose_y", False) and y.ndim > 1
    x2 = x if x.ndim > 1 else reshape(x, [1, x.shape[0]])
    y2 = y if y.ndim > 1 else reshape(y, [y.shape[0], 1])
    g_shape = list(g.shape)
    if x.ndim == 1:
        g_shape.insert(len(g_shape) - (0 if y.ndim == 1 else 1), 1)
    if y.ndim == 1:
        g_shape.append(1)
    g2 = reshape(g, g_shape) if g_shape != list(g.shape) else g
    gx = gy = None
    if node.needs_grad(0):
        gx = (matmul(y2, g2, ty, True) if tx else matmul(g2, y2, False, not ty))
        gx = sum_to_shape(gx, x2.shape)
        gx = reshape(gx, x.shape) if x.ndim == 1 else gx
    if node.needs_grad(1):
        gy = (matmul(g2, x2, True, tx) if ty else matmul(x2, g2, not tx, False))
        gy = sum_to_shape(gy, y2.shape)
        gy = reshape(gy, y.shape) if y.ndim == 1 else gy
    return gx, gy


register("matmul", _matmul_kernel, backward=_matmul_bwd, rule="matmul", save_inputs=(0, 1),
         accepts_out=True, dtype=equal_dtypes)
_MATMUL = OPS["matmul"]


@public(methods=("matmul", "__matmul__"), rmethods=("__rmatmul__",))
def matmul(x: Tensor, y: Tensor, transpose_x: bool = False, transpose_y: bool = False,
           name: str | None = None) -> Tensor:
    """``x @ y`` (numpy matmul semantics) with the last two axes of x / y optionally swapped."""
    x, y = as_tensor(x), as_tensor(y)
    xs, ys = x._value.shape, y._value.shape  # global shapes, as tuples (cheaper than .shape)
    if not xs or not ys:
        raise ValueError(f"matmul: operands must have at least 1 dim, got x {list(xs)} and y "
                         f"{list(ys)}")
    tx, ty = bool(transpose_x), bool(transpose_y)
    k_x = xs[-2] if tx and len(xs) > 1 else xs[-1]
    k_y = ys[-1] if ty and len(ys) > 1 else (ys[-2] if len(ys) > 1 else ys[0])
    if k_x != k_y:
        raise ValueError(f"matmul: contracted dims differ: x {list(xs)} (transpose_x="
                         f"{transpose_x}) has {k_x}, y {list(ys)} (transpose_y={transpose_y}) "
                         f"has {k_y}")
    # attrs only when set: the plain product skips building and unpacking keyword arguments
    attrs = {"transpose_x": tx, "transpose_y": ty} if tx or ty else _NO_ATTRS
    return apply(_MATMUL, (x, y), attrs)


_NO_ATTRS: dict = {}
