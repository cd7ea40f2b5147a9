"""Bucketed data-parallel gradient sync: train.py's tiny GPT syncs its leaf gradients with at
most 2 all-reduces per step (37 parameters), and the gradients and the trained values equal the
unbucketed run (one all-reduce per parameter) and the dense run; with small buckets the
all-reduces start during the backward (overlapped) and the values stay those of the blocking
and unbucketed runs, eager and captured."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import grad_sync

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi

SYNC_OPS = ("grad_bucket_start", "grad_bucket_wait", "reshard")


def _step(bucket_bytes: int, mesh, overlap: bool = True, order: list | None = None):
    """Grads after one backward, the sync ops' collectives, and the losses of 3 steps
    (``order``: gets the op names of the first backward, in call order)."""
    grad_sync.set_bucket_bytes(bucket_bytes)
    grad_sync.set_overlap(overlap)
    try:
        model, opt, batches = train.build("gpt", 5, mesh)
        sync = []

        def rec(r):
            if r.op in SYNC_OPS:
                sync.extend(r.collectives)
            if order is not None and grads is None:
                order.append(r.op)
        losses, grads = [], None
        for k in range(3):
            x, y = train.to_tensors(*batches[k], mesh)
            loss = dt.nn.functional.cross_entropy(model(x), y)
            with dt.jit.record() as calls:
                loss.backward()
            for r in calls:
                rec(r)
            if grads is None:
                grads = [p.grad.numpy() for p in model.parameters()]
                n_sync = len(sync)
            opt.step()
            opt.clear_grad(set_to_zero=False)
            losses.append(float(loss.numpy()))
        return grads, n_sync, losses, len(model.parameters())
    finally:
        grad_sync.set_bucket_bytes(25 * 2 ** 20)
        grad_sync.set_overlap(True)


def test_tiny_gpt_syncs_in_at_most_two_all_reduces(comm):
    world = collectives.init().size
    mesh = train.default_mesh(world)
    g_b, n_b, l_b, n_params = _step(25 * 2 ** 20, mesh)
    g_u, n_u, l_u, _ = _step(0, mesh)
    g_d, _, l_d, _ = _step(25 * 2 ** 20, None)
    if world > 1:
        assert n_b <= 2, n_b
        assert n_u >= n_params - 8, (n_u, n_params)  # unbucketed: about one per parameter
    for a, b, c in zip(g_b, g_u, g_d):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(l_b, l_u, rtol=1e-6)
    np.testing.assert_allclose(l_b, l_d, rtol=1e-4)


def test_small_buckets_split_the_sync(comm):
    """A bucket limit smaller than the gradients gives several buckets, same values."""
    world = collectives.init().size
    if world == 1:
        pytest.skip("one rank: nothing to reduce")
    mesh = train.default_mesh(world)
    g_small, n_small, _, _ = _step(4096, mesh)
    g_big, n_big, _, _ = _step(25 * 2 ** 20, mesh)
    assert n_small > n_big
    for a, b in zip(g_small, g_big):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _first_start_and_last_compute(order: list) -> tuple[int, int]:
    starts = [i for i, op in enumerate(order) if op == "grad_bucket_start"]
    compute = [i for i, op in enumerate(order) if op not in SYNC_OPS]
    return starts[0], compute[-1]


def test_buckets_start_during_backward_with_the_blocking_values(comm):
    """4 KB buckets: the first all-reduce starts before the backward's last op (overlap); with
    overlap off every bucket starts after it; gradients and losses equal the blocking and the
    unbucketed runs. Every bucket has a wait, after the last start of its kind."""
    world = collectives.init().size
    if world == 1:
        pytest.skip("one rank: nothing to reduce")
    mesh = train.default_mesh(world)
    o_lap, o_blk = [], []
    g_o, n_o, l_o, _ = _step(4096, mesh, overlap=True, order=o_lap)
    g_b, n_b, l_b, _ = _step(4096, mesh, overlap=False, order=o_blk)
    g_u, _, l_u, _ = _step(0, mesh)
    first, last = _first_start_and_last_compute(o_lap)
    assert first < last, o_lap
    first, last = _first_start_and_last_compute(o_blk)
    assert first > last, o_blk
    for order in (o_lap, o_blk):
        assert order.count("grad_bucket_start") == order.count("grad_bucket_wait") > 2
        assert max(i for i, op in enumerate(order) if op == "grad_bucket_start") < \
            min(i for i, op in enumerate(order) if op == "grad_bucket_wait")
    assert n_o == n_b
    for a, b, c in zip(g_o, g_b, g_u):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-7)
    assert l_o == l_b
    np.testing.assert_allclose(l_o, l_u, rtol=1e-6)


def test_captured_step_replays_the_overlapped_sync(comm):
    """A captured train step with 4 KB buckets replays the start/wait pairs where eager ran
    them (a start before the backward's last compute op) and equals the eager run bitwise."""
    world = collectives.init().size
    mesh = train.default_mesh(world)
    grad_sync.set_bucket_bytes(4096)
    try:
        runs = []
        for captured in (False, True):
            model, opt, batches = train.build("gpt", 7, mesh)
            step = (lambda x, y: train.train_step(model, opt, x, y))
            if captured:
                step = dt.jit.to_static(step)
            losses = [float(step(*train.to_tensors(*batches[k % 4], mesh)).numpy())
                      for k in range(4)]
            runs.append((losses, [p.numpy() for p in model.parameters()], step))
    finally:
        grad_sync.set_bucket_bytes(25 * 2 ** 20)
    (l_e, p_e, _), (l_c, p_c, step) = runs
    assert l_c == l_e
    for a, b in zip(p_c, p_e):
        np.testing.assert_array_equal(a, b)
    if world > 1:
        ops = [op.name for op in step.program.ops if op.phase == "backward"]
        first, last = _first_start_and_last_compute(ops)
        assert first < last, ops


@pytest.mark.parametrize("bucket_bytes", [1, 25 * 2 ** 20])
def test_leaf_read_twice_and_root_leaf_get_their_whole_gradient(comm, bucket_bytes):
    """A weight read by two matmuls is final only once both have run; a leaf that is also a
    root adds its seed: gradients equal numpy's on the global arrays (1-byte buckets start
    each gradient's all-reduce the moment it is final)."""
    world = collectives.init().size
    mesh = dt.ProcessMesh(list(range(world)), dim_names=["dp"])
    rng = np.random.default_rng(3)
    X, W, B, C = (rng.standard_normal(s) for s in ((4 * world, 3), (3, 3), (3,), (4 * world, 3)))
    x = dt.shard_tensor(X, mesh, [dt.Shard(0)])
    c = dt.shard_tensor(C, mesh, [dt.Shard(0)])
    w = dt.shard_tensor(W, mesh, [dt.Replicate()], stop_gradient=False)
    b = dt.shard_tensor(B, mesh, [dt.Replicate()], stop_gradient=False)
    starts = []

    def rec(r):
        if r.op == "grad_bucket_start":
            starts.append(len(r.inputs))
    grad_sync.set_bucket_bytes(bucket_bytes)
    try:
        with dt.jit.record() as calls:
            loss = ((dt.matmul(dt.matmul(x, w), w) + b) * c).sum()
            dt.autograd.backward([loss, b], [None, dt.shard_tensor(np.ones(3), mesh,
                                                                    [dt.Replicate()])])
        for r in calls:
            rec(r)
    finally:
        grad_sync.set_bucket_bytes(25 * 2 ** 20)
    if world > 1:  # each gradient synced once, when final
        assert sum(starts) <= 2 and (bucket_bytes > 1 or max(starts) == 1), starts
    np.testing.assert_allclose(w.grad.numpy(), X.T @ (C @ W.T) + (X @ W).T @ C, rtol=1e-10)
    np.testing.assert_allclose(b.grad.numpy(), C.sum(0) + 1, rtol=1e-10)
    assert w.grad.placements == [dt.Replicate()] and b.grad.placements == [dt.Replicate()]


def test_a_backward_that_raises_leaves_no_started_bucket_behind(comm, monkeypatch):
    """tanh's backward raises after w2's bucket has started: the error reaches the caller, the
    bucket is forgotten (no later wait takes it), and the next backward's gradients are
    numpy's."""
    from disttensor.schema import OPS
    world = collectives.init().size
    mesh = dt.ProcessMesh(list(range(world)), dim_names=["dp"])
    rng = np.random.default_rng(5)
    X, W1, W2, C = (rng.standard_normal(s) for s in ((2 * world, 3), (3, 4), (4, 2),
                                                      (2 * world, 2)))
    x, c = (dt.shard_tensor(a, mesh, [dt.Shard(0)]) for a in (X, C))
    w1, w2 = (dt.shard_tensor(a, mesh, [dt.Replicate()], stop_gradient=False) for a in (W1, W2))

    def boom(node, *grads):
        raise RuntimeError("tanh backward failed")
    grad_sync.set_bucket_bytes(1)
    try:
        with monkeypatch.context() as m:
            m.setattr(OPS["tanh"], "backward", boom)
            with pytest.raises(RuntimeError, match="tanh backward failed"):
                (dt.matmul(dt.tanh(dt.matmul(x, w1)), w2) * c).sum().backward()
        assert all(not queue for _, _, queue in grad_sync._PLANS.values())
        assert w1.grad is None and w2.grad is None
        (dt.matmul(dt.tanh(dt.matmul(x, w1)), w2) * c).sum().backward()
    finally:
        grad_sync.set_bucket_bytes(25 * 2 ** 20)
    T = np.tanh(X @ W1)
    np.testing.assert_allclose(w2.grad.numpy(), T.T @ C, rtol=1e-10)
    np.testing.assert_allclose(w1.grad.numpy(), X.T @ ((C @ W2.T) * (1 - T * T)), rtol=1e-10)


def test_bucket_size_is_checked():
    with pytest.raises(ValueError, match="set_bucket_bytes: nbytes must be an int >= 0"):
        grad_sync.set_bucket_bytes(-1)
