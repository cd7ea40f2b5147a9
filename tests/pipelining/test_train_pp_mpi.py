"""examples/train.py --pp: the GPT's loss curve through every schedule equals the dense run
(the mean of equal micro-batch means is the full-batch mean; float32 sums in another order)."""
import os
import sys

import numpy as np
import pytest

import collectives

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi

COMMON = ["--model", "gpt", "--steps", "5", "--log-interval", "100"]


def _layouts(n: int) -> list[list[str]]:
    """--pp (and --mesh) for this world size: pp x dp, pp alone and pp x mp at 4 ranks."""
    if n == 4:
        return [["--pp", "2"], ["--pp", "4"], ["--pp", "2", "--mesh", "1,2"]]
    return [["--pp", str(n)]]


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "VPP"])
@pytest.mark.parametrize("m", [4, 8])
def test_pipelined_loss_curve_matches_dense(schedule, m):
    n = collectives.init().size
    if n == 1:
        pytest.skip("a pipeline needs two ranks")
    for layout in _layouts(n):
        pp = int(layout[1])
        mb = m if m % pp == 0 or schedule != "VPP" else 2 * pp
        size = ["--layers", str(2 * pp), "--batch", str(4 * mb)]
        dense = train.main(COMMON + size + ["--dense"])["gpt"]
        got = train.main(COMMON + size + layout + ["--micro-batches", str(mb),
                                                   "--schedule", schedule])["gpt"]
        np.testing.assert_allclose(got, dense, rtol=2e-6, err_msg=" ".join(layout))


def test_pp_refuses_other_models():
    with pytest.raises(SystemExit, match="--pp needs --model gpt"):
        train.main(["--model", "mlp", "--pp", "2"])
