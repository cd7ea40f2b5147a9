"""The main job at a small size: the distributed loss curve equals the dense one (same seed)."""
import os
import sys

import numpy as np
import pytest

import disttensor as dt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_distributed_loss_curve_matches_dense(model, comm):
    steps = 8 if model == "mlp" else 5
    common = ["--model", model, "--steps", str(steps), "--log-interval", "1000"]
    dense = train.main(common + ["--dense"])[model]          # every rank, no communication
    dist = train.main(common)[model]                         # default mesh for this world size
    assert dense[-1] < dense[0], "the synthetic task must be learnable"
    np.testing.assert_allclose(dist, dense, rtol=1e-4)


def test_single_process_mesh_layout(comm):
    """The default mesh is 2x2 on 4 ranks and world x 1 otherwise."""
    world = dt.get_world_size()
    curves = train.main(["--model", "mlp", "--steps", "2", "--log-interval", "1000",
                         "--mesh", f"{world},1"])
    assert len(curves["mlp"]) == 2 and np.isfinite(curves["mlp"]).all()
