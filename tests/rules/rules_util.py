"""Helpers for the spmd_rules tests: build metas, simulate ranks with numpy, check results."""
from __future__ import annotations

import itertools

import numpy as np

from spmd_rules import DistAttr, ReduceType, TensorMeta, get_rule, local_ranges, local_shape

_REDUCE = {ReduceType.SUM: np.sum, ReduceType.AVG: np.mean, ReduceType.MAX: np.max,
           ReduceType.MIN: np.min, ReduceType.PROD: np.prod, ReduceType.ANY: np.any,
           ReduceType.ALL: np.all}


def meta(shape, placements, mesh=(2,)):
    return TensorMeta(tuple(shape), DistAttr.from_placements(placements, len(shape), mesh))


def run(rule, *metas, **attrs):
    attrs.setdefault("op", rule)
    return get_rule(rule)(tuple(metas), attrs)


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def pending_values(g, n: int, reduce_type, rng) -> list[np.ndarray]:
    """``n`` pending tensors that combine to ``g`` under ``reduce_type``, exactly: random
    integers (sum; avg from n * g), values below / above g with g at a random one per element
    (max / min), factors +-1/2, +-1, +-2 and a last one (prod), random bools with g at one
    (any / all)."""
    g = np.asarray(g)
    rt = ReduceType(reduce_type)
    if n == 1:
        return [g.copy()]
    if rt in (ReduceType.SUM, ReduceType.AVG):
        parts = [rng.integers(-3, 4, size=g.shape).astype(float) for _ in range(n - 1)]
        return parts + [(n * g if rt is ReduceType.AVG else g) - sum(parts)]
    if rt is ReduceType.PROD:
        parts = [rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], size=g.shape) for _ in range(n - 1)]
        return parts + [g / np.prod(parts, axis=0)]
    winner = rng.integers(0, n, size=g.shape)
    if rt in (ReduceType.MAX, ReduceType.MIN):
        step = -1.0 if rt is ReduceType.MAX else 1.0
        return [np.where(winner == k, g, g + step * rng.integers(1, 4, size=g.shape))
                for k in range(n)]
    noise = [rng.random(g.shape) < 0.5 for _ in range(n)]
    keep = (lambda k: g & noise[k]) if rt is ReduceType.ANY else (lambda k: g | noise[k])
    return [np.where(winner == k, g, keep(k)) for k in range(n)]


def pieces_of(g, attr, rng=None):
    """coord -> local array of global value ``g`` under ``attr``. A Partial layout splits the
    value into random pending tensors, one per coordinate of the partial mesh dims, that
    combine to g: over the first partial mesh dim with its reduce type, each of those over the
    next one with its type, and so on (:func:`pending_values`)."""
    g = np.asarray(g)
    types = dict(attr.partial)
    pdims = list(types)
    rng = rng or np.random.default_rng(0)

    def split(value, dims) -> dict:
        if not dims:
            return {(): value}
        m = dims[0]
        parts = pending_values(value, attr.mesh_shape[m], types[m], rng)
        return {(i,) + rest: v for i, part in enumerate(parts)
                for rest, v in split(part, dims[1:]).items()}

    pending = split(g, pdims)
    return {c: piece(pending[tuple(c[m] for m in pdims)], attr, c)
            for c in coords(attr.mesh_shape)}


def piece(g, attr, c):
    """The piece of the global array ``g`` at coordinate ``c`` (a strided shard's ranges in
    order)."""
    g = np.asarray(g)
    idx = [np.concatenate([np.arange(a, b) for a, b in r] or [np.zeros(0, int)])
           for r in local_ranges(g.shape, attr, c)]
    return g[np.ix_(*idx)] if idx else g


def check_output(out_meta, pieces, expected):
    """Combining each coordinate's piece over the partial mesh dims gives the output's local
    slice of ``expected``; every piece has the layout's local shape."""
    expected = np.asarray(expected)
    attr = out_meta.dist_attr
    assert tuple(out_meta.shape) == expected.shape, (out_meta.shape, expected.shape)
    types = dict(attr.partial)
    pdims = list(types)

    def combine(c, dims):
        if not dims:
            return np.asarray(pieces[c])
        m = dims[0]
        vals = [combine(c[:m] + (i,) + c[m + 1:], dims[1:]) for i in range(attr.mesh_shape[m])]
        return _REDUCE[types[m]](np.stack(vals), axis=0)

    for c in coords(attr.mesh_shape):
        assert np.shape(pieces[c]) == local_shape(out_meta.shape, attr, c), (c, np.shape(pieces[c]))
        want = piece(expected, attr, c)
        np.testing.assert_allclose(np.asarray(combine(c, pdims), dtype=float),
                                   np.asarray(want, dtype=float), rtol=1e-9, atol=1e-9)


def simulate(result, globals_, fn, expected, rng=None):
    """Run ``fn`` on each coordinate's pieces of ``globals_`` laid out as ``result.inputs``
    require and check the single output against ``expected``."""
    rng = rng or np.random.default_rng(0)
    per_input = [pieces_of(g, a, rng) for g, a in zip(globals_, result.inputs)]
    mesh = result.inputs[0].mesh_shape
    out = {c: fn(*(p[c] for p in per_input), coord=c) for c in coords(mesh)}
    check_output(result.outputs[0], out, expected)
