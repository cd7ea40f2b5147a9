"""GPT-2 as nanoGPT's ``model.py`` writes it (a fused ``c_attn`` projection split into q, k,
v; causal attention; a GELU MLP; the ``lm_head`` tied to the token embedding), on disttensor's
Paddle API, trained on a [dp, mp] mesh: c_attn and c_fc column-parallel, the c_proj layers
row-parallel, the token embedding vocab-parallel, the batch on dp.

    mpirun -n 4 python examples/gpt2.py                   # 2 x 2 [dp, mp], eager
    mpirun -n 4 python examples/gpt2.py --to-static       # each step a captured program
    mpirun -n 4 python examples/gpt2.py --generate 16     # then sample 16 tokens
    python examples/gpt2.py --dense                       # one process, no mesh
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import language_model  # noqa: E402

import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor import nn  # noqa: E402


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        bias = None if config.bias else False
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias_attr=bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias_attr=bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(3, axis=2)
        q = q.reshape([B, T, self.n_head, C // self.n_head])   # Paddle's [b, s, heads, d]
        k = k.reshape([B, T, self.n_head, C // self.n_head])
        v = v.reshape([B, T, self.n_head, C // self.n_head])
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True,
                                           training=self.training)
        return self.resid_dropout(self.c_proj(y.reshape([B, T, C])))


class MLP(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        bias = None if config.bias else False
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias_attr=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias_attr=bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Layer):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config, self.block_size = config, config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.LayerList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        # lm_head is wte's matrix (weight tying): logits = x @ wte.weight^T

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(dt.arange(t)))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:  # inference: only the last position's logits
            return dt.matmul(x[:, [-1], :], self.wte.weight, transpose_y=True), None
        logits = dt.matmul(x, self.wte.weight, transpose_y=True)
        return logits, language_model.lm_loss(logits, targets)


# Megatron: c_attn/c_fc column-parallel (c_attn's q, k, v sections each split over mp, so
# the split after it needs no reshard), both c_proj row-parallel, the tied embedding
# vocab-parallel (the head's logits sharded on the vocabulary).
PLAN = {
    "wte": dt.RowWiseParallel(),
    r"h\.\d+\.attn\.c_attn": dt.ColWiseParallel(split_factor=3),
    r"h\.\d+\.mlp\.c_fc": dt.ColWiseParallel(),
    r"h\.\d+\.(attn|mlp)\.c_proj": dt.RowWiseParallel(),
}


def build(args: argparse.Namespace) -> GPT:
    return GPT(GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.dim))


if __name__ == "__main__":
    language_model.main(build, PLAN, __doc__.split("\n\n")[0])
