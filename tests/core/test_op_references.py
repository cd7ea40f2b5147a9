"""Every registered op against a forward reference written with numpy alone
(tests/distributed/numpy_reference.py), on every oracle sample: this anchors the op-by-placement
oracle, which compares distributed runs with the dense run of the same kernel."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.ops import OPS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distributed"))
from numpy_reference import REFERENCES  # noqa: E402
from oracle_util import op_cases  # noqa: E402

# creation ops and the entry points that plan themselves (rule None) have their own tests
ALL_OPS = sorted(n for n, op in OPS.items() if op.rule is not None)


def test_every_registered_op_has_a_numpy_reference():
    missing = [n for n in ALL_OPS if n not in REFERENCES]
    assert not missing, f"registered ops without a numpy reference: {missing}"
    stale = sorted(set(REFERENCES) - set(OPS))
    assert not stale, f"references of ops that are not registered: {stale}"


@pytest.mark.parametrize("name", ALL_OPS)
def test_op_matches_its_numpy_reference(name):
    op = OPS[name]
    cases = op_cases()[name]
    assert cases, f"{name}: no samples"
    for arrays, attrs in cases:
        copies = [None if a is None else np.array(a, copy=True) for a in arrays]
        tensors = tuple(None if a is None else dt.to_tensor(np.array(a, copy=True))
                        for a in arrays)
        with dt.no_grad():
            outs = apply(op, tensors, attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        got = [o.numpy() for o in outs]
        want = REFERENCES[name](copies, attrs, got)
        assert len(want) == len(got), f"{name}: {len(got)} outputs, reference {len(want)}"
        for k, (g, w) in enumerate(zip(got, want)):
            w = np.asarray(w)
            what = f"{name} output {k} (attrs {attrs}, shapes {[np.shape(a) for a in arrays]})"
            assert g.shape == w.shape, f"{what}: shape {g.shape}, reference {w.shape}"
            if w.dtype.kind == "f" or g.dtype.kind == "f":
                tol = 1e-5 if np.float32 in (g.dtype, w.dtype) else 1e-9
                np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=what)
            else:
                np.testing.assert_array_equal(g, w, err_msg=what)
