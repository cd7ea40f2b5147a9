"""train.py --amp: O1/O2 in bfloat16 and float16 train the GPT and the MLP like float32, a
captured O2 run and a captured float16 run with loss scaling equal the eager ones."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

ARGS = ["--dense", "--steps", "6", "--log-interval", "100"]


@pytest.fixture(scope="module")
def fp32():
    return train.main(ARGS)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # float16 overflows: skipped
@pytest.mark.parametrize("level,dtype,tol", [("O1", "bfloat16", 2e-2), ("O2", "bfloat16", 2e-2),
                                             ("O1", "float16", 2e-3), ("O2", "float16", 2e-3)])
def test_amp_runs_track_float32(fp32, level, dtype, tol):
    got = train.main(ARGS + ["--amp", level, "--amp-dtype", dtype])
    for name in ("mlp", "gpt"):
        assert np.all(np.isfinite(got[name]))
        np.testing.assert_allclose(got[name], fp32[name], rtol=tol)
        assert got[name] != fp32[name]                  # it did run in low precision
        assert got[name][-1] < got[name][0]


def test_captured_o2_equals_eager():
    eager = train.main(ARGS + ["--model", "gpt", "--amp", "O2"])
    captured = train.main(ARGS + ["--model", "gpt", "--amp", "O2", "--to-static"])
    assert captured == eager


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_captured_float16_loss_scaling_equals_eager():
    args = ARGS + ["--model", "gpt", "--amp", "O1", "--amp-dtype", "float16"]
    assert train.main(args + ["--to-static"]) == train.main(args)


def test_o2_resume_continues_exactly(tmp_path):
    args = ["--model", "gpt", "--log-interval", "100", "--amp", "O2"]
    full = train.main(args + ["--steps", "6"])["gpt"]
    train.main(args + ["--steps", "3", "--save", str(tmp_path)])
    resumed = train.main(args + ["--steps", "6", "--resume", str(tmp_path)])["gpt"]
    assert resumed == full[3:]              # the masters and moments came back
