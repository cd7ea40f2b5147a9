"""Samples of the transformer ops: fused attention (GQA 1:1, 2:1, 4:1; bool and additive masks;
causal; dropout with a fixed seed), rms_norm, rotary embedding (both styles, with and without
position ids) and swiglu; sizes that do not divide by 2, 3 or 4 included."""
from __future__ import annotations

import math

import numpy as np


def _n(rng, *shape):
    return rng.standard_normal(shape)


def _attention(b, sq, sk, h, hk, d, dv=None, mask=None, causal=False, p=0.0, seed=0):
    def build(rng):
        arrays = [_n(rng, b, sq, h, d), _n(rng, b, sk, hk, d), _n(rng, b, sk, hk, dv or d), None]
        if mask == "bool":
            m = rng.random((b, 1, sq, sk)) < 0.7
            m[..., 0] = True
            arrays[3] = m
        elif mask == "add":
            arrays[3] = rng.standard_normal((1, h, sq, sk))
        elif mask == "bool2d":
            arrays[3] = rng.random((sq, sk)) < 0.6
        return arrays, {"is_causal": causal, "dropout_p": p, "seed": seed,
                        "scale": 1.0 / math.sqrt(d)}
    return build


def _rms(shape, k, weight=True):
    def build(rng):
        tail = shape[len(shape) - k:]
        return ([_n(rng, *shape), _n(rng, *tail) if weight else None],
                {"begin_norm_axis": len(shape) - k, "epsilon": 1e-5})
    return build


def _rope(b, s, h, d, neox, pos=False, transpose=False):
    def build(rng):
        smax = s + 3 if pos else s
        ang = rng.uniform(-3, 3, (1, smax, 1, d))
        ids = rng.integers(0, smax, (b, s)).astype(np.int64) if pos else None
        return ([_n(rng, b, s, h, d), np.sin(ang), np.cos(ang), ids],
                {"neox": neox, "transpose": transpose})
    return build


SAMPLES: dict[str, list] = {
    "scaled_dot_product_attention": [
        _attention(2, 3, 4, 2, 2, 3),
        _attention(3, 5, 7, 4, 2, 2, dv=3, causal=True),            # GQA 2:1, uneven sizes
        _attention(2, 5, 5, 4, 1, 2, mask="bool"),                   # GQA 4:1
        _attention(1, 4, 3, 3, 3, 2, mask="add", causal=True),       # 3 heads
        _attention(2, 4, 6, 2, 1, 2, mask="bool2d", p=0.3, seed=5),  # dropout
    ],
    "rms_norm": [_rms((3, 4), 1), _rms((2, 5, 3), 2), _rms((5, 7), 1, weight=False)],
    "fused_rotary_position_embedding": [_rope(2, 5, 3, 4, True), _rope(3, 4, 2, 6, False),
                         _rope(2, 5, 2, 4, False, pos=True), _rope(1, 3, 2, 4, True, True, True)],
    "swiglu": [lambda rng: ([_n(rng, 5, 7), _n(rng, 5, 7)], {}),
               lambda rng: ([_n(rng, 2, 3, 4), _n(rng, 2, 3, 4)], {})],
}
