"""Captured programs on meshes: parity with eager for train.py's MLP (BatchNorm1D, dropout) and
GPT, the seed-001 properties of the forward/backward split, and bad input raised on every rank.

Parity is bitwise: replay runs the very kernels and collectives eager mode runs, in the same
order, on the same buffers (no reduction changes its order)."""
from __future__ import annotations

import math
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


def _square_or_line():
    """2x2 at 4 ranks (uneven layouts over two mesh dims), else a 1-d mesh of every rank."""
    return dt.ProcessMesh([[0, 1], [2, 3]]) if WORLD == 4 else dt.ProcessMesh(list(range(WORLD)))


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
    """batch_norm's running statistics and the optimizer update parameters in place;
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
    assert not opt.has_states(), "the optimizer's states made during the capture are forgotten"
    assert dt.generator.default_generator.rng.bit_generator.state == seed
    assert sf.captures == 0


def test_a_view_of_a_reshard_result_saved_for_backward_keeps_its_block(comm):
    """slice after a reshard returns a view of the reshard's temporary; max saves that view for
    its backward. The temporary's arena block must live as long as the view (it was freed at
    the slice, and a later block overwrote the saved values: NaN gradients on replay)."""
    mesh = _square_or_line()
    S, R = dt.Shard, dt.Replicate
    rest = [R()] * (mesh.ndim - 1)
    rng = np.random.default_rng(6)
    P, W = rng.standard_normal((4, 4)), rng.standard_normal((1, 4))
    p = dt.shard_tensor(P, mesh, [S(0)] + rest, stop_gradient=False)
    w = dt.shard_tensor(W, mesh, [R()] * mesh.ndim)

    def step(x):
        h = dt.softmax(p * x, axis=1)  # rows split over the mesh: h[1:] reshards them to
        h = h[1:]                      # columns first and returns a view of that temporary
        h = dt.softmax(dt.max(h, axis=0, keepdim=True), axis=1)
        loss = dt.sum(h * w)
        loss.backward()
        return loss
    f = dt.jit.to_static(step)
    want = np.zeros_like(P)
    for k in range(4):
        X = np.full((4, 4), 1.0 + 0.5 * k)
        f(dt.shard_tensor(X, mesh, [S(1)] * mesh.ndim))
        # numpy: loss = sum(softmax(max(softmax(P*X)[1:], axis=0)) * W)
        e = np.exp(P * X - (P * X).max(1, keepdims=True))
        s1 = e / e.sum(1, keepdims=True)
        m = s1[1:].max(0, keepdims=True)
        e2 = np.exp(m - m.max())
        s2 = e2 / e2.sum()
        gm = s2 * (W - (W * s2).sum())                 # softmax backward
        hit = s1[1:] == m                               # max backward (no ties here)
        gs1 = np.zeros_like(P)
        gs1[1:] = hit * gm / hit.sum(0, keepdims=True)
        want += (s1 * (gs1 - (gs1 * s1).sum(1, keepdims=True))) * X
        np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-10, atol=1e-12,
                                   err_msg=f"call {k}")
    assert f.captures == 2  # no .grad at the first call, one after: then replays


def test_inplace_update_computed_in_another_layout_reaches_the_target(comm):
    """An inplace op whose rule computes in another layout than the target's, then stores the
    result back (its kernel returns a temporary, not the target's array): replays update the
    target itself (an external state here), on ranks holding empty pieces of that layout too."""
    mesh = _square_or_line()
    S, R = dt.Shard, dt.Replicate
    rng = np.random.default_rng(21)
    S0, O = rng.standard_normal((1, 6)), rng.standard_normal((1, 6))
    state = dt.shard_tensor(S0, mesh, [R()] * (mesh.ndim - 1) + [S(1)])
    other = dt.shard_tensor(O, mesh, [S(0)] * mesh.ndim)  # one row: most ranks hold none

    def step(x):
        state.multiply_(other)
        return (state * x).sum()
    f = dt.jit.to_static(step)
    want = S0.copy()
    for k in range(4):
        X = np.full((1, 6), 1.0 + k)
        loss = f(dt.shard_tensor(X, mesh, [R()] * mesh.ndim))
        want = want * O
        np.testing.assert_allclose(state.numpy(), want, rtol=1e-12, err_msg=f"call {k}")
        np.testing.assert_allclose(float(loss.numpy()), (want * X).sum(), rtol=1e-12)
    assert f.captures == 1


def test_a_rank_swapping_with_itself_gets_a_new_array(comm):
    """A pairwise exchange inside an op's plan ([R,S(0)] -> [S(0),S(0)] on 2x2): the ranks on
    the diagonal keep their piece. Their step must still return a new array: the captured
    program frees the input's block after the step, and a later block there overwrote the
    saved value max's backward compares with (wrong gradients on replay)."""
    mesh = _square_or_line()
    S, R = dt.Shard, dt.Replicate
    P = np.random.default_rng(5).standard_normal(7)
    W = np.array([0.7, -1.3])
    p = dt.shard_tensor(P, mesh, [R()] * (mesh.ndim - 1) + [S(0)], stop_gradient=False)
    w = dt.shard_tensor(W, mesh, [R()] * mesh.ndim)

    def step(x):
        h = dt.max(p * x, axis=0, keepdim=True)
        loss = dt.sum(dt.concat([h, dt.gelu(h)], axis=0) * w)
        loss.backward()
        return loss
    f = dt.jit.to_static(step)
    want = np.zeros(7)
    for k in range(4):
        X = np.full(7, 1.0 + 0.5 * k)
        f(dt.shard_tensor(X, mesh, [S(0)] * mesh.ndim))
        m = (P * X).max()
        dgelu = 0.5 * (1 + math.erf(m / math.sqrt(2))) + m * math.exp(-m * m / 2) / math.sqrt(
            2 * math.pi)
        want += (P * X == m) * (W[0] + W[1] * dgelu) * X
        np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-12, err_msg=f"call {k}")
