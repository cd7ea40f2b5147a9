"""examples/gpt2.py and examples/llama.py against numpy and against their dense runs: values
and gradients at a tiny size (uneven batch and vocabulary pieces), the loss curve over 20
steps, captured steps, and sampling with the batch on dp and the heads on mp."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor import Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))
import gpt2  # noqa: E402
import language_model as lm  # noqa: E402
import llama  # noqa: E402
import numpy_models  # noqa: E402

pytestmark = pytest.mark.mpi

EXAMPLES = {"gpt2": gpt2, "llama": llama}
TINY = argparse.Namespace(dim=16, layers=1, heads=4, vocab=11, seq=5)
SMALL = argparse.Namespace(dim=32, layers=2, heads=4, vocab=64, seq=16)


def _numpy_loss(name: str, args: argparse.Namespace):
    if name == "gpt2":
        return lambda p, x, y: numpy_models.gpt2_loss(p, x, y, args.layers, args.heads)
    return lambda p, x, y: numpy_models.llama_loss(p, x, y, args.layers, args.heads,
                                                   max(1, args.heads // 2))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_forward_backward_match_numpy(name, comm):
    """float64 loss and every parameter's gradient on the default mesh (batch 3 over dp, the
    vocabulary of 11 over mp: uneven pieces) against the numpy model and central
    differences (at 32 elements of each parameter)."""
    dt.seed(1)
    model = EXAMPLES[name].build(TINY)
    model.to(dtype="float64")
    params = {k: p.numpy().astype(np.float64) for k, p in model.named_parameters()}
    x, y = lm.token_data(3, 3, TINY.seq, TINY.vocab)
    loss_fn = _numpy_loss(name, TINY)
    want = grads = None
    if comm.rank == 0:
        want = loss_fn(params, x, y)
        grads = numpy_models.numeric_grads(lambda p: loss_fn(p, x, y), params)
    want, grads = comm.bcast((want, grads), root=0)
    mesh = lm.make_mesh(dt.get_world_size())
    lm.distribute(model, mesh, EXAMPLES[name].PLAN)
    _, loss = model(lm.to_batch(x, mesh), lm.to_batch(y, mesh))
    loss.backward()
    np.testing.assert_allclose(float(loss.numpy()), want, rtol=1e-10)
    for k, p in model.named_parameters():
        at, want_grad = grads[k]
        np.testing.assert_allclose(p.grad.numpy().reshape(-1)[at], want_grad, rtol=1e-6,
                                   atol=1e-8, err_msg=f"{name}: gradient of {k}")


def _run(name: str, mesh, steps: int, to_static: bool = False) -> list[float]:
    dt.seed(0)
    model = lm.distribute(EXAMPLES[name].build(SMALL), mesh, EXAMPLES[name].PLAN)
    return lm.train(model, mesh, steps, 8, SMALL.vocab, to_static=to_static)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_loss_curve_equals_dense_and_captured_equals_eager(name, comm):
    """20 float32 steps on the [dp, mp] mesh: the dense run's losses within 1e-5 relative;
    the captured steps give the eager losses."""
    mesh = lm.make_mesh(dt.get_world_size())
    dense = _run(name, None, 20)
    eager = _run(name, mesh, 20)
    captured = _run(name, mesh, 20, to_static=True)
    assert dense[-1] < 0.8 * dense[0], "the synthetic task must be learnable"
    np.testing.assert_allclose(eager, dense, rtol=1e-5)
    np.testing.assert_allclose(captured, eager, rtol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generation_equals_dense_token_for_token(name, comm):
    """16 tokens sampled (top-k + multinomial on the last position, eval + no_grad) with the
    batch on dp and the heads on mp equal the dense loop's."""
    def sample(mesh):
        dt.seed(0)
        model = lm.distribute(EXAMPLES[name].build(SMALL), mesh, EXAMPLES[name].PLAN)
        model.eval()
        start, _ = lm.token_data(1, 4, 1, SMALL.vocab)
        idx = lm.to_batch(start, mesh)
        dt.seed(7)
        out = lm.generate(model, idx, 16, top_k=8)
        return model, idx, out
    _, _, dense = sample(None)
    mesh = lm.make_mesh(dt.get_world_size())
    model, idx, out = sample(mesh)
    assert idx.placements == [Shard(0), Replicate()]
    head_proj = model.h[0].attn.c_attn if name == "gpt2" else model.layers[0].attention.wq
    heads = Shard(1, split_factor=3) if name == "gpt2" else Shard(1)  # gpt2: fused q, k, v
    assert head_proj.weight.placements == [Replicate(), heads]
    assert out.shape == [4, 17] and out.placements[0] == Shard(0)
    np.testing.assert_array_equal(out.numpy(), dense.numpy())
