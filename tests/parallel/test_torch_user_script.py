"""A training script written with PyTorch's spellings end to end: ``manual_seed``,
``nn.Module``/``nn.ModuleDict``, TP + FSDP with ``use_local_output=False``, per-data-rank batches
from ``DataLoader(sampler=DistributedSampler(...))`` with ``set_epoch``, ``zero_grad``, then
``dt.checkpoint.save/load`` and a strict ``load_state_dict``; losses and weights against numpy."""
from __future__ import annotations

import math
import os
import shutil
import tempfile

import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import DTensor, Replicate, Shard, nn
from disttensor.io import DataLoader, DistributedSampler, TensorDataset

pytestmark = pytest.mark.mpi

ROWS, BATCH, EPOCHS, LR = 12, 2, 2, 0.1


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleDict({"up": nn.Linear(4, 8), "down": nn.Linear(8, 2)})

    def forward(self, x):
        return self.fc["down"](F.relu(self.fc["up"](x)))


def _build(seed, mesh):
    dt.manual_seed(seed)
    model = MLP()
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    dt.parallelize_module(model, mesh["tp"], {
        "fc.up": dt.ColwiseParallel(use_local_output=False),
        "fc.down": dt.RowwiseParallel(use_local_output=False)})
    dt.fully_shard(model, mesh=mesh["dp"])
    return model, init


def _sampler_indices(dp, r, epoch):
    """PyTorch's DistributedSampler (shuffle, seed 1) written out with numpy."""
    order = np.random.default_rng(1 + epoch).permutation(ROWS).tolist()
    total = math.ceil(ROWS / dp) * dp
    order = (order * 2)[:total]
    return order[r:total:dp]


def _numpy_run(p, x, y, dp):
    """SGD on the MLP by hand; the global batch of a step is the data ranks' batches in order."""
    p = dict(p)
    losses = []
    for epoch in range(EPOCHS):
        per_rank = [_sampler_indices(dp, r, epoch) for r in range(dp)]
        for k in range(0, len(per_rank[0]), BATCH):
            idx = sum((ix[k:k + BATCH] for ix in per_rank), [])
            xb, yb = x[idx], y[idx]
            z = xb @ p["fc.up.weight"] + p["fc.up.bias"]
            h = np.maximum(z, 0)
            o = h @ p["fc.down.weight"] + p["fc.down.bias"]
            losses.append(np.mean((o - yb) ** 2))
            d_o = 2 * (o - yb) / o.size
            d_z = (d_o @ p["fc.down.weight"].T) * (z > 0)
            grads = {"fc.down.weight": h.T @ d_o, "fc.down.bias": d_o.sum(0),
                     "fc.up.weight": xb.T @ d_z, "fc.up.bias": d_z.sum(0)}
            p = {key: p[key] - LR * grads[key] for key in p}
    return losses, p


@pytest.fixture
def ckdir(comm):
    path = comm.bcast(tempfile.mkdtemp(prefix="dt-torch-") if comm.rank == 0 else None)
    yield os.path.join(path, "ckpt")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_torch_style_script_trains_saves_and_loads_like_numpy(ckdir):
    n = collectives.init().size
    dp, tp = (2, 2) if n == 4 else (n, 1)
    mesh = dt.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model, init = _build(0, mesh)
    opt = dt.optimizer.SGD(learning_rate=LR, parameters=model.parameters())
    rng = np.random.default_rng(4)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    y = rng.standard_normal((ROWS, 2)).astype(np.float32)
    ds = TensorDataset([dt.to_tensor(x), dt.to_tensor(y)])
    sampler = DistributedSampler(ds, num_replicas=dp, rank=mesh.get_coordinate()[0], seed=1)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xd = DTensor.from_local(xb, mesh, [Shard(0), Replicate()])
            yd = DTensor.from_local(yb, mesh, [Shard(0), Replicate()])
            loss = F.mse_loss(model(xd), yd)
            loss.backward()
            opt.step()
            model.zero_grad()
            losses.append(float(loss.numpy()))
    ref_losses, ref = _numpy_run(init, x.astype(np.float64), y.astype(np.float64), dp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in model.state_dict().items():
        np.testing.assert_allclose(v.numpy(), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)

    dt.checkpoint.save({"model": model.state_dict(), "epoch": EPOCHS}, checkpoint_id=ckdir)
    model2, _ = _build(7, mesh)
    state = {"model": model2.state_dict(), "epoch": 0}
    dt.checkpoint.load(state, checkpoint_id=ckdir)
    assert state["epoch"] == EPOCHS
    assert tuple(model2.load_state_dict(state["model"])) == ([], [])
    for k, v in model2.state_dict().items():
        np.testing.assert_allclose(v.numpy(), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
