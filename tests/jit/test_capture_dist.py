"""Captured programs on meshes: parity with eager for train.py's MLP (BatchNorm1D, dropout) and
GPT, the seed-001 properties of the forward/backward split, and bad input raised on every rank.

Parity is bitwise: replay runs the very kernels and collectives eager mode runs, in the same
order, on the same buffers (no reduction changes its order)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor.jit import CaptureError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
MESHES = {1: ["1,1"], 2: ["2,1", "1,2"], 3: ["3,1"], 4: ["4,1", "2,2"]}[WORLD]
STEPS = 5


def _run(model_name: str, mesh_spec: str, captured: bool):
    mesh = train.default_mesh(WORLD, mesh_spec)
    model, opt, batches = train.build(model_name, 11, mesh)
    step = (lambda x, y: train.train_step(model, opt, x, y))
    if captured:
        step = dt.jit.to_static(step)
    losses = [float(step(*train.to_tensors(*batches[k % 4], mesh)).numpy())
              for k in range(STEPS)]
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    opt_state = [v.numpy() for v in opt.state_dict().values()]  # names differ between builds
    return losses, state, opt_state, step


@pytest.mark.parametrize("mesh_spec", MESHES)
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_captured_equals_eager(model_name, mesh_spec, comm):
    eager = _run(model_name, mesh_spec, captured=False)
    cap = _run(model_name, mesh_spec, captured=True)
    assert cap[0] == eager[0], f"losses differ: eager {eager[0]} captured {cap[0]}"
    for k in eager[1]:  # parameters and running statistics
        np.testing.assert_array_equal(cap[1][k], eager[1][k], err_msg=k)
    assert len(eager[2]) == len(cap[2])
    for a, b in zip(cap[2], eager[2]):  # optimizer moments and beta powers
        np.testing.assert_array_equal(a, b)
    step = cap[3]
    # the first step creates the optimizer's states, so it is captured once more; then replays
    assert step.captures == 2


def test_split_keeps_parameter_names_through_inplace_chains(comm):
    """Seed 001: batch_norm's running statistics and the optimizer update parameters in place;
    no forward output or middle is such a value under another name, and the statistics after 3
    captured steps equal eager's."""
    mesh = train.default_mesh(WORLD)
    runs = {}
    for captured in (False, True):
        model, opt, batches = train.build("mlp", 5, mesh)
        step = (lambda x, y: train.train_step(model, opt, x, y))
        if captured:
            step = dt.jit.to_static(step)
        for k in range(3):
            step(*train.to_tensors(*batches[k], mesh))
        runs[captured] = (model, step)
    for name in ("bn._mean", "bn._variance"):
        np.testing.assert_array_equal(runs[True][0].state_dict()[name].numpy(),
                                      runs[False][0].state_dict()[name].numpy())
    prog = runs[True][1].program
    fwd, bwd = prog.split()
    params = {vid for vid, t in prog.externals}
    for vid in fwd.outputs["outputs"] + fwd.outputs["middles"]:
        root = prog.root(vid)
        assert not (root in params and root != vid), \
            f"{prog.values[vid].name} aliases {prog.values[root].name} under another name"
    mean = next(vid for vid, t in prog.externals if t.name and t.name.endswith("._mean"))
    bn = next(op for op in fwd.ops if op.name == "batch_norm")
    mean_out = dict(bn.inplace)[mean]
    assert prog.root(mean_out) == mean  # mean -> mean_out is one chain rooted at the buffer
    assert mean_out not in fwd.outputs["middles"] + fwd.outputs["outputs"]
    assert all(prog.root(b) in params for op in bwd.ops if op.name == "adam_update"
               for _, b in op.inplace)


def test_numpy_inside_a_step_raises_on_every_rank_and_changes_nothing(comm):
    mesh = train.default_mesh(WORLD)
    model, opt, batches = train.build("mlp", 3, mesh)
    x, y = train.to_tensors(*batches[0], mesh)
    before = {k: v.numpy() for k, v in model.state_dict().items()}
    seed = dt.generator.default_generator.rng.bit_generator.state

    def step(x, y):
        loss = train.train_step(model, opt, x, y)
        if float(loss) > 100.0:  # Python control flow on a tensor value
            loss = loss * 0.0
        return loss

    sf = dt.jit.to_static(step)
    with pytest.raises(CaptureError, match=r"numpy\(\).*control flow"):
        sf(x, y)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state_dict(), "the optimizer's states made during the capture are forgotten"
    assert dt.generator.default_generator.rng.bit_generator.state == seed
    assert sf.captures == 0
