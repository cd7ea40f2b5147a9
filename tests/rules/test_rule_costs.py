"""The rules pick the cheapest layout: for every registered op with an SPMD rule, on sample
shapes (the oracle's cases) and several input layouts on a 2x2 mesh, the bytes the chosen plan
moves (the inputs' reshards, :func:`spmd_rules.reshard_cost`) are at most those of every
alternative the rule could have chosen: every combination of Shard/Replicate input layouts that
the rule accepts unchanged (a fixed point of the rule). Pure metadata, one process."""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

from disttensor.ops import OPS
from spmd_rules import FALLBACK_RULE, DistAttr, TensorMeta, get_rule, reshard_cost

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distributed"))
from oracle_util import _tensor_options, op_cases  # noqa: E402

MESH = (2, 2)
ALT_CAP = 1500     # alternative layout combinations tried per sample (seeded sample beyond it)
INPUT_COMBOS = 6   # input layouts checked per sample
RULED = sorted(n for n, op in OPS.items() if op.rule not in (None, FALLBACK_RULE))


def _attrs(op, attrs: dict) -> dict:
    extra = op.rule_attrs(attrs) if callable(op.rule_attrs) else op.rule_attrs
    return {**extra, **attrs, "op": op.name}


def _combos(shapes, rng, cap: int) -> list[tuple]:
    """Input layout combinations (None for absent inputs): all, or a seeded sample of ``cap``."""
    opts = [[None] if s is None else [DistAttr.from_placements(p, len(s), MESH)
                                      for p in _tensor_options(len(s), len(MESH))]
            for s in shapes]
    total = int(np.prod([len(o) for o in opts]))
    if total <= cap:
        return list(itertools.product(*opts))
    return [tuple(o[rng.integers(len(o))] for o in opts) for _ in range(cap)]


def _cost(shapes, src, dst) -> int:
    return sum(reshard_cost(tuple(s), 1, a, b) for s, a, b in zip(shapes, src, dst)
               if s is not None and b is not None)


@pytest.mark.parametrize("name", RULED)
def test_rule_picks_the_cheapest_layout(name):
    op = OPS[name]
    rule = get_rule(op.rule)
    failures = []
    for k, (arrays, attrs) in enumerate(op_cases()[name][:3]):
        shapes = [None if a is None else tuple(np.shape(a)) for a in arrays]
        ra = _attrs(op, attrs)
        rng = np.random.default_rng(k)

        def required(layouts):
            metas = tuple(None if a is None else TensorMeta(s, a) for s, a in zip(shapes, layouts))
            return rule(metas, ra).inputs

        replicated = tuple(None if s_ is None else DistAttr.replicated(len(s_), MESH)
                           for s_ in shapes)
        fixed = [c for c in [replicated] + _combos(shapes, rng, ALT_CAP)
                 if all(r is None or r == a for r, a in zip(required(c), c))]
        assert fixed, f"{name}: no layout is a fixed point of its rule (shapes {shapes})"
        for src in _combos(shapes, rng, INPUT_COMBOS):
            chosen = required(src)
            mine = _cost(shapes, src, chosen)
            best = min(fixed, key=lambda alt: _cost(shapes, src, alt))
            if _cost(shapes, src, best) < mine:
                failures.append(
                    f"{name} shapes {shapes} attrs {attrs}: from "
                    f"{[None if a is None else a.to_placements() for a in src]} the rule moves "
                    f"{mine} elements to "
                    f"{[None if a is None else a.to_placements() for a in chosen]}"
                    f", but {[None if a is None else a.to_placements() for a in best]} moves "
                    f"{_cost(shapes, src, best)}")
    assert not failures, "\n".join(failures[:8])
