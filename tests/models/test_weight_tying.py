"""Weight tying: one Parameter read by an Embedding and by ``matmul(h, w, transpose_y=True)``
keeps its vocab-parallel layout for both uses, gets one gradient equal to numpy's, and is
never resharded during a step."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor import Replicate, Shard, nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import language_model as lm  # noqa: E402

pytestmark = pytest.mark.mpi

# a vocabulary larger than the tokens of a rank, as in a language model; 97 rows over mp:
# uneven pieces
VOCAB, DIM, BATCH, SEQ = 97, 6, 12, 2


class TiedLM(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.block_size = SEQ

    def forward(self, idx, targets):
        logits = dt.matmul(self.emb(idx), self.emb.weight, transpose_y=True)
        return logits, lm.lm_loss(logits, targets)


def numpy_grad(e: np.ndarray, idx: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """d mean-CE(E[idx] E^T) / dE: the head's part dz^T h plus the embedding's scatter-add."""
    h = e[idx].reshape(-1, DIM)
    z = h @ e.T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(p)), targets.reshape(-1)] -= 1.0
    dz = p / len(p)
    grad = dz.T @ h
    np.add.at(grad, idx.reshape(-1), dz @ e)
    return grad


def test_tied_weight_has_one_layout_and_one_gradient(comm):
    dt.seed(3)
    model = TiedLM()
    e0 = model.emb.weight.numpy().astype(np.float64)
    mesh = lm.make_mesh(dt.get_world_size())
    lm.distribute(model, mesh, {"emb": dt.RowWiseParallel()})
    w = model.emb.weight
    vocab_parallel = [Replicate(), Shard(0)]
    assert w.placements == vocab_parallel
    opt = dt.optimizer.SGD(learning_rate=0.5, parameters=model.parameters())
    assert len(model.parameters()) == 1
    xs, ys = lm.token_data(5, 2 * BATCH, SEQ, VOCAB)
    for step in range(2):
        x, y = xs[step * BATCH:(step + 1) * BATCH], ys[step * BATCH:(step + 1) * BATCH]
        before = w.numpy().astype(np.float64)
        with dt.jit.record() as calls:
            _, loss = model(lm.to_batch(x, mesh), lm.to_batch(y, mesh))
            loss.backward()
        assert w.grad.placements == vocab_parallel
        np.testing.assert_allclose(w.grad.numpy(), numpy_grad(before, x, y), rtol=1e-5,
                                   atol=1e-6)
        opt.step()
        opt.clear_grad(set_to_zero=False)
        assert model.emb.weight is w and w.placements == vocab_parallel
        # the weight is read where it lies: no call reshards it, nothing is gathered
        assert not [c for c in calls if c.op == "reshard" and c.inputs[0] is w]
        assert not [line for line in calls.collectives()
                    if "gather" in line or "all-to-all" in line], str(calls)
    assert not np.allclose(w.numpy(), e0)
