"""examples/paddle_style.py (Paddle's auto-parallel guide MLP demo, DP2 x MP2 through
parallelize and shard_dataloader) gives the dense single-process loss curve."""
import os
import sys

import numpy as np
import pytest

import collectives

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import paddle_style  # noqa: E402

pytestmark = pytest.mark.mpi

SMALL = ["--hidden", "32", "--inter", "96", "--seq-len", "6", "--num-samples", "22",
         "--batch-size", "4"]


def test_dp2_mp2_demo_equals_the_dense_run():
    if collectives.init().size != 4:
        pytest.skip("the demo's mesh is 2 x 2")
    dense = paddle_style.main(SMALL + ["--dense"])      # every rank, no mesh
    dist = paddle_style.main(SMALL)
    assert len(dense) == 6 and dense[-1] < dense[0]
    np.testing.assert_allclose(dist, dense, rtol=1e-5)
