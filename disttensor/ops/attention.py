"""Fused scaled dot-product attention (Paddle's ``F.scaled_dot_product_attention``).

One op computes ``softmax(q k^T * scale + mask) v`` per head in Paddle's layout
``[batch, seq, heads, head_dim]``; key/value may have fewer heads than the query (grouped-query
attention: query head i reads key/value head ``i // (h / hk)``, as PyTorch's ``enable_gqa``),
which is never materialised: the queries of one key/value head are stacked into the rows of one
matrix. The kernel walks the keys in blocks with an online softmax (running row max and sum), so
it never holds the ``[sq, sk]`` probabilities of all keys; the backward saves the output and
the row log-sum-exp (O(s·d) bytes) and recomputes each block's probabilities.

Masks: ``attn_mask`` bool (True keeps) or additive, broadcastable to ``[b, h, sq, sk]``;
``is_causal`` keeps key j for query i when ``j <= i`` (top-left aligned, as PyTorch), combined
with ``attn_mask`` when both are given. A query row with no kept key gives zeros (and a zero
gradient). Dropout zeros probabilities with a counter-based mask of the global
``[b, h, sq, sk]`` index (the one :func:`~disttensor.ops.random.keep_mask` gives dropout), so
it does not depend on the placements; the seed is drawn when the kernel runs and returned for
the backward.
"""
from __future__ import annotations

import math

import numpy as np

from spmd_rules.attention import attention_shapes

from ..dispatch import apply
from ..generator import default_generator
from ..schema import OPS, DtypeMismatch, public, register
from ..tensor import Tensor
from . import fast
from .common import as_tensor
from .random import keep_mask

__all__ = ["scaled_dot_product_attention"]

#: elements of one [rows, key block] score tile (about 16 MiB in float32)
_TILE = 1 << 22


def _group(h: int, hk: int) -> int:
    """Query heads per key/value head (a piece may hold no head)."""
    return h // hk if hk else 1


def _grouped(xp, t, hk):
    """``[b, s, h, d] -> [b, hk, (h / hk) * s, d]``: the queries of one key/value head as rows
    (always a fresh array: the kernels scale it in place)."""
    b, s, h, d = t.shape
    return t.transpose(0, 2, 1, 3).copy().reshape(b, hk, _group(h, hk) * s, d)


def _ungrouped(xp, t, h, s):
    """The inverse of :func:`_grouped`."""
    return t.reshape(t.shape[0], h, s, t.shape[3]).transpose(0, 2, 1, 3)


class _Blocks:
    """The key blocks of one attention call and, per block, the scores' mask terms: the causal
    and bool masks as one keep-array, an additive mask, the dropout keep-array (all shaped to
    broadcast against the ``[b, hk, g * sq, kb]`` score tile)."""

    def __init__(self, xp, q, k, mask, is_causal, dropout_p, seed, ctx):
        self.xp, self.dtype = xp, q.dtype
        b, sq, h, _ = q.shape
        self.sk, hk = k.shape[1], k.shape[2]
        self.shape5 = (b, hk, _group(h, hk), sq)
        rows = b * h * sq
        self.kb = max(16, min(self.sk, _TILE // max(rows, 1)))
        self.q0 = ctx.offset(0, 1)
        self.is_causal, self.p, self.seed = is_causal, dropout_p, seed
        self.mask = None if mask is None else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        gq = ctx.global_shape(0, q.shape)
        self.global_shape = (gq[0], gq[2], gq[1], self.sk)
        self.offsets = (ctx.offset(0, 0), ctx.offset(0, 2), self.q0)

    def ranges(self):
        """(k0, k1) per block; under a causal mask the blocks after the last query's key are
        skipped."""
        sq = self.shape5[3]
        end = min(self.sk, self.q0 + sq) if self.is_causal else self.sk
        return [(k0, min(k0 + self.kb, end)) for k0 in range(0, end, self.kb)]

    def _rows(self, a):
        """A ``[b|1, h|1, sq|1, kb]`` mask block as ``[b|1, hk|1, g * sq|1, kb]``."""
        _, hk, g, sq = self.shape5
        if a.shape[1] == 1 and a.shape[2] == 1:
            return a
        return self.xp.broadcast_to(a, (a.shape[0], hk * g, sq, a.shape[3])).reshape(
            a.shape[0], hk, g * sq, a.shape[3])

    def add_masks(self, s, k0, k1):
        """Apply the masks to the score tile ``s`` of keys [k0, k1) in place."""
        xp = self.xp
        keep = None
        if self.is_causal:
            sq = self.shape5[3]
            qi = xp.arange(self.q0, self.q0 + sq)[:, None]
            keep = xp.tile(xp.arange(k0, k1)[None, :] <= qi, (self.shape5[2], 1))
        if self.mask is not None:
            m = self._rows(self.mask[..., k0:k1])
            if m.dtype == np.bool_:
                keep = m if keep is None else keep & m
            else:
                s += m
        if keep is not None:
            xp.putmask(s, ~xp.broadcast_to(keep, s.shape), -np.inf)

    def dropout(self, k0, k1):
        """The kept probabilities' factor ``keep / (1 - p)`` of keys [k0, k1), or None."""
        if not self.p:
            return None
        b, hk, g, sq = self.shape5
        keep = keep_mask(self.xp, self.seed, self.p, (b, hk * g, sq, k1 - k0),
                         self.global_shape, self.offsets + (k0,))
        return self.xp.multiply(keep.reshape(b, hk, g * sq, k1 - k0), 1.0 / (1.0 - self.p),
                                dtype=self.dtype)


def _softmax_block_np(xp, s, m, lsum):
    """One key block of the online softmax, in place: the running row max ``m`` takes the
    block's, ``s = exp(s - shift)`` (shift 0 while a row has no kept key), ``lsum`` is rescaled
    by ``alpha = exp(m_old - shift)`` and gains the block's row sums; returns alpha."""
    m_new = xp.maximum(m, s.max(axis=-1))
    shift = xp.where(xp.isinf(m_new), 0.0, m_new).astype(s.dtype, copy=False)
    s -= shift[..., None]
    xp.exp(s, out=s)
    alpha = xp.exp(m - shift)
    lsum *= alpha
    lsum += s.sum(axis=-1)
    m[...] = m_new
    return alpha


def _grad_block_np(xp, p, dp, lse, delta):
    """One key block of the backward, in place: ``p = exp(p - lse)`` (the probabilities of the
    masked scores), ``dp = p * (dp - delta)`` (the scores' gradient before the scale)."""
    p -= lse[..., None]
    xp.exp(p, out=p)
    dp -= delta[..., None]
    dp *= p


_softmax_block = fast.attention_softmax(_softmax_block_np)
_grad_block = fast.attention_grad_rows(_grad_block_np)


def _attention_kernel(xp, q, k, v, mask, is_causal, dropout_p, seed, scale, ctx):
    """(out ``[b, sq, h, dv]``, lse ``[b, h, sq]``, seed) by an online softmax over key blocks."""
    if dropout_p and seed is None:
        seed = default_generator.next_seed()
    seed = 0 if seed is None else int(seed)
    hk = k.shape[2]
    blocks = _Blocks(xp, q, k, mask, is_causal, dropout_p, seed, ctx)
    qg = _grouped(xp, q, hk)
    qg *= scale
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    rows = qg.shape[:3]
    m = xp.full(rows, -np.inf, dtype=q.dtype)
    lsum = xp.zeros(rows, dtype=q.dtype)
    acc = xp.zeros(rows + (v.shape[3],), dtype=q.dtype)
    for k0, k1 in blocks.ranges():
        s = qg @ kt[:, :, k0:k1].swapaxes(-1, -2)
        blocks.add_masks(s, k0, k1)
        alpha = _softmax_block(xp, s, m, lsum)
        drop = blocks.dropout(k0, k1)
        if drop is not None:
            s *= drop
        acc *= alpha[..., None]
        acc += s @ vt[:, :, k0:k1]
    empty = lsum == 0
    acc /= xp.where(empty, 1.0, lsum)[..., None]
    with np.errstate(divide="ignore"):
        lse = xp.where(empty, -np.inf, m + xp.log(lsum)).astype(q.dtype, copy=False)
    b, sq, h, _ = q.shape
    out = xp.ascontiguousarray(_ungrouped(xp, acc, h, sq))
    return out, lse.reshape(b, h, sq), xp.asarray(np.uint64(seed))


def _attention_grad_kernel(xp, q, k, v, mask, out, lse, seed, dout, is_causal, dropout_p,
                           scale, ctx):
    """(dq, dk, dv): each key block's probabilities rebuilt from the log-sum-exp;
    ``ds = p * (dp - rowsum(dout * out))`` (FlashAttention's backward)."""
    hk = k.shape[2]
    blocks = _Blocks(xp, q, k, mask, is_causal, dropout_p, int(seed), ctx)
    qg = _grouped(xp, q, hk)
    qg *= scale
    dog, og = _grouped(xp, dout.astype(q.dtype, copy=False), hk), _grouped(xp, out, hk)
    delta = xp.einsum("...i,...i->...", dog, og)
    b, sq, h, _ = q.shape
    lse_g = lse.reshape(b, hk, _group(h, hk) * sq)
    lse_g = xp.where(xp.isinf(lse_g), np.inf, lse_g)  # rows with no key: p = 0
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    dqg = xp.zeros(qg.shape, dtype=q.dtype)
    dk = xp.zeros(kt.shape, dtype=q.dtype)
    dv = xp.zeros(vt.shape, dtype=q.dtype)
    for k0, k1 in blocks.ranges():
        kb, vb = kt[:, :, k0:k1], vt[:, :, k0:k1]
        p = qg @ kb.swapaxes(-1, -2)
        blocks.add_masks(p, k0, k1)
        dp = dog @ vb.swapaxes(-1, -2)
        drop = blocks.dropout(k0, k1)
        if drop is not None:
            dp *= drop
        _grad_block(xp, p, dp, lse_g, delta)  # p: probabilities, dp: score gradients
        dv[:, :, k0:k1] = (p if drop is None else p * drop).swapaxes(-1, -2) @ dog
        dqg += dp @ kb
        dk[:, :, k0:k1] = dp.swapaxes(-1, -2) @ qg
    dqg *= scale
    dq = xp.ascontiguousarray(_ungrouped(xp, dqg, h, sq))
    return dq, xp.ascontiguousarray(dk.transpose(0, 2, 1, 3)), \
        xp.ascontiguousarray(dv.transpose(0, 2, 1, 3))


def _attention_bwd(node, g, *_):
    q, k, v, mask, out, lse, seed = (node.saved_tensor(i) for i in range(7))
    attrs = {a: node.attrs[a] for a in ("is_causal", "dropout_p", "scale")}
    dq, dk, dv = apply(OPS["scaled_dot_product_attention_grad"],
                       (q, k, v, mask, out, lse, seed, g), attrs)
    return dq, dk, dv, None


def _dtypes(dtypes, attrs) -> tuple:
    q = np.dtype(dtypes[0])
    if q.kind != "f" or any(np.dtype(d) != q for d in dtypes[1:3]):
        raise DtypeMismatch(f"query, key and value must share one floating dtype, got "
                            f"{[np.dtype(d).name for d in dtypes[:3]]}")
    return q, q, np.dtype(np.uint64)


_dtypes.strict = True

register("scaled_dot_product_attention_grad", _attention_grad_kernel, rule="attention_grad",
         n_out=3, needs_ctx=True, dtype=lambda d, a: (np.dtype(d[0]),) * 3)
register("scaled_dot_product_attention", _attention_kernel, backward=_attention_bwd,
         rule="attention", n_out=3, needs_ctx=True, random=True, save_inputs=(0, 1, 2, 3),
         save_outputs=(0, 1, 2), nondiff_outputs=frozenset({1, 2}), grad_inputs=(0, 1, 2),
         dtype=_dtypes)


@public(export=False)
def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, training: bool = True,
                                 name: str | None = None) -> Tensor:
    """``softmax(query key^T / sqrt(head_dim) + mask) value`` per head, in one fused op.

    Layout ``[batch, seq, heads, head_dim]`` (Paddle's); key/value may have fewer heads that
    divide the query's (grouped-query attention). ``attn_mask``: bool (True keeps) or additive,
    broadcastable to ``[batch, heads, seq_q, seq_k]``; ``is_causal`` keeps keys ``j <= i``.
    ``dropout_p`` applies in training only (seeded by ``dt.seed``; the mask does not depend on
    the placements). Returns ``[batch, seq_q, heads, head_dim_v]``.

    Example::

        q = dt.randn([2, 16, 4, 8]); kv = dt.randn([2, 16, 1, 8])
        out = dt.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    """
    op = "scaled_dot_product_attention"
    query, key, value = as_tensor(query), as_tensor(key), as_tensor(value)
    if attn_mask is not None:
        attn_mask = as_tensor(attn_mask)
        if attn_mask.dtype != np.bool_ and attn_mask.dtype != query.dtype:
            raise TypeError(f"{op}: attn_mask must be bool or {np.dtype(query.dtype).name} like "
                            f"query, got {np.dtype(attn_mask.dtype).name}")
    if isinstance(dropout_p, bool) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{op}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    attention_shapes(op, tuple(query.shape), tuple(key.shape), tuple(value.shape),
                     None if attn_mask is None else tuple(attn_mask.shape))
    p = float(dropout_p) if training else 0.0
    attrs = {"is_causal": bool(is_causal), "dropout_p": p, "seed": None if p else 0,
             "scale": 1.0 / math.sqrt(query.shape[3]) if query.shape[3] else 1.0}
    return apply(OPS[op], (query, key, value, attn_mask), attrs)[0]
