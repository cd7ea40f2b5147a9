"""LLaMA as llama2.c's ``model.py`` writes it (RMSNorm, rotary embeddings in the complex
pair form, grouped-query attention, a SwiGLU feed-forward, the output head tied to the token
embedding), on disttensor's Paddle API, trained on a [dp, mp] mesh with the Megatron layout:
wq/wk/wv and w1/w3 column-parallel (heads over mp), wo and w2 row-parallel, the embedding
vocab-parallel, the batch on dp.

    mpirun -n 4 python examples/llama.py                  # 2 x 2 [dp, mp], eager
    mpirun -n 4 python examples/llama.py --to-static      # each step a captured program
    mpirun -n 4 python examples/llama.py --generate 16    # then sample 16 tokens
    python examples/llama.py --dense                      # one process, no mesh
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import language_model  # noqa: E402

import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor import nn  # noqa: E402
from disttensor.incubate.nn.functional import fused_rotary_position_embedding, swiglu  # noqa: E402


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 64
    multiple_of: int = 16
    norm_eps: float = 1e-5
    max_seq_len: int = 16


def precompute_freqs(dim: int, end: int, theta: float = 10000.0) -> tuple[np.ndarray, ...]:
    """sin/cos ``[1, end, 1, dim]`` of the angles ``t * theta^(-2i/dim)``, each angle twice
    (adjacent pairs rotate together, as llama2.c's complex multiply)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2)[: dim // 2] / dim)
    ang = np.repeat(np.outer(np.arange(end), freqs), 2, axis=-1)[None, :, None, :]
    return np.sin(ang).astype(np.float32), np.cos(ang).astype(np.float32)


class Attention(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias_attr=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias_attr=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias_attr=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias_attr=False)

    def forward(self, x, freqs_sin, freqs_cos):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).reshape([bsz, seqlen, self.n_heads, self.head_dim])
        xk = self.wk(x).reshape([bsz, seqlen, self.n_kv_heads, self.head_dim])
        xv = self.wv(x).reshape([bsz, seqlen, self.n_kv_heads, self.head_dim])
        xq, xk, _ = fused_rotary_position_embedding(xq, xk, sin=freqs_sin, cos=freqs_cos,
                                                    use_neox_rotary_style=False)
        # grouped-query attention: the fused op reads each kv head for its query heads
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, training=self.training)
        return self.wo(out.reshape([bsz, seqlen, -1]))


class FeedForward(nn.Layer):
    def __init__(self, dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * 4 * dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias_attr=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias_attr=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias_attr=False)

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Layer):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, epsilon=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, epsilon=args.norm_eps)

    def forward(self, x, freqs_sin, freqs_cos):
        h = x + self.attention(self.attention_norm(x), freqs_sin, freqs_cos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Layer):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params, self.block_size = params, params.max_seq_len
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.LayerList([TransformerBlock(params) for _ in range(params.n_layers)])
        self.norm = nn.RMSNorm(params.dim, epsilon=params.norm_eps)
        # the output head is the embedding matrix (weight tying): logits = h @ E^T
        sin, cos = precompute_freqs(params.dim // params.n_heads, params.max_seq_len)
        self.register_buffer("freqs_sin", dt.to_tensor(sin), persistable=False)
        self.register_buffer("freqs_cos", dt.to_tensor(cos), persistable=False)

    def forward(self, tokens, targets=None):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_sin, freqs_cos = self.freqs_sin[:, :seqlen], self.freqs_cos[:, :seqlen]
        for layer in self.layers:
            h = layer(h, freqs_sin, freqs_cos)
        h = self.norm(h)
        if targets is None:  # inference: only the last position's logits
            return dt.matmul(h[:, [-1], :], self.tok_embeddings.weight, transpose_y=True), None
        logits = dt.matmul(h, self.tok_embeddings.weight, transpose_y=True)
        return logits, language_model.lm_loss(logits, targets)


# Megatron: heads over mp (column-parallel q/k/v and w1/w3, row-parallel wo/w2); the tied
# embedding vocab-parallel, so the head's logits come out sharded on the vocabulary.
PLAN = {
    "tok_embeddings": dt.RowWiseParallel(),
    r"layers\.\d+\.attention\.(wq|wk|wv)": dt.ColWiseParallel(),
    r"layers\.\d+\.attention\.wo": dt.RowWiseParallel(),
    r"layers\.\d+\.feed_forward\.(w1|w3)": dt.ColWiseParallel(),
    r"layers\.\d+\.feed_forward\.w2": dt.RowWiseParallel(),
}


def build(args: argparse.Namespace) -> Transformer:
    return Transformer(ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                 n_kv_heads=max(1, args.heads // 2), vocab_size=args.vocab,
                                 max_seq_len=args.seq))


if __name__ == "__main__":
    language_model.main(build, PLAN, __doc__.split("\n\n")[0])
