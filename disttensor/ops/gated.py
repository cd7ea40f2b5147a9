"""SwiGLU, the gated activation of LLaMA's feed-forward block (Paddle's
``incubate.nn.functional.swiglu``): ``silu(x) * y``; with ``y`` None, x's last axis is split in
two halves ``x = [a, b]`` and the result is ``silu(a) * b``. One fused op (rule ``elementwise``:
x and y of one shape) and one fused grad."""
from __future__ import annotations

from ..dispatch import apply
from ..schema import OPS, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor
from .elementwise import _silu, _silu_grad
from .shape import chunk

__all__ = ["swiglu"]


def _swiglu_kernel(xp, x, y):
    out = _silu(xp, x)
    out *= y
    return out


def _swiglu_grad_kernel(xp, x, y, dout):
    """(dx, dy) = (dout * y * silu'(x), dout * silu(x))."""
    return _silu_grad(xp, x, dout * y), dout * _silu(xp, x)


def _swiglu_bwd(node, g):
    x, y = node.saved_tensor(0), node.saved_tensor(1)
    dx, dy = apply(OPS["swiglu_grad"], (x, y, g), {})
    return dx, dy


register("swiglu_grad", _swiglu_grad_kernel, rule="elementwise", n_out=2,
         dtype=same_dtype(0, n_out=2), rule_attrs={"num_outputs": 2})
register("swiglu", _swiglu_kernel, backward=_swiglu_bwd, rule="elementwise", save_inputs=(0, 1),
         dtype=same_dtype(0))


def swiglu(x: Tensor, y: Tensor | None = None, name: str | None = None) -> Tensor:
    """``silu(x) * y``; with ``y`` None, ``silu(a) * b`` for the halves ``[a, b]`` of x's last
    axis (which must have an even size). x and y must have one shape and dtype.

    Example::

        h = dt.randn([2, 8, 64])
        out = swiglu(h)          # [2, 8, 32]
    """
    x = as_tensor(x)
    if y is None:
        if x.ndim == 0 or x.shape[-1] % 2:
            raise ValueError(f"swiglu: without y the last axis of x must have an even size, "
                             f"got shape {x.shape}")
        x, y = chunk(x, 2, axis=-1)
    y = as_tensor(y, like=x)
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"swiglu: x and y must have one shape and dtype, got x {x.shape} "
                         f"{x.dtype} and y {y.shape} {y.dtype}")
    return apply(OPS["swiglu"], (x, y), {})
