"""Bucketed data-parallel gradient sync: train.py's tiny GPT syncs its leaf gradients with at
most 2 all-reduces per step (37 parameters), and the gradients and the trained values equal the
unbucketed run (one all-reduce per parameter) and the dense run."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import dispatch, grad_sync

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.mpi

SYNC_OPS = ("grad_bucket_sync", "reshard")


def _step(bucket_bytes: int, mesh):
    """Grads after one backward, the sync ops' collectives, and the losses of 3 steps."""
    grad_sync.set_bucket_bytes(bucket_bytes)
    try:
        model, opt, batches = train.build("gpt", 5, mesh)
        sync = []

        def rec(r):
            if r.op in SYNC_OPS:
                sync.extend(r.collectives)
        losses, grads = [], None
        for k in range(3):
            x, y = train.to_tensors(*batches[k], mesh)
            loss = dt.nn.functional.cross_entropy(model(x), y)
            dispatch.add_recorder(rec)
            try:
                loss.backward()
            finally:
                dispatch.remove_recorder(rec)
            if grads is None:
                grads = [p.grad.numpy() for p in model.parameters()]
                n_sync = len(sync)
            opt.step()
            opt.clear_grad(set_to_zero=False)
            losses.append(float(loss.numpy()))
        return grads, n_sync, losses, len(model.parameters())
    finally:
        grad_sync.set_bucket_bytes(25 * 2 ** 20)


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


def test_bucket_size_is_checked():
    with pytest.raises(ValueError, match="set_bucket_bytes: nbytes must be an int >= 0"):
        grad_sync.set_bucket_bytes(-1)
