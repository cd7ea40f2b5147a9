"""examples/torch_style.py (TP on mesh["tp"] + FSDP on mesh["dp"], PyTorch names) gives the
dense single-process loss curve."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import torch_style  # noqa: E402

pytestmark = pytest.mark.mpi


def test_tp_fsdp_example_equals_the_dense_run(comm):
    dense = torch_style.main(["--dense"])       # every rank, no mesh
    dist = torch_style.main([])                 # 2 x 2 on 4 ranks, world x 1 otherwise
    assert len(dense) == 5 and dense[-1] < dense[0]
    np.testing.assert_allclose(dist, dense, rtol=1e-5)
