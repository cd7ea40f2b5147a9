"""Rematerialization in captured steps (``to_static(..., recompute=True)``): cheap forward ops run
again in the backward so their outputs die at the end of the forward.

Oracles: a two-layer step's values and SGD updates written with numpy alone (the tanh GELU and
its derivative by hand); train.py's models against their eager runs, bitwise."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from test_memory import tightness  # noqa: E402  (tests/jit is on sys.path under pytest)

import disttensor as dt
import disttensor.nn.functional as F
from disttensor.jit import verify

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import train  # noqa: E402

WORLD = dt.get_world_size()
C, A = np.sqrt(2.0 / np.pi), 0.044715


def _gelu_np(u):
    return 0.5 * u * (1.0 + np.tanh(C * (u + A * u ** 3)))


def _gelu_grad_np(u):
    t = np.tanh(C * (u + A * u ** 3))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t ** 2) * C * (1.0 + 3.0 * A * u ** 2)


def _two_layer(recompute: bool, dropout: float = 0.0):
    rng = np.random.default_rng(3)
    w1, w2 = rng.standard_normal((16, 32)), rng.standard_normal((32, 4)) * 0.3
    p1 = dt.create_parameter([16, 32], "float64")
    p2 = dt.create_parameter([32, 4], "float64")
    p1.set_value(w1)
    p2.set_value(w2)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=[p1, p2])

    def step(x):
        u = dt.matmul(x, p1)
        if dropout:  # gelu's input is then a random op's output
            u = F.dropout(u, dropout)
        h = F.gelu(u, approximate=True)
        loss = dt.matmul(h, p2).sum()
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss
    return dt.jit.to_static(step, recompute=recompute), (p1, p2), (w1, w2)


def test_a_recomputed_gelu_gives_numpys_values_and_updates():
    step, (p1, p2), (w1, w2) = _two_layer(recompute=True)
    x = np.random.default_rng(4).standard_normal((8, 16))
    for _ in range(3):
        loss = step(dt.to_tensor(x))
        u = x @ w1
        h = _gelu_np(u)
        np.testing.assert_allclose(loss.numpy(), (h @ w2).sum(), rtol=1e-12)
        g_w2 = h.T @ np.ones((8, 4))
        g_w1 = x.T @ ((np.ones((8, 4)) @ w2.T) * _gelu_grad_np(u))
        w1, w2 = w1 - 0.1 * g_w1, w2 - 0.1 * g_w2
        np.testing.assert_allclose(p1.numpy(), w1, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(p2.numpy(), w2, rtol=1e-10, atol=1e-12)
    prog = step.program
    assert step.captures == 1
    (m, copy), = prog.recomputed   # gelu's output, read by p2's gradient
    assert prog.values[m].shape == (8, 32)
    recomputing = [op for op in prog.backward.ops if copy in op.outs]
    assert [op.name for op in recomputing] == ["gelu"]
    assert "recomputes #" in str(prog)
    # the forward's gelu output is no middle any more: it dies inside the forward
    assert m not in prog.forward.outputs["middles"]
    n_fwd = sum(len(op.steps) for op in prog.forward.ops)
    assert prog.memory.last[m] < n_fwd <= prog.memory.first[copy]
    verify(prog, prog.memory)


def test_without_recompute_the_gelu_output_is_a_middle():
    step, _, _ = _two_layer(recompute=False)
    step(dt.to_tensor(np.ones((8, 16))))
    prog = step.program
    assert prog.recomputed == []
    gelu = next(op for op in prog.forward.ops if op.name == "gelu")
    assert gelu.outs[0] in prog.forward.outputs["middles"]


def test_a_random_op_is_never_recomputed_and_the_masks_match_eager():
    x = np.random.default_rng(5).standard_normal((8, 16))
    results = []
    for recompute in (False, True):
        dt.seed(11)
        step, params, _ = _two_layer(recompute=recompute, dropout=0.5)
        losses = [float(step(dt.to_tensor(x)).numpy()) for _ in range(3)]
        results.append((losses, [p.numpy() for p in params], step.program))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)
    prog = results[1][2]
    by_value = {v: op for op in prog.ops for v in op.outs}
    assert [by_value[m].name for m, _ in prog.recomputed] == ["gelu"]  # from the kept mask
    dropout = next(op for op in prog.forward.ops if op.name == "dropout")
    assert dropout.outs[0] in prog.forward.outputs["middles"]  # read by gelu's gradient


@pytest.mark.mpi
@pytest.mark.parametrize("scope", ["kernels", "all"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_recomputed_train_steps_equal_eager_and_hold_less(model_name, scope, comm):
    mesh = train.default_mesh(WORLD)

    def run(recompute, captured=True):
        model, opt, batches = train.build(model_name, 7, mesh, batch=32, size="large")
        step = (lambda x, y: train.train_step(model, opt, x, y))
        if captured:
            step = dt.jit.to_static(step, plan_memory=scope, recompute=recompute)
        losses = [float(step(*train.to_tensors(*batches[k % 4], mesh)).numpy())
                  for k in range(5)]
        return losses, {k: v.numpy() for k, v in model.state_dict().items()}, step
    eager = run(False, captured=False)
    plain = run(False)
    remat = run(True)
    assert remat[0] == eager[0]
    for k in eager[1]:
        np.testing.assert_array_equal(remat[1][k], eager[1][k], err_msg=k)
    prog = remat[2].program
    verify(prog, prog.memory)
    report = prog.memory_report()
    tight = tightness(scope, recompute=True)
    bound = report["lower_bound_bytes"]
    assert bound <= report["arena_bytes"] <= tight * bound
    if model_name == "gpt":  # gelu and layer_norm (after its all-reduce, where it has one)
        names = {op.name for op in prog.backward.ops if "recomputes #" in op.attrs}
        assert {"gelu", "layer_norm"} <= names
        # layer_norm's gradient reads the input the forward all-reduced, not resharding it
        for op in prog.backward.ops:
            if op.name == "layer_norm_grad":
                x_reg = prog.values[op.ins[0]].reg
                assert not [st for st in op.steps if st.kind == "collective" and x_reg in st.ins]
        if scope == "all":  # every temporary is in the arena: the whole step's bound shrinks
            before = plain[2].program.memory_report()["lower_bound_bytes"]
            assert report["lower_bound_bytes"] < 0.9 * before
    else:  # the MLP's middles are matmul and batch_norm outputs: nothing cheap to recompute
        assert prog.recomputed == []


def _ln_np(h, eps=1e-5):
    mu = h.mean(-1, keepdims=True)
    sigma = np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)
    return (h - mu) / sigma, sigma


@pytest.mark.mpi
def test_a_layer_norm_of_a_partial_input_all_reduces_once_and_is_recomputed(comm):
    """Row-parallel ``x @ w1`` is Partial: layer_norm all-reduces it in the forward, and autograd
    saves the reduced value, so its gradient reads it (no second all-reduce, captured or not).
    Recomputed, the Partial value dies in the forward and layer_norm's output (read by w2's
    gradient) is rebuilt from the reduced value. Oracle: numpy's values and SGD updates, the
    layer_norm derivative written by hand."""
    mesh = dt.ProcessMesh(list(range(WORLD)), dim_names=["mp"])
    rng = np.random.default_rng(6)
    w1, w2 = rng.standard_normal((4 * WORLD, 16)), rng.standard_normal((16, 3))
    runs = {}
    for recompute in (False, True):
        p1 = dt.shard_tensor(dt.create_parameter([4 * WORLD, 16], "float64"), mesh,
                             [dt.Shard(0)])
        p2 = dt.shard_tensor(dt.create_parameter([16, 3], "float64"), mesh, [dt.Replicate()])
        p1.set_value(w1)
        p2.set_value(w2)
        opt = dt.optimizer.SGD(learning_rate=0.1, parameters=[p1, p2])

        gamma = dt.shard_tensor(np.ones(16), mesh, [dt.Replicate()], stop_gradient=True)
        beta = dt.shard_tensor(np.zeros(16), mesh, [dt.Replicate()], stop_gradient=True)

        def step(x, p1=p1, p2=p2, opt=opt, gamma=gamma, beta=beta):
            n = F.layer_norm(dt.matmul(x, p1), 16, gamma, beta)
            loss = dt.matmul(n, p2).sum()
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            return loss
        runs[recompute] = (dt.jit.to_static(step, plan_memory="all", recompute=recompute),
                           p1, p2)
    v1, v2 = w1, w2
    for k in range(3):
        x = np.random.default_rng(10 + k).standard_normal((8, 4 * WORLD))
        n, sigma = _ln_np(x @ v1)
        g_n = np.ones((8, 3)) @ v2.T
        g_h = (g_n - g_n.mean(-1, keepdims=True) - n * (g_n * n).mean(-1, keepdims=True)) / sigma
        loss = (n @ v2).sum()
        v1, v2 = v1 - 0.1 * x.T @ g_h, v2 - 0.1 * n.T @ np.ones((8, 3))
        for step, p1, p2 in runs.values():
            out = step(dt.shard_tensor(x, mesh, [dt.Shard(1)]))
            np.testing.assert_allclose(out.numpy(), loss, rtol=1e-10)
            np.testing.assert_allclose(p1.numpy(), v1, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(p2.numpy(), v2, rtol=1e-9, atol=1e-12)
    plain, remat = runs[False][0].program, runs[True][0].program
    verify(remat, remat.memory)
    by_value = {v: op for op in remat.ops for v in op.outs}
    assert {by_value[m].name for m, _ in remat.recomputed} == {"layer_norm"}
    ln = next(op for op in remat.forward.ops if op.name == "layer_norm")
    grad = next(op for op in remat.backward.ops if op.name == "layer_norm_grad")
    if WORLD > 1:  # the reduced value is the middle, read by the gradient without a collective
        assert ln.ins[0] not in remat.forward.outputs["middles"]  # the Partial value
        reduced, = ln.scratch
        assert grad.ins[0] == reduced and reduced in remat.forward.outputs["middles"]
        for prog in (plain, remat):
            grad = next(op for op in prog.backward.ops if op.name == "layer_norm_grad")
            assert not grad.collectives and len(grad.steps) == 1
    else:  # a Partial over one rank needs no collective: the kernel reads the value itself
        assert grad.ins[0] == ln.ins[0] and not ln.scratch


@pytest.mark.mpi
def test_reshards_saved_for_the_backward_alike_on_every_rank(comm):
    """Which reshard results autograd saves for the backward is decided from the plan, not from
    local sizes: [3, 5, 4] laid out unevenly on 2x2, an all-to-all's result is larger than its
    input on some ranks and smaller on others, and deciding by size made the ranks issue
    different collectives (h.multiply_(e) reshards e, which h's gradient reads).
    Values and gradients against numpy over replays."""
    if WORLD != 4:
        pytest.skip("the uneven 2x2 layout needs 4 ranks")
    mesh = dt.ProcessMesh([[0, 1], [2, 3]])
    S, R = dt.Shard, dt.Replicate
    rng = np.random.default_rng(404)
    A, E, W = (rng.standard_normal((3, 5, 4)) for _ in range(3))
    p = dt.shard_tensor(A, mesh, [S(2), R()], stop_gradient=False)
    e = dt.shard_tensor(E, mesh, [S(1), S(2)], stop_gradient=False)
    w = dt.shard_tensor(W, mesh, [R(), R()])

    def step(x):
        h = p * x
        h.multiply_(e)
        loss = dt.sum(F.relu(h) * w)
        loss.backward()
        return loss
    f = dt.jit.to_static(step, recompute=True)
    gp, ge = np.zeros_like(A), np.zeros_like(E)
    for k in range(3):
        X = np.full((3, 5, 4), 1.0 + 0.5 * k)
        loss = f(dt.shard_tensor(X, mesh, [R(), S(2)]))
        h = A * X * E
        np.testing.assert_allclose(float(loss.numpy()), (np.maximum(h, 0) * W).sum(),
                                   rtol=1e-12)
        gh = W * (h > 0)
        gp, ge = gp + gh * E * X, ge + gh * A * X
        np.testing.assert_allclose(p.grad.numpy(), gp, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(e.grad.numpy(), ge, rtol=1e-12, atol=1e-12)
