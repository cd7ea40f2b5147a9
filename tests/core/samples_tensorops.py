"""Samples of the tensor ops (math, einsum, statistics, sorting, scatter, sampling families):
merged into core_samples.SAMPLES / FORWARD_ONLY. Dims 5, 7 and 3 do not divide by the oracle's
meshes, so every op also runs on uneven pieces; sort and topk inputs have no ties (their
gradient would be ambiguous), argsort's do (stability is part of its contract)."""
from __future__ import annotations

import numpy as np
from core_samples import _distinct, _n, _pos  # the shared generators (merged back there)

from disttensor.ops.shape import normalize_index


def _u(gen=_n, shape=(5, 7), **attrs):
    return lambda rng: ([gen(rng, *shape)], dict(attrs))


def _masked_fill(shape, mshape):
    return lambda rng: ([_n(rng, *shape), rng.random(mshape) < 0.4, np.array(rng.normal())], {})


def _einsum(eq, *shapes):
    return lambda rng: ([_n(rng, *s) if s != "one" else np.array(1.0) for s in shapes],
                        {"equation": eq})


def _stat(shape, axis, keepdim, **extra):
    return lambda rng: ([_n(rng, *shape)], {"axis": axis, "keepdim": keepdim, **extra})


def _take(shape, ishape, axis):
    def build(rng):
        return [_n(rng, *shape), rng.integers(0, shape[axis], ishape).astype(np.int64)], \
            {"axis": axis}
    return build


def _put(shape, k, axis, reduce):
    def build(rng):
        lines = np.moveaxis(np.argsort(rng.random(shape), axis=axis), axis, -1)[..., :k]
        idx = np.moveaxis(lines, -1, axis).astype(np.int64)  # distinct per line
        return [_n(rng, *shape), idx, _n(rng, *idx.shape)], {"axis": axis, "reduce": reduce}
    return build


def _scatter(shape, index, axis, ids, overwrite):
    def build(rng):
        region = np.empty(shape)[normalize_index("scatter", index, shape)].shape
        vshape = region[:axis] + (len(ids),) + region[axis + 1:]
        return ([_n(rng, *shape), np.array(ids, dtype=np.int64), _n(rng, *vshape)],
                {"index": normalize_index("scatter", index, shape), "axis": axis,
                 "overwrite": overwrite})
    return build


SAMPLES: dict[str, list] = {
    "sin": [_u()], "cos": [_u(shape=(7, 3))], "erf": [_u()], "square": [_u(shape=(3, 5))],
    "reciprocal": [_u(_pos)], "log1p": [_u(_pos, (7, 3))],
    "masked_fill": [_masked_fill((5, 7), (5, 7)), _masked_fill((5, 7), (7,))],
    "tril": [_u(diagonal=0), _u(shape=(2, 5, 7), diagonal=-1)],
    "triu": [_u(diagonal=1), _u(shape=(7, 5), diagonal=-2)],
    "einsum": [_einsum("ij,jk->ik", (5, 7), (7, 3)), _einsum("bij,bkj->bik", (2, 5, 3), (2, 7, 3)),
               _einsum("ij,->i", (5, 7), "one"), _einsum("ij,j->ij", (7, 5), (5,))],
    "outer": [lambda rng: ([_n(rng, 5), _n(rng, 7)], {})],
    "logsumexp": [_stat((5, 7), (1,), False), _stat((7, 3), (0, 1), True)],
    "var": [_stat((5, 7), (1,), False, unbiased=True), _stat((7, 3), (0,), True, unbiased=False)],
    "std": [_stat((5, 7), (0, 1), False, unbiased=True), _stat((7, 5), (1,), True,
                                                               unbiased=False)],
    "norm": [_stat((5, 7), (0, 1), False), _stat((7, 3), (0,), True)],
    "sort": [_u(_distinct, axis=1, descending=False), _u(_distinct, (7, 3), axis=0,
                                                         descending=True)],
    "topk": [_u(_distinct, k=3, axis=1, largest=True, sorted=True),
             _u(_distinct, (7, 5), k=2, axis=0, largest=False, sorted=True)],
    "cumsum": [_u(axis=1, reverse=False), _u(shape=(7, 3), axis=0, reverse=True)],
    "flip": [_u(axes=(0,)), _u(shape=(7, 3), axes=(0, 1))],
    "roll": [_u(shifts=(2,), axes=(1,)), _u(shape=(7, 3), shifts=(1, -2), axes=(0, 1))],
    "unbind": [_u(shape=(3, 5), axis=0), _u(shape=(5, 2), axis=1)],
    "repeat_interleave": [_u(shape=(5, 3), repeats=(2,) * 5, axis=0),
                          _u(shape=(7, 3), repeats=(1, 0, 2), axis=1)],
    "take_along_axis": [_take((5, 7), (5, 3), 1), _take((7, 3), (4, 3), 0)],
    "put_along_axis": [_put((5, 7), 3, 1, "assign"), _put((7, 3), 2, 0, "add")],
    "scatter": [_scatter((5, 3), Ellipsis, 0, [4, 0, 2], True),
                _scatter((7, 3), Ellipsis, 0, [1, 6, 1], False),
                _scatter((4, 6), (slice(None), slice(1, 6)), 1, [3, 0], True),
                _scatter((3, 7, 5), (1, slice(None)), 0, [6, 2, 5], True)],
}


def _ties(rng, *shape):
    return rng.integers(0, 3, shape).astype(np.float64)


def _probs(rng, *shape):
    p = rng.random(shape)
    p[..., 0] = 0.0  # a zero-weight category is never drawn
    return p


FORWARD_ONLY: dict[str, list] = {
    "floor": [_u(shape=(5, 7))], "sign": [_u(_ties, (7, 3))],
    "argsort": [_u(_ties, axis=1, descending=False), _u(_ties, (7, 5), axis=0, descending=True)],
    "multinomial": [
        _u(_probs, (5, 4), axis=1, num_samples=3, replacement=False, seed=7),
        _u(_probs, (7, 3), axis=1, num_samples=5, replacement=True, seed=11),
        _u(_probs, (6,), axis=0, num_samples=2, replacement=False, seed=3)],
}

OPTIONS: dict[str, dict] = {}
