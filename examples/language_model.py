"""What the GPT-2 and LLaMA examples share: the synthetic next-token task, the [dp, mp] mesh,
the training loop (eager or captured) and nanoGPT's sampling loop.

A model here is a ``Layer`` whose ``forward(idx, targets=None)`` returns ``(logits, loss)``
(the logits of the last position only when ``targets`` is None) and that has ``block_size``.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard, nn


def token_data(seed: int, n: int, seq: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sequences that follow a fixed random permutation of the vocabulary, as
    (inputs, next-token targets), both int64 ``[n, seq]``."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab)
    toks = np.empty((n, seq + 1), dtype=np.int64)
    toks[:, 0] = rng.integers(0, vocab, n)
    for i in range(seq):
        toks[:, i + 1] = perm[toks[:, i]]
    return toks[:, :-1], toks[:, 1:]


def lm_loss(logits: dt.Tensor, targets: dt.Tensor) -> dt.Tensor:
    """Mean cross entropy of ``logits`` ``[b, s, vocab]`` against ``targets`` ``[b, s]``."""
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), targets.reshape([-1]))


def make_mesh(world: int, spec: str | None = None) -> dt.ProcessMesh:
    """The [dp, mp] mesh: ``spec`` "dp,mp", else 2 x 2 on 4 ranks and world x 1 otherwise."""
    dp, mp = (int(v) for v in spec.split(",")) if spec else \
        ((2, 2) if world == 4 else (world, 1))
    if dp * mp != world:
        raise SystemExit(f"mesh {dp}x{mp} needs {dp * mp} ranks, running on {world}")
    return dt.ProcessMesh(np.arange(world).reshape(dp, mp).tolist(), dim_names=["dp", "mp"])


def distribute(model: nn.Layer, mesh: dt.ProcessMesh | None, plan: dict) -> nn.Layer:
    """``model`` on ``mesh`` by the tensor-parallel ``plan``, inputs and targets on dp
    (unchanged without a mesh)."""
    if mesh is not None:
        dt.parallelize(model, None, mesh, {"dp_config": {"sharding_level": 0},
                                           "mp_config": {"parallelize_plan": plan}})
    return model


def to_batch(a: np.ndarray, mesh: dt.ProcessMesh | None) -> dt.Tensor:
    """A global int array as a tensor, its batch on dp when there is a mesh."""
    t = dt.to_tensor(a)
    return t if mesh is None else dt.shard_tensor(t, mesh, [Shard(0), Replicate()])


def train(model: nn.Layer, mesh: dt.ProcessMesh | None, steps: int, batch: int,
          vocab: int, lr: float = 3e-3, to_static: bool = False, log: bool = False,
          seed: int = 0) -> list[float]:
    """``steps`` AdamW steps on :func:`token_data` batches of ``batch`` sequences of
    ``model.block_size`` tokens; returns the losses. ``log`` prints loss and tokens/s."""
    opt = dt.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), weight_decay=0.0)
    xs, ys = token_data(seed, batch * 4, model.block_size, vocab)

    def step(x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss
    if to_static:  # recompute: the norms' gradients reuse the forward's all-reduced inputs
        step = dt.jit.to_static(step, recompute=True)
    losses = []
    for i in range(steps):
        rows = slice((i % 4) * batch, (i % 4 + 1) * batch)
        t0 = time.perf_counter()
        loss = step(to_batch(xs[rows], mesh), to_batch(ys[rows], mesh))
        losses.append(float(loss.numpy()))
        elapsed = time.perf_counter() - t0
        if log and dt.get_rank() == 0:
            print(f"step {i + 1:4d}  loss {losses[-1]:.6f}  "
                  f"{batch * model.block_size / elapsed:10.1f} tokens/s", flush=True)
    return losses


@dt.no_grad()
def generate(model: nn.Layer, idx: dt.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None) -> dt.Tensor:
    """nanoGPT's sampling loop: append ``max_new_tokens`` tokens to ``idx`` ``[b, t]``, each
    drawn by ``multinomial`` from the softmax of the last position's logits restricted to the
    ``top_k`` largest. Run under ``model.eval()``; ``dt.seed`` fixes the draws."""
    for _ in range(max_new_tokens):
        idx_cond = idx if idx.shape[1] <= model.block_size else idx[:, -model.block_size:]
        logits, _ = model(idx_cond)
        logits = logits[:, -1, :] / temperature
        if top_k is not None:
            v, _ = dt.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < v[:, [-1]]] = float("-inf")
        probs = F.softmax(logits, axis=-1)
        idx = dt.concat([idx, dt.multinomial(probs, num_samples=1)], axis=1)
    return idx


def main(build: Callable[[argparse.Namespace], nn.Layer], plan: dict, description: str,
         argv: list[str] | None = None) -> dict:
    """The examples' command line: train ``build(args)`` (dense with ``--dense``, else on the
    [dp, mp] mesh by ``plan``), then with ``--generate N`` sample N tokens after the first
    token of four training sequences. Returns ``{"losses", "tokens"}``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mesh", default=None, help="dp,mp (default 2,2 on 4 ranks, world,1 else)")
    p.add_argument("--dense", action="store_true", help="plain dense tensors, no mesh")
    p.add_argument("--to-static", action="store_true", help="capture each training step")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="then sample N tokens")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dt.init_parallel_env()
    mesh = None if args.dense else make_mesh(dt.get_world_size(), args.mesh)
    dt.seed(args.seed)
    model = distribute(build(args), mesh, plan)
    losses = train(model, mesh, args.steps, args.batch, args.vocab, args.lr, args.to_static,
                   log=True, seed=args.seed)
    tokens = None
    if args.generate:
        model.eval()
        start, _ = token_data(args.seed, 4, 1, args.vocab)
        tokens = generate(model, to_batch(start, mesh), args.generate,
                          top_k=args.top_k).numpy()
        if dt.get_rank() == 0:
            print("generated:", tokens.tolist(), flush=True)
    return {"losses": losses, "tokens": tokens}
