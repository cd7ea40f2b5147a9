"""Partial inputs of every reduce type through every registered op's rule (the oracle's samples,
the attrs the op registry passes): a Partial input is either kept exactly as it is or resolved,
never relabelled; an output is Partial on the input's mesh dim only where an input kept it, and
then with exactly its reduce type (a Partial(max) never comes out as Partial(min), sum or
avg), or where the rule resharded a resolved input onto a contracted dim (a Partial(sum) of the
contraction, as a row-parallel conv gives). The values behind these layouts are checked by the
op-by-placement oracle (tests/distributed/test_ops_oracle.py), which feeds every op Partial(max),
(min), (prod), (any) and (all) inputs as well."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from disttensor.ops import OPS
from spmd_rules import DistAttr, Partial, ReduceType, Replicate, Shard, TensorMeta, get_rule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distributed"))
from oracle_util import op_cases  # noqa: E402

FLOAT_TYPES = ("sum", "avg", "max", "min", "prod")
BOOL_TYPES = ("any", "all")
MESHES = [(3,), (2, 2)]
ALL_OPS = sorted(n for n, op in OPS.items() if op.rule is not None)


def _rule(op, metas: list, attrs: dict):
    extra = op.rule_attrs(attrs) if callable(op.rule_attrs) else op.rule_attrs
    return get_rule(op.rule)(tuple(metas), {**extra, **attrs, "op": op.name})


def _metas(arrays: list, mesh: tuple, partial_inputs: set, reduce_type: str) -> list:
    """Inputs in ``partial_inputs`` Partial(reduce_type) on mesh dim 0 (Shard(0) on mesh dim 1
    of a 2-d mesh), the others replicated."""
    metas = []
    for i, a in enumerate(arrays):
        if a is None:
            metas.append(None)
            continue
        nd = np.ndim(a)
        pl = [Replicate()] * len(mesh)
        if i in partial_inputs:
            pl[0] = Partial(reduce_type)
            if len(mesh) > 1 and nd > 0:
                pl[1] = Shard(0)
        metas.append(TensorMeta(tuple(np.shape(a)), DistAttr.from_placements(pl, nd, mesh)))
    return metas


def _selections(arrays: list, kind: str) -> list[set]:
    idx = [i for i, a in enumerate(arrays) if a is not None and np.asarray(a).dtype.kind == kind]
    return [{i} for i in idx] + ([set(idx)] if len(idx) > 1 else [])


@pytest.mark.parametrize("name", ALL_OPS)
def test_a_partial_input_is_kept_exactly_or_resolved(name):
    op = OPS[name]
    checked = 0
    for arrays, attrs in op_cases()[name]:
        for kind, types in (("f", FLOAT_TYPES), ("b", BOOL_TYPES)):
            for chosen in _selections(arrays, kind):
                for rt in types:
                    for mesh in MESHES:
                        metas = _metas(arrays, mesh, chosen, rt)
                        try:
                            res = _rule(op, metas, attrs)
                        except ValueError:
                            continue  # the rule refuses this input (an error, not a layout)
                        what = (f"{name} with input(s) {sorted(chosen)} Partial({rt}) on mesh "
                                f"{list(mesh)}, attrs {attrs}")
                        kept = False
                        for i in chosen:
                            req = res.inputs[i]
                            given = metas[i].dist_attr.partial
                            assert not req.is_partial() or req.partial == given, \
                                f"{what}: input {i} required as {req.partial}"
                            kept |= req.is_partial()
                        # a resolved input may be resharded onto a contracted dim (P -> S,
                        # a reduce-scatter): the output is then a Partial(sum) of the contraction
                        contracted = any(r is not None and 0 in r.sharded_mesh_dims()
                                         for r in res.inputs)
                        for k, out in enumerate(res.outputs):
                            types_out = dict(out.dist_attr.partial)
                            if 0 in types_out:
                                ok = types_out[0] == ReduceType(rt) if kept else \
                                    contracted and types_out[0] == ReduceType.SUM
                                assert ok, \
                                    f"{what}: output {k} Partial({types_out[0]}) on mesh dim 0 " \
                                    f"(inputs {'kept' if kept else 'resolved'})"
                        checked += 1
    tried = sum(len(_selections(arrays, kind)) for arrays, _ in op_cases()[name] for kind in "fb")
    assert checked or not tried, f"{name}: the rule refused every Partial input"
