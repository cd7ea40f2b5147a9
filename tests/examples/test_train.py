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


@pytest.mark.parametrize("save_stage,resume_stage", [(0, 0), (3, 1)])
def test_resume_reaches_the_loss_of_one_run(save_stage, resume_stage, comm, tmp_path):
    """Train 6 steps at once, and 3 steps + --save then --resume to 6 (ZeRO stages may differ:
    the checkpoint is resharded into the new layouts): the same losses."""
    ckpt = comm.bcast(str(tmp_path / "ckpt"), root=0)
    common = ["--log-interval", "1000"]
    one = train.main(common + ["--steps", "6", "--sharding", str(save_stage)])
    train.main(common + ["--steps", "3", "--save", ckpt, "--sharding", str(save_stage)])
    rest = train.main(common + ["--steps", "6", "--resume", ckpt,
                                "--sharding", str(resume_stage)])
    for model in ("mlp", "gpt"):
        assert len(rest[model]) == 3
        np.testing.assert_allclose(rest[model], one[model][3:], rtol=1e-5, atol=1e-6)


def test_gpt_is_placed_by_the_plan(comm):
    """The plan gives the Megatron placements: column q/k/v/fc1/head, row proj/fc2/wte."""
    mesh = train.default_mesh(dt.get_world_size())
    model, _, _ = train.build("gpt", 1, mesh)
    col, row = [dt.Replicate(), dt.Shard(1)], [dt.Replicate(), dt.Shard(0)]
    blk = model.blocks[1]
    assert model.wte.weight.placements == row and model.head.weight.placements == col
    for lin in (blk.attn.q, blk.attn.k, blk.attn.v, blk.fc1):
        assert lin.weight.placements == col and lin.bias.placements == row
    for lin in (blk.attn.proj, blk.fc2):
        assert lin.weight.placements == row
        assert lin.bias.placements == [dt.Replicate(), dt.Replicate()]


@pytest.mark.parametrize("extra", [["--sharding", "3"], ["--sharding", "2", "--to-static"]])
def test_zero_and_captured_zero_equal_dense(extra, comm):
    """Both models under ZeRO stage 3, and stage 2 captured by to_static, give the dense
    loss curve."""
    common = ["--steps", "4", "--log-interval", "1000"]
    dense = train.main(common + ["--dense"])
    dist = train.main(common + extra)
    for model in ("mlp", "gpt"):
        np.testing.assert_allclose(dist[model], dense[model], rtol=1e-4)
