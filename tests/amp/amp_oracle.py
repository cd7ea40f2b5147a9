"""numpy-only oracles shared by the mixed-precision tests: bfloat16 rounding through ml_dtypes
and one O1 step of a two-layer model written out by hand."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def bf(a) -> np.ndarray:
    """``a`` rounded to bfloat16 and back to float32."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def is_bf16_exact(a) -> bool:
    """Every value of ``a`` is a bfloat16 number (it went through bfloat16)."""
    a = np.asarray(a, np.float32)
    return bool(np.array_equal(bf(a), a))


def model_arrays(draw: int = 0, n: int = 6, k: int = 8, h: int = 5):
    """x [n, k], w [k, h], b [h] in float32."""
    rng = np.random.default_rng(draw)
    return (rng.standard_normal((n, k)).astype(np.float32),
            rng.standard_normal((k, h)).astype(np.float32),
            rng.standard_normal(h).astype(np.float32))


def o1_step(x, w, b):
    """Under bfloat16 O1: ``y = x @ w`` (white: inputs rounded, product rounded), ``z = y + b``
    (float32: promotion), ``loss = mean(exp(z) ** 2)`` (black, float32). Returns the loss and
    the gradients of w (the bfloat16 product's gradient, cast back) and b."""
    xb, wb = bf(x), bf(w)
    y = bf(xb @ wb)
    z = y + b
    e = np.exp(z)
    loss = np.mean(e ** 2, dtype=np.float32)
    dz = (2.0 * e * e / z.size).astype(np.float32)
    db = dz.sum(0)
    dy = bf(dz)                        # the gradient enters the matmul in its output dtype
    dw = bf(xb.T @ dy)
    return np.float32(loss), dw, db
