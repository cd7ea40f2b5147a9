"""Paddle's ``nn.MultiHeadAttention`` on the fused
:func:`~disttensor.nn.functional.scaled_dot_product_attention`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import reshape
from ..tensor import Tensor
from . import functional as F
from .common import Linear
from .layer import Layer

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Layer):
    """Multi-head attention with batch-first ``[batch, seq, embed_dim]`` inputs:
    ``out_proj(attention(q_proj(query), k_proj(key), v_proj(value)))`` over ``num_heads`` heads
    of ``embed_dim // num_heads`` dims. ``key`` defaults to ``query``, ``value`` to ``key``;
    ``attn_mask`` (bool, True keeps, or additive) broadcasts to ``[batch, num_heads, seq_q,
    seq_k]``; ``dropout`` drops attention probabilities in training. The fused op never forms
    the probabilities, so ``need_weights=True`` and ``cache`` are refused.

    Example::

        mha = dt.nn.MultiHeadAttention(32, 4)
        y = mha(dt.randn([2, 8, 32]))        # [2, 8, 32]
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 kdim: int | None = None, vdim: int | None = None, need_weights: bool = False,
                 weight_attr: Any = None, bias_attr: Any = None, name: str | None = None):
        super().__init__()
        for arg, n in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
                raise ValueError(f"MultiHeadAttention: {arg} must be a positive int, got {n!r}")
        if embed_dim % num_heads:
            raise ValueError(f"MultiHeadAttention: embed_dim {embed_dim} must be divisible by "
                             f"num_heads {num_heads}")
        if need_weights:
            raise ValueError("MultiHeadAttention: need_weights=True is not supported: the fused "
                             "attention never forms the [seq_q, seq_k] weights")
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.head_dim = self.embed_dim // self.num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout = float(dropout)
        self.need_weights = False
        self.q_proj = Linear(self.embed_dim, self.embed_dim, weight_attr, bias_attr)
        self.k_proj = Linear(self.kdim, self.embed_dim, weight_attr, bias_attr)
        self.v_proj = Linear(self.vdim, self.embed_dim, weight_attr, bias_attr)
        self.out_proj = Linear(self.embed_dim, self.embed_dim, weight_attr, bias_attr)

    def _heads(self, x: Tensor) -> Tensor:
        return reshape(x, [x.shape[0], x.shape[1], self.num_heads, self.head_dim])

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                attn_mask: Tensor | None = None, cache: Any = None) -> Tensor:
        if cache is not None:
            raise ValueError("MultiHeadAttention: cache is not supported")
        key = query if key is None else key
        value = key if value is None else value
        for arg, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if t.ndim != 3 or t.shape[-1] != width:
                raise ValueError(f"MultiHeadAttention: {arg} must be [batch, seq, {width}], got "
                                 f"{t.shape}")
        q = self._heads(self.q_proj(query))
        k = self._heads(self.k_proj(key))
        v = self._heads(self.v_proj(value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, self.dropout,
                                             training=self.training)
        return self.out_proj(reshape(out, [out.shape[0], out.shape[1], self.embed_dim]))

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}"
