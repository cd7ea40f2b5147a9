"""Checkpoint names users bring along: PyTorch's ``dt.checkpoint.save/load(state_dict,
checkpoint_id)`` and Paddle's ``dt.save_state_dict(dist_model.state_dict(), path)`` with
``DistModel.set_state_dict``."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard, nn
from spmd_rules import DistAttr, local_slices

pytestmark = pytest.mark.mpi

W = np.random.default_rng(5).standard_normal((7, 6)).astype(np.float32)


def grid():
    n = collectives.init().size
    return dt.ProcessMesh([[0, 1], [2, 3]] if n == 4 else [list(range(n))], dim_names=["a", "b"])



def test_dcp_save_and_load_reshard(ckdir, comm):
    mesh = grid()
    state = {"model": {"w": dt.shard_tensor(W, mesh, [Shard(0), Replicate()])}, "step": 5}
    dt.checkpoint.save(state, checkpoint_id=ckdir)
    dst = [Replicate(), Shard(1)]
    target = {"model": {"w": dt.shard_tensor(np.zeros_like(W), mesh, dst)}, "step": 0}
    w = target["model"]["w"]
    dt.checkpoint.load(target, checkpoint_id=pathlib.Path(ckdir))
    assert target["model"]["w"] is w and w.placements == dst and target["step"] == 5
    attr = DistAttr.from_placements(dst, 2, mesh.shape)
    piece = W[local_slices(W.shape, attr, mesh.get_coord(comm.rank))]
    np.testing.assert_array_equal(w.to_local().numpy(), piece)
    # the same files as save_state_dict: either name loads the other's checkpoint
    again = {"model": {"w": dt.to_tensor(np.zeros_like(W))}, "step": 0}
    dt.load_state_dict(again, ckdir)
    np.testing.assert_array_equal(again["model"]["w"].numpy(), W)
    with pytest.raises(TypeError, match="checkpoint.load: checkpoint_id must be a directory"):
        dt.checkpoint.load(target, None)


def _build(seed):
    dt.manual_seed(seed)
    # optimizer state is keyed by parameter names: fix them, as a fresh process would make them
    layer = nn.Linear(6, 3, weight_attr=dt.ParamAttr(name="fc.w"),
                      bias_attr=dt.ParamAttr(name="fc.b"))
    opt = dt.optimizer.Adam(learning_rate=0.05, parameters=layer.parameters())
    return layer, opt, dt.to_static(layer, None, nn.MSELoss(), opt)


def test_dist_model_state_dict_saves_and_resumes(ckdir):
    rng = np.random.default_rng(1)
    xs = [dt.to_tensor(rng.standard_normal((4, 6)).astype(np.float32)) for _ in range(3)]
    ys = [dt.to_tensor(rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(3)]
    layer, opt, model = _build(0)
    model.train()
    model(xs[0], ys[0])
    sd = model.state_dict()
    assert set(model.state_dict("param")) == {"weight", "bias"}
    assert set(sd) == {"weight", "bias"} | set(opt.state_dict()) and opt.state_dict()
    assert set(model.state_dict("opt")) == set(opt.state_dict())
    saved = {k: v.numpy() for k, v in sd.items()}
    dt.save_state_dict(model.state_dict(), ckdir)  # Paddle's pattern
    expect = float(model(xs[1], ys[1]).numpy())  # the uninterrupted run's next loss

    layer2, opt2, model2 = _build(1)
    model2.train()
    model2(xs[2], ys[2])  # a different history: its states exist, with other values
    target = model2.state_dict()
    dt.load_state_dict(target, ckdir)
    model2.set_state_dict(target)
    for k, v in model2.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), saved[k])
    assert float(model2(xs[1], ys[1]).numpy()) == expect
    with pytest.raises(ValueError, match="mode must be 'all', 'param' or 'opt'"):
        model.state_dict("params")


def test_dist_model_without_optimizer_rejects_foreign_keys():
    layer = nn.Linear(2, 2)
    model = dt.to_static(layer, None, nn.MSELoss())
    assert set(model.state_dict()) == {"weight", "bias"}
    before = layer.weight.numpy()
    with pytest.raises(ValueError, match=r"keys \['w_moment1_0'\] are not the layer's"):
        model.set_state_dict({"weight": np.ones((2, 2)), "w_moment1_0": np.zeros((2, 2))})
    np.testing.assert_array_equal(layer.weight.numpy(), before)
    with pytest.raises(TypeError, match="DistModel.set_state_dict: expected a dict, got list"):
        model.set_state_dict([1])
    model.set_state_dict({"weight": np.ones((2, 2)), "bias": np.zeros(2)})
    np.testing.assert_array_equal(layer.weight.numpy(), 1.0)
