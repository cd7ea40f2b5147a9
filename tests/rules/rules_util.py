"""Helpers for the spmd_rules tests: build metas, simulate ranks with numpy, check results."""
from __future__ import annotations

import itertools

import numpy as np

from spmd_rules import DistAttr, ReduceType, TensorMeta, get_rule, local_shape, local_slices

_REDUCE = {ReduceType.SUM: np.sum, ReduceType.AVG: np.mean, ReduceType.MAX: np.max,
           ReduceType.MIN: np.min, ReduceType.PROD: np.prod}


def meta(shape, placements, mesh=(2,)):
    return TensorMeta(tuple(shape), DistAttr.from_placements(placements, len(shape), mesh))


def run(rule, *metas, **attrs):
    attrs.setdefault("op", rule)
    return get_rule(rule)(tuple(metas), attrs)


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def pieces_of(g, attr, rng=None):
    """coord -> local array of global value ``g`` under ``attr``. A Partial(sum) layout splits the
    value into random pending tensors (one per coordinate of the partial mesh dims) summing to g."""
    g = np.asarray(g)
    pdims = attr.partial_dims()
    assert all(r is ReduceType.SUM for _, r in attr.partial), attr
    pcs = coords([attr.mesh_shape[m] for m in pdims])
    pending, total = {}, np.zeros(g.shape)
    rng = rng or np.random.default_rng(0)
    for pc in pcs[:-1]:
        pending[pc] = rng.integers(-3, 4, size=g.shape).astype(float)
        total = total + pending[pc]
    pending[pcs[-1]] = g - total
    return {c: pending[tuple(c[m] for m in pdims)][local_slices(g.shape, attr, c)]
            for c in coords(attr.mesh_shape)}


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
            return np.asarray(pieces[c], dtype=float)
        m = dims[0]
        vals = [combine(c[:m] + (i,) + c[m + 1:], dims[1:]) for i in range(attr.mesh_shape[m])]
        return _REDUCE[types[m]](np.stack(vals), axis=0)

    for c in coords(attr.mesh_shape):
        assert np.shape(pieces[c]) == local_shape(out_meta.shape, attr, c), (c, np.shape(pieces[c]))
        want = expected[local_slices(expected.shape, attr, c)]
        np.testing.assert_allclose(combine(c, pdims), want, rtol=1e-9, atol=1e-9)


def simulate(result, globals_, fn, expected, rng=None):
    """Run ``fn`` on each coordinate's pieces of ``globals_`` laid out as ``result.inputs``
    require and check the single output against ``expected``."""
    rng = rng or np.random.default_rng(0)
    per_input = [pieces_of(g, a, rng) for g, a in zip(globals_, result.inputs)]
    mesh = result.inputs[0].mesh_shape
    out = {c: fn(*(p[c] for p in per_input), coord=c) for c in coords(mesh)}
    check_output(result.outputs[0], out, expected)
