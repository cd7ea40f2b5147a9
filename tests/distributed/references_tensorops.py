"""numpy-only references of the tensor ops (merged into numpy_reference.REFERENCES)."""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _one(fn):
    return lambda a, k, o: (fn(*a),)


def _axis(k):
    return tuple(k["axis"])


def _logsumexp(a, k, o):
    x = a[0]
    m = x.max(axis=_axis(k), keepdims=True)
    out = np.log(np.exp(x - m).sum(axis=_axis(k), keepdims=True)) + m
    return (out if k["keepdim"] else np.squeeze(out, _axis(k)),)


def _desc_order(x, axis):
    """Stable descending argsort (equal elements keep their order)."""
    return np.argsort(-x, axis=axis, kind="stable")


def _order(x, axis, descending):
    return _desc_order(x, axis) if descending else np.argsort(x, axis=axis, kind="stable")


def _sort(a, k, o):
    idx = _order(a[0], k["axis"], k["descending"])
    return np.take_along_axis(a[0], idx, k["axis"]), idx


def _topk(a, k, o):
    idx = np.take(_order(a[0], k["axis"], k["largest"]), range(k["k"]), axis=k["axis"])
    return np.take_along_axis(a[0], idx, k["axis"]), idx


def _cumsum(a, k, o):
    x, axis = a[0], k["axis"]
    if k["reverse"]:
        return (np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis),)
    return (np.cumsum(x, axis=axis),)


def _repeat_grad(a, k, o):
    g, axis, reps = a[0], k["axis"], k["repeats"]
    starts = np.concatenate([[0], np.cumsum(reps)])
    parts = [np.take(g, range(starts[j], starts[j + 1]), axis=axis).sum(axis=axis)
             for j in range(len(reps))]
    return (np.stack(parts, axis=axis),)


def _full_index(index, axis):
    grids = list(np.indices(index.shape, sparse=True))
    grids[axis] = index
    return tuple(grids)


def _take_grad(a, k, o):
    index, g = a
    shape = list(g.shape)
    shape[k["axis"]] = k["input_shape"][k["axis"]]
    dx = np.zeros(shape)
    np.add.at(dx, _full_index(index, k["axis"]), g)
    return (dx,)


def _put(a, k, o):
    x, index, values = a
    out = x.copy()
    if k["reduce"] == "assign":
        np.put_along_axis(out, index, values, k["axis"])
    else:
        np.add.at(out, _full_index(index, k["axis"]), values)
    return (out,)


def _scatter(a, k, o):
    x, ids, value = a
    out = x.copy()
    region = out[k["index"]]
    axis = k["axis"]
    moved = np.moveaxis(region, axis, 0)
    vals = np.moveaxis(value, axis, 0)
    if k["overwrite"]:
        for j, i in enumerate(ids):  # in order: the last of repeated indices wins
            moved[i] = vals[j]
    else:
        moved[ids] = 0
        for j, i in enumerate(ids):
            moved[i] += vals[j]
    return (out,)


# the counter-based uniforms: splitmix64 of (seed, global row-major index)
_M = (1 << 64) - 1
_G, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix(z: int) -> int:
    z = (z + _G) & _M
    z = ((z ^ (z >> 30)) * _C1) & _M
    z = ((z ^ (z >> 27)) * _C2) & _M
    return z ^ (z >> 31)


def _uniforms(seed: int, shape) -> np.ndarray:
    key = _splitmix(seed)
    out = np.empty(int(np.prod(shape)))
    for i in range(out.size):
        z = ((i + 1) * _G + key) & _M
        z = ((z ^ (z >> 30)) * _C1) & _M
        z = ((z ^ (z >> 27)) * _C2) & _M
        z ^= z >> 31
        out[i] = (z >> 11) * (1.0 / (1 << 53))
    return out.reshape(shape)


def _multinomial(a, k, o):
    p = np.atleast_2d(a[0]).astype(np.float64)
    rows, cats = p.shape
    s = k["num_samples"]
    if k["replacement"]:
        u = _uniforms(k["seed"], (rows, s))
        cdf = np.cumsum(p, axis=1)
        cdf = cdf / cdf[:, -1:]
        out = np.array([[np.searchsorted(cdf[r], u[r, j], side="right") for j in range(s)]
                        for r in range(rows)])
    else:
        u = _uniforms(k["seed"], (rows, cats))
        with np.errstate(divide="ignore"):
            keys = -np.log1p(-u) / p
        out = np.argsort(keys, axis=1, kind="stable")[:, :s]
    return (out.astype(np.int64).reshape(a[0].shape[:-1] + (s,)),)


REFERENCES = {
    "sin": _one(np.sin), "cos": _one(np.cos), "erf": _one(_erf), "square": _one(np.square),
    "reciprocal": _one(lambda x: 1.0 / x), "log1p": _one(np.log1p), "floor": _one(np.floor),
    "sign": _one(np.sign),
    "sin_grad": _one(lambda x, g: g * np.cos(x)), "cos_grad": _one(lambda x, g: -g * np.sin(x)),
    "erf_grad": _one(lambda x, g: g * 2.0 / math.sqrt(math.pi) * np.exp(-x * x)),
    "square_grad": _one(lambda x, g: 2.0 * x * g),
    "reciprocal_grad": _one(lambda out, g: -g * out * out),
    "log1p_grad": _one(lambda x, g: g / (1.0 + x)),
    "masked_fill": lambda a, k, o: (np.where(a[1], a[2], a[0]).astype(a[0].dtype),),
    "tril": lambda a, k, o: (np.tril(a[0], k["diagonal"]),),
    "triu": lambda a, k, o: (np.triu(a[0], k["diagonal"]),),
    "einsum": lambda a, k, o: (np.einsum(k["equation"], *a),),
    "outer": lambda a, k, o: (np.outer(a[0], a[1]),),
    "logsumexp": _logsumexp,
    "var": lambda a, k, o: (np.var(a[0], axis=_axis(k), ddof=int(k["unbiased"]),
                                   keepdims=k["keepdim"]),),
    "std": lambda a, k, o: (np.std(a[0], axis=_axis(k), ddof=int(k["unbiased"]),
                                   keepdims=k["keepdim"]),),
    "norm": lambda a, k, o: (np.sqrt((a[0] ** 2).sum(axis=_axis(k), keepdims=k["keepdim"])),),
    "sort": _sort, "topk": _topk,
    "argsort": lambda a, k, o: (_order(a[0], k["axis"], k["descending"]),),
    "cumsum": _cumsum,
    "flip": lambda a, k, o: (np.flip(a[0], k["axes"]),),
    "roll": lambda a, k, o: (np.roll(a[0], k["shifts"], k["axes"]),),
    "unbind": lambda a, k, o: tuple(np.take(a[0], i, axis=k["axis"])
                                    for i in range(a[0].shape[k["axis"]])),
    "repeat_interleave": lambda a, k, o: (np.repeat(a[0], k["repeats"], axis=k["axis"]),),
    "repeat_interleave_grad": _repeat_grad,
    "take_along_axis": lambda a, k, o: (np.take_along_axis(a[0], a[1], k["axis"]),),
    "take_along_axis_grad": _take_grad,
    "put_along_axis": _put, "scatter": _scatter, "multinomial": _multinomial,
}
