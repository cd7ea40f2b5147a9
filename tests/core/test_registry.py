"""register() returns the OpDef it registers and refuses what it cannot run, before adding
anything to the registry."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.schema import OPS, OpDef, register


@pytest.fixture
def fresh_name():
    name = "_test_twice"
    yield name
    OPS.pop(name, None)


def test_register_returns_the_opdef_that_runs(fresh_name):
    op = register(fresh_name, lambda xp, x: x * 2, rule="elementwise")
    assert isinstance(op, OpDef) and OPS[fresh_name] is op
    out = apply(op, (dt.to_tensor(np.arange(3.0)),), {})
    np.testing.assert_array_equal(out.numpy(), [0.0, 2.0, 4.0])


def test_register_refuses_bad_specs_and_leaves_the_registry_alone(fresh_name):
    with pytest.raises(ValueError, match="names SPMD rule 'no_such_rule'"):
        register(fresh_name, lambda xp, x: x, rule="no_such_rule")
    with pytest.raises(ValueError, match=r"inplace pair \(0, 1\) names output 1"):
        register(fresh_name, lambda xp, x: x, inplace=((0, 1),))
    assert fresh_name not in OPS
    register(fresh_name, lambda xp, x: x)
    with pytest.raises(ValueError, match="already registered"):
        register(fresh_name, lambda xp, x: x)
