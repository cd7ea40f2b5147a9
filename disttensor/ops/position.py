"""Rotary position embedding (Paddle's ``incubate.nn.functional.fused_rotary_position_embedding``).

Each of q, k, v (``[batch, seq, heads, head_dim]``) becomes ``x * cos + rotate(x) * sin`` with
sin/cos ``[1, seq, 1, head_dim]`` (or gathered at ``position_ids`` ``[batch, seq]`` from a
longer table). ``rotate`` pairs the dims in one of two styles:

* ``use_neox_rotary_style=True`` (GPT-NeoX, Paddle's default): the halves,
  ``rotate(x) = concat(-x[..., d/2:], x[..., :d/2])``;
* ``False``: adjacent pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``, LLaMA's complex form.

``rotate`` is antisymmetric, so the gradient is the transposed map
``dx = dy * cos - rotate(dy * sin)``: the same op with ``transpose`` set (exact for any
sin/cos, not only tables whose two entries of a pair agree).
"""
from __future__ import annotations

import numpy as np

from spmd_rules.attention import rotary_shapes

from ..dispatch import apply
from ..schema import OPS, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, check_index_range, constant
from .shape import reshape

__all__ = ["fused_rotary_position_embedding", "rotary_tables"]

_OP = "fused_rotary_position_embedding"


def _rotate(xp, a, neox: bool):
    r = xp.empty_like(a)
    if neox:
        h = a.shape[-1] // 2
        xp.negative(a[..., h:], out=r[..., :h])
        r[..., h:] = a[..., :h]
    else:
        xp.negative(a[..., 1::2], out=r[..., 0::2])
        r[..., 1::2] = a[..., 0::2]
    return r


def _rope_kernel(xp, x, sin, cos, position_ids, neox, transpose, ctx):
    """``x * cos + rotate(x) * sin`` (``transpose``: ``x * cos - rotate(x * sin)``)."""
    if position_ids is not None:
        position_ids = check_index_range(xp, ctx, "fused_rotary_position_embedding",
                                         "position_ids value", position_ids, sin.shape[1], 3)
        sin, cos = sin[0, position_ids], cos[0, position_ids]  # [b, s, 1, d]
    sin, cos = sin.astype(x.dtype, copy=False), cos.astype(x.dtype, copy=False)
    if transpose:
        out = _rotate(xp, x * sin, neox)
        xp.subtract(x * cos, out, out=out)
    else:
        out = _rotate(xp, x, neox)
        out *= sin
        out += x * cos
    return out


def _rope_bwd(node, g):
    sin, cos, pos = (node.saved_tensor(i) for i in range(3))
    attrs = {**node.attrs, "transpose": not node.attrs["transpose"]}
    return apply(OPS[_OP], (g, sin, cos, pos), attrs), None, None, None


register(_OP, _rope_kernel, backward=_rope_bwd, rule="rotary_embedding", needs_ctx=True,
         save_inputs=(1, 2, 3), grad_inputs=(0,), dtype=same_dtype(0))


def rotary_tables(seq_len: int, head_dim: int, neox: bool = True, base: float = 10000.0,
                  dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """numpy sin/cos tables ``[1, seq_len, 1, head_dim]`` with angle ``pos * base^(-2i/d)``
    for pair i, laid out for the rotation style (halves repeated, or each angle twice)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.outer(np.arange(seq_len, dtype=np.float64), inv)
    ang = np.concatenate([ang, ang], axis=-1) if neox else np.repeat(ang, 2, axis=-1)
    shape = (1, seq_len, 1, head_dim)
    return np.sin(ang).reshape(shape).astype(dtype), np.cos(ang).reshape(shape).astype(dtype)


def _table(op: str, name: str, t, x: Tensor) -> Tensor:
    t = as_tensor(t, like=x)
    if t.ndim == 2:
        t = reshape(t, [1, t.shape[0], 1, t.shape[1]])
    if t.ndim != 4 or np.dtype(t.dtype).kind != "f":
        raise ValueError(f"{op}: {name} must be a floating [1, seq, 1, head_dim] or [seq, "
                         f"head_dim] tensor, got shape {t.shape} {np.dtype(t.dtype).name}")
    return t


def fused_rotary_position_embedding(q: Tensor, k: Tensor | None = None, v: Tensor | None = None,
                                    sin: Tensor | None = None, cos: Tensor | None = None,
                                    position_ids: Tensor | None = None,
                                    use_neox_rotary_style: bool = True, time_major: bool = False,
                                    rotary_emb_base: float = 10000.0
                                    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Rotate q (and k, v when given), each ``[batch, seq, heads, head_dim]``, by sin/cos
    ``[1, seq, 1, head_dim]`` (default: the tables of ``rotary_emb_base``), optionally gathered
    at ``position_ids`` ``[batch, seq]``. Returns ``(q, k, v)`` (None where not given).

    Example::

        q = dt.randn([2, 8, 4, 16])
        sin, cos = rotary_tables(8, 16)
        q2, _, _ = fused_rotary_position_embedding(q, sin=sin, cos=cos)
    """
    op = _OP
    if time_major:
        raise ValueError(f"{op}: time_major=True is not supported; pass [batch, seq, heads, "
                         "head_dim] tensors")
    q = as_tensor(q)
    if q.ndim != 4 or q.shape[3] % 2:
        raise ValueError(f"{op}: q must be 4-D [batch, seq, heads, head_dim] with an even "
                         f"head_dim, got shape {q.shape}")
    ts = [None if t is None else as_tensor(t) for t in (q, k, v)]
    for name, t in zip("qkv", ts):
        if t is not None and (t.ndim != 4 or t.shape[:2] != q.shape[:2]
                              or t.shape[3] != q.shape[3]):
            raise ValueError(f"{op}: {name} must have shape [{q.shape[0]}, {q.shape[1]}, heads, "
                             f"{q.shape[3]}] like q, got {t.shape}")
    if (sin is None) != (cos is None):
        raise ValueError(f"{op}: give both sin and cos, or neither")
    if sin is None:
        n = q.shape[1] if position_ids is None else None
        if n is None:
            raise ValueError(f"{op}: position_ids need sin and cos tables")
        s, c = rotary_tables(n, q.shape[3], use_neox_rotary_style, rotary_emb_base)
        sin, cos = constant(s, s.dtype, like=q), constant(c, c.dtype, like=q)
    sin, cos = _table(op, "sin", sin, q), _table(op, "cos", cos, q)
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: sin {sin.shape} and cos {cos.shape} must have one shape")
    pos = None if position_ids is None else as_tensor(position_ids)
    if pos is not None and np.dtype(pos.dtype).kind not in "iu":
        raise TypeError(f"{op}: position_ids must be integers, got {np.dtype(pos.dtype).name}")
    for t in ts:
        if t is not None:
            rotary_shapes(op, tuple(t.shape), tuple(sin.shape), tuple(cos.shape),
                          None if pos is None else tuple(pos.shape))
    attrs = {"neox": bool(use_neox_rotary_style), "transpose": False}
    return tuple(None if t is None else apply(OPS[_OP], (t, sin, cos, pos), attrs) for t in ts)
