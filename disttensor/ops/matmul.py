"""Matrix product with numpy matmul semantics (1-d operands, broadcast batch dims) and optional
transposes of the last two axes. Rule: ``matmul``."""
from __future__ import annotations

import math

import numpy as np

from ..dispatch import apply
from ..schema import OPS, equal_dtypes, public, register
from ..tensor import Tensor
from .common import as_tensor, sum_to_shape
from .shape import reshape_to as reshape


def _matmul_2d(xp, a, b, out):
    """A 2-D product: numpy's matmul, or cupy's dot (one cuBLAS call behind less Python than
    cupy's matmul)."""
    if xp is not np and (out is None or out.flags.c_contiguous):
        return xp.dot(a, b, out=out)
    return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)


def _matmul_kernel(xp, x, y, transpose_x=False, transpose_y=False, out=None):
    if transpose_y and y.ndim >= 2:
        y = xp.swapaxes(y, -1, -2)
    if x.ndim > 2 and y.ndim == 2 and not transpose_x and x.flags.c_contiguous and (
            out is None or out.flags.c_contiguous):
        # a stack of rows times one matrix: one GEMM over the folded leading dims
        rows = math.prod(x.shape[:-1])
        res = _matmul_2d(xp, x.reshape(rows, x.shape[-1]), y,
                         None if out is None else out.reshape(rows, y.shape[-1]))
        return res.reshape(x.shape[:-1] + (y.shape[-1],)) if out is None else out
    if transpose_x and x.ndim >= 2:
        x = xp.swapaxes(x, -1, -2)
    if xp is not np and x.ndim == 2 and y.ndim == 2:  # (numpy's matmul is the one call)
        return _matmul_2d(xp, x, y, out)
    return xp.matmul(x, y) if out is None else xp.matmul(x, y, out=out)


def _foldable(t, lead: int) -> bool:
    """Whether merging t's ``lead`` leading dims into one keeps its layout: dense, or sharded
    over those dims only along the first, evenly (reshape then moves no data)."""
    if not t.is_dist():
        return True
    attr = t._value.dist_attr
    if any(attr.dims_mapping[d] for d in range(1, lead)):
        return False
    return t._value.shape[0] % math.prod(attr.mesh_shape[m] for m in attr.dims_mapping[0]) == 0


def _folded_weight_grad(x, g, tx: bool, ty: bool):
    """The gradient of a 2-D y in ``x @ y`` for x with leading (batch) dims, as one GEMM over
    the folded rows: ``x2^T @ g2`` with x2 = x as [rows, k] and g2 = g as [rows, n] (instead of
    a per-sample product summed over the batch); None when folding would move data."""
    lead = x.ndim - 1
    if tx or x.ndim < 3 or tuple(g.shape[:-1]) != tuple(x.shape[:-1]) or not (
            _foldable(x, lead) and _foldable(g, lead)):
        return None
    rows = math.prod(x.shape[:-1])
    x2 = reshape(x, [rows, x.shape[-1]])
    g2 = reshape(g, [rows, g.shape[-1]])
    return matmul(g2, x2, True, False) if ty else matmul(x2, g2, True, False)


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
    # the weight's gradient first: a captured step can then free x (often recomputed, see
    # disttensor.jit.remat) before x's own gradient is made
    if node.needs_grad(1):
        gy = _folded_weight_grad(x, g, tx, ty) if y.ndim == 2 else None
        if gy is None:
            gy = (matmul(g2, x2, True, tx) if ty else matmul(x2, g2, not tx, False))
            gy = sum_to_shape(gy, y2.shape)
        gy = reshape(gy, y.shape) if y.ndim == 1 else gy
    if node.needs_grad(0):
        gx = (matmul(y2, g2, ty, True) if tx else matmul(g2, y2, False, not ty))
        gx = sum_to_shape(gx, x2.shape)
        gx = reshape(gx, x.shape) if x.ndim == 1 else gx
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
