"""numpy-only forward passes of examples/gpt2.py and examples/llama.py (the mean next-token
cross entropy from a dict of global parameter arrays), and their gradients by central
differences: the oracle the examples' values and gradients are checked against."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

_erf = np.vectorize(math.erf)


def _linear(p: dict, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ p[name + ".weight"]
    return y + p[name + ".bias"] if name + ".bias" in p else y


def _layer_norm(p: dict, name: str, x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p[name + ".weight"] + p[name + ".bias"]


def _rms_norm(p: dict, name: str, x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * p[name + ".weight"]


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention over ``[b, s, heads, d]``; kv head ``h // (hq / hkv)`` serves query
    head h."""
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.reshape(-1, logits.shape[-1])
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(z.shape[0]), targets.reshape(-1)].mean())


def gpt2_loss(p: dict, idx: np.ndarray, targets: np.ndarray, n_layer: int, n_head: int) -> float:
    b, t = idx.shape
    x = p["wte.weight"][idx] + p["wpe.weight"][np.arange(t)]
    c = x.shape[-1]
    for i in range(n_layer):
        pre = f"h.{i}."
        q, k, v = np.split(_linear(p, pre + "attn.c_attn", _layer_norm(p, pre + "ln_1", x)), 3, -1)
        heads = [a.reshape(b, t, n_head, c // n_head) for a in (q, k, v)]
        x = x + _linear(p, pre + "attn.c_proj", _attention(*heads).reshape(b, t, c))
        h = _linear(p, pre + "mlp.c_fc", _layer_norm(p, pre + "ln_2", x))
        x = x + _linear(p, pre + "mlp.c_proj", 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0))))
    return _cross_entropy(_layer_norm(p, "ln_f", x) @ p["wte.weight"].T, targets)


def _rotate_pairs(x: np.ndarray, sin: np.ndarray, cos: np.ndarray) -> np.ndarray:
    """llama2.c's complex multiply: pair (x0, x1) by angle a -> (x0 cos - x1 sin,
    x0 sin + x1 cos); ``sin``/``cos`` ``[s, d/2]``."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    s, c = sin[None, :, None, :], cos[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def llama_loss(p: dict, idx: np.ndarray, targets: np.ndarray, n_layer: int, n_heads: int,
               n_kv_heads: int) -> float:
    b, t = idx.shape
    h = p["tok_embeddings.weight"][idx]
    dim = h.shape[-1]
    hd = dim // n_heads
    ang = np.outer(np.arange(t), 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd))
    # the tables are float32, as llama2.c's precompute_freqs_cis makes them
    sin, cos = (f(ang).astype(np.float32).astype(np.float64) for f in (np.sin, np.cos))
    for i in range(n_layer):
        pre = f"layers.{i}."
        x = _rms_norm(p, pre + "attention_norm", h)
        q = _linear(p, pre + "attention.wq", x).reshape(b, t, n_heads, hd)
        k = _linear(p, pre + "attention.wk", x).reshape(b, t, n_kv_heads, hd)
        v = _linear(p, pre + "attention.wv", x).reshape(b, t, n_kv_heads, hd)
        q, k = _rotate_pairs(q, sin, cos), _rotate_pairs(k, sin, cos)
        h = h + _linear(p, pre + "attention.wo", _attention(q, k, v).reshape(b, t, dim))
        x = _rms_norm(p, pre + "ffn_norm", h)
        a, g = _linear(p, pre + "feed_forward.w1", x), _linear(p, pre + "feed_forward.w3", x)
        h = h + _linear(p, pre + "feed_forward.w2", a / (1.0 + np.exp(-a)) * g)
    return _cross_entropy(_rms_norm(p, "norm", h) @ p["tok_embeddings.weight"].T, targets)


def numeric_grads(loss: Callable[[dict], float], params: dict, per_param: int = 32,
                  eps: float = 1e-6, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Central differences of ``loss`` at ``per_param`` random elements of each (float64)
    parameter (all of a smaller one): name -> (flat indices, gradient values there)."""
    rng = np.random.default_rng(seed)
    grads = {}
    for name, a in params.items():
        flat = a.reshape(-1)
        at = np.arange(flat.size) if flat.size <= per_param else \
            np.sort(rng.choice(flat.size, per_param, replace=False))
        g = np.empty(at.size)
        for j, i in enumerate(at):
            old = flat[i]
            flat[i] = old + eps
            up = loss(params)
            flat[i] = old - eps
            down = loss(params)
            flat[i] = old
            g[j] = (up - down) / (2 * eps)
        grads[name] = (at, g)
    return grads
