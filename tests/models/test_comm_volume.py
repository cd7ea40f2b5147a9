"""Collective bytes per training step of examples/llama.py against the hand-placed Megatron
layout (heads over mp, an all-reduce after each row-parallel projection in the forward, one
per column-parallel input in the backward, the dp gradient sync): the example issues no
weight all-gather, and its eager and captured steps move no more bytes than the hand-placed
one."""
from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor import Partial, Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import language_model as lm  # noqa: E402
import llama  # noqa: E402

pytestmark = pytest.mark.mpi

SIZE = argparse.Namespace(dim=32, layers=2, heads=4, vocab=64, seq=16)
BYTES = re.compile(r"(\d+) bytes per rank|(\d+)-byte bucket")


def step_collectives(model, mesh, captured: bool) -> list[str]:
    """The collectives of the third training step (eager: recorded calls; captured: the
    program's ops), as their printed lines."""
    opt = dt.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    xs, ys = lm.token_data(0, 12, SIZE.seq, SIZE.vocab)   # 12 rows: even over dp at 1-4 ranks

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss
    if captured:
        step = dt.jit.to_static(step, recompute=True)   # as examples/llama.py --to-static
    for _ in range(3):
        with dt.jit.record() as calls:
            step(lm.to_batch(xs, mesh), lm.to_batch(ys, mesh))
    if captured:
        return [c for op in step.program.ops for c in op.collectives]
    return calls.collectives()


def moved(lines: list[str]) -> int:
    return sum(int(a or b) for line in lines for a, b in BYTES.findall(line))


def hand_placed(mesh) -> llama.Transformer:
    """The Megatron layout written out: placements by hand, the row-parallel outputs (and the
    vocab-parallel embedding's) all-reduced where they are made."""
    dt.seed(0)
    model = llama.build(SIZE)
    col, row = [Replicate(), Shard(1)], [Replicate(), Shard(0)]
    for name, sub in model.named_sublayers():
        last = name.rsplit(".", 1)[-1]
        pl = col if last in ("wq", "wk", "wv", "w1", "w3") else \
            row if last in ("wo", "w2", "tok_embeddings") else None
        if pl is not None:
            sub.weight = dt.shard_tensor(sub.weight, mesh, pl)
        if pl is row:
            sub.register_forward_post_hook(
                lambda _l, _i, out: dt.reshard(out, mesh, [Shard(0), Replicate()]))
    for _, sub in model.named_sublayers(include_self=True):
        for pname, p in sub.named_parameters(include_sublayers=False):
            if not p.is_dist():
                setattr(sub, pname, dt.shard_tensor(p, mesh, [Replicate(), Replicate()]))
        for bname, b in sub.named_buffers(include_sublayers=False):
            setattr(sub, bname, dt.shard_tensor(b, mesh, [Replicate(), Replicate()]))
    return model


def test_llama_moves_no_more_bytes_than_megatron(comm):
    mesh = lm.make_mesh(dt.get_world_size())
    megatron = step_collectives(hand_placed(mesh), mesh, captured=False)

    def example():
        dt.seed(0)
        return lm.distribute(llama.build(SIZE), mesh, llama.PLAN)
    eager = step_collectives(example(), mesh, captured=False)
    captured = step_collectives(example(), mesh, captured=True)
    for lines in (megatron, eager, captured):
        assert not [c for c in lines if "gather" in c or "all-to-all" in c], lines
    # autograd saves the resharded value a kernel read, so no backward repeats a forward
    # reshard (rms_norm's Partial input is reduced once)
    assert moved(eager) <= moved(megatron), (moved(eager), moved(megatron))
    assert moved(captured) <= moved(megatron), (moved(captured), moved(megatron))
    if mesh.shape[1] > 1:
        per_block = [c for c in megatron if "on mesh dim 1" in c]
        # forward: embedding + 2 per block; backward: 2 per block + the final norm's input
        assert len(per_block) == 1 + 2 * SIZE.layers + 2 * SIZE.layers + 1
    if comm.rank == 0:
        print(f"bytes per rank per step: megatron {moved(megatron)}, example eager "
              f"{moved(eager)}, captured {moved(captured)}")


def test_backward_reads_the_reshard_its_forward_made(comm):
    """rms_norm of a Partial input all-reduces it once: autograd saves the reduced value the
    kernel read, so the gradient issues no collective; values and gradients against numpy; an
    inplace write to the input after the forward still invalidates the saved value."""
    mesh = dt.ProcessMesh(list(range(dt.get_world_size())))
    rng = np.random.default_rng(3)
    X, W, G = rng.standard_normal((5, 6)), rng.standard_normal(6), rng.standard_normal((5, 6))
    x = dt.shard_tensor(X, mesh, [Partial()], stop_gradient=False)
    w = dt.shard_tensor(W, mesh, [Replicate()], stop_gradient=False)
    with dt.jit.record() as calls:
        y = dt.nn.functional.rms_norm(x * 1.0, 6, w, epsilon=1e-5)
    forward = [c for c in calls.collectives() if c.startswith("rms_norm:")]
    assert len(forward) == (1 if dt.get_world_size() > 1 else 0), forward
    with dt.jit.record() as calls:
        y.backward(dt.shard_tensor(G, mesh, [Replicate()]))
    assert not [c for c in calls.collectives() if c.startswith("rms_norm_grad")], calls
    r = 1 / np.sqrt((X * X).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.numpy(), X * r * W, rtol=1e-12)
    gw = G * W
    np.testing.assert_allclose(x.grad.numpy(), r * gw - X * r ** 3 * (gw * X).mean(
        -1, keepdims=True), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), (G * X * r).sum(0), rtol=1e-10)
    h = x * 1.0
    z = dt.nn.functional.rms_norm(h, 6, w)
    h.scale_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
