"""numpy-only references of the transformer ops: fused attention (and its grad, written with
the whole probability matrix), rms_norm, rotary embedding and swiglu (and their grads)."""
from __future__ import annotations

import math

import numpy as np

_M64 = (1 << 64) - 1


def _splitmix(z):
    """splitmix64 on Python ints (the dropout hash, written out independently)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def dropout_keep(seed: int, p: float, shape) -> np.ndarray:
    """The keep-mask of dropout for ``seed`` over a tensor of ``shape``: element n (row-major)
    is kept when ``splitmix64(key + n * golden) / 2^64 >= p`` with ``key = splitmix64(seed)``."""
    n = np.arange(int(np.prod(shape)), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (n + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(_splitmix(seed))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (u >= p).reshape(shape)


def attention_probs(q, k, mask, is_causal, scale):
    """Scores ``[b, h, sq, sk]`` (float64) after the masks, and their softmax (rows with no
    kept key: zeros)."""
    _, sq, h, _ = q.shape
    g = h // k.shape[2]
    kk = np.repeat(np.asarray(k, np.float64), g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), kk) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask
    if is_causal:
        s = np.where(np.tril(np.ones((sq, k.shape[1]), bool)), s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isinf(mx), 0.0, mx)
    e = np.exp(s - mx)
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot == 0, 1.0, tot)
    with np.errstate(divide="ignore"):
        lse = np.where(tot[..., 0] == 0, -np.inf, mx[..., 0] + np.log(tot[..., 0]))
    return p, lse


def _attention(a, k, o):
    q, key, v, mask = a
    p, lse = attention_probs(q, key, mask, k["is_causal"], k["scale"])
    seed = int(o[2]) if k["dropout_p"] else 0
    if k["dropout_p"]:
        p = p * dropout_keep(seed, k["dropout_p"], p.shape) / (1.0 - k["dropout_p"])
    vv = np.repeat(np.asarray(v, np.float64), q.shape[2] // v.shape[2], axis=2)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    return out.astype(q.dtype), lse.astype(q.dtype), np.asarray(np.uint64(seed))


def _attention_grad(a, k, o):
    q, key, v, mask, _, _, seed, dout = a
    g = q.shape[2] // key.shape[2]
    p, _ = attention_probs(q, key, mask, k["is_causal"], k["scale"])
    pd = p
    if k["dropout_p"]:
        pd = p * dropout_keep(int(seed), k["dropout_p"], p.shape) / (1.0 - k["dropout_p"])
    vv = np.repeat(np.asarray(v, np.float64), g, axis=2)
    dv = np.einsum("bhqk,bqhd->bkhd", pd, dout)
    dpd = np.einsum("bqhd,bkhd->bhqk", dout, vv)
    dp = dpd * np.where(p > 0, pd / np.where(p > 0, p, 1.0), 0.0)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * k["scale"]
    kk = np.repeat(np.asarray(key, np.float64), g, axis=2)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q)

    def fold(t):  # sum the query heads of one key/value head
        b, s, h, d = t.shape
        return t.reshape(b, s, h // g, g, d).sum(3)
    return dq.astype(q.dtype), fold(dk).astype(q.dtype), fold(dv).astype(q.dtype)


def rms(x, begin, eps):
    axes = tuple(range(begin, x.ndim))
    return 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)


def _rms_norm(a, k, o):
    x, w = a
    b = k["begin_norm_axis"]
    r = rms(x, b, k["epsilon"])
    out = x * r * (1.0 if w is None else w)
    return out, r.reshape(x.shape[:b])


def _rms_norm_grad(a, k, o):
    """The vector-Jacobian product from d out_j / d x_i = r w_j (δij - x_j x_i r² / n)."""
    x, w, rstd, dout = a
    b = k["begin_norm_axis"]
    n = int(np.prod(x.shape[b:]))
    r = rstd.reshape(x.shape[:b] + (1,) * (x.ndim - b))
    wd = dout * (1.0 if w is None else w)
    axes = tuple(range(b, x.ndim))
    dx = r * wd - x * r ** 3 * (wd * x).sum(axis=axes, keepdims=True) / n
    dw = (dout * x * r).sum(axis=tuple(range(b)))
    return dx, dw


def rotate(x, neox):
    d = x.shape[-1]
    if neox:
        return np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    pairs = x.reshape(x.shape[:-1] + (d // 2, 2))
    return np.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def _rotary(a, k, o):
    x, sin, cos, pos = a
    if pos is not None:
        sin, cos = sin[0][pos], cos[0][pos]
    if k["transpose"]:  # the transposed map: x cos + rotate^T(x sin), rotate^T = -rotate
        return ((x * cos - rotate(x * sin, k["neox"])).astype(x.dtype),)
    return ((x * cos + rotate(x, k["neox"]) * sin).astype(x.dtype),)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _swiglu_grad(a, k, o):
    x, y, g = a
    s = 1.0 / (1.0 + np.exp(-x))
    return g * y * (s + x * s * (1.0 - s)), g * _silu(x)


REFERENCES = {
    "scaled_dot_product_attention": _attention,
    "scaled_dot_product_attention_grad": _attention_grad,
    "rms_norm": _rms_norm,
    "rms_norm_grad": _rms_norm_grad,
    "fused_rotary_position_embedding": _rotary,
    "swiglu": lambda a, k, o: (_silu(a[0]) * a[1],),
    "swiglu_grad": _swiglu_grad,
}

__all__ = ["REFERENCES", "attention_probs", "dropout_keep", "rotate", "rms", "math"]
