"""parallelize_module's default ``use_local_output=True`` combined with fully_shard: the error
names ``use_local_output=False`` on every rank, before any communication; with it the same
model runs."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard, nn

pytestmark = pytest.mark.mpi


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _model(local_output: bool):
    n = collectives.init().size
    mesh = dt.init_device_mesh("cpu", (2, 2) if n == 4 else (1, n), mesh_dim_names=("dp", "tp"))
    dt.manual_seed(5)
    model = _Block()
    kw = {} if local_output else {"use_local_output": False}
    dt.parallelize_module(model, mesh["tp"], {"fc1": dt.ColwiseParallel(**kw),
                                              "fc2": dt.RowwiseParallel(**kw)})
    dt.fully_shard(model, mesh=mesh["dp"])
    x = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    return model, x, dt.distribute_tensor(x, mesh, [Shard(0), Replicate()])


def test_local_output_with_fully_shard_names_the_fix(comm):
    model, _, x = _model(local_output=True)
    with pytest.raises(ValueError) as info:
        model(x)
    msg = str(info.value)
    assert all(comm.allgather("use_local_output=False" in msg and "fully_shard" in msg
                              and msg.startswith("parallelize_module: Linear")))


def test_with_use_local_output_false_the_model_runs_like_numpy():
    model, x, xd = _model(local_output=False)
    w1, b1 = model.fc1.weight.numpy(), model.fc1.bias.numpy()
    w2, b2 = model.fc2.weight.numpy(), model.fc2.bias.numpy()
    ref = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    np.testing.assert_allclose(model(xd).numpy(), ref, rtol=1e-5, atol=1e-6)
