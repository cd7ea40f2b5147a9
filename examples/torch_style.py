"""Tensor parallelism + FSDP written as a PyTorch DTensor user writes it: a 2-d ("dp", "tp")
device mesh, ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on
``mesh["tp"]``, ``fully_shard`` on ``mesh["dp"]`` (ZeRO-3: every parameter sharded over dp,
gathered by the op that uses it), batches from ``distribute_tensor``.

    mpirun -n 4 python examples/torch_style.py           # 2 x 2 (dp, tp)
    python examples/torch_style.py --dense               # the same program on one process

Differences from PyTorch, outside the program's structure: ``torch`` is ``disttensor``; the
optimizer takes Paddle's arguments (``learning_rate=``, ``parameters=``); a disttensor
``Linear`` weight is ``[in, out]``; the styles keep DTensors between modules
(``use_local_output=False``) so the loss is the global one, as with PyTorch's loss_parallel.
"""
from __future__ import annotations

import argparse

import numpy as np

import disttensor as dist  # was: torch.distributed(.tensor/.fsdp)
import disttensor as torch  # was: import torch
import disttensor.nn.functional as F  # was: torch.nn.functional
from disttensor import Replicate, Shard, nn


class FeedForward(nn.Layer):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Model(nn.Layer):
    def __init__(self, dim: int, hidden: int, out: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, hidden)
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        return self.head(x + self.ff(self.norm(x)))


def data(steps: int, batch: int, dim: int, out: int):
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((dim, out)).astype(np.float32)
    xs = rng.standard_normal((steps, batch, dim)).astype(np.float32)
    return xs, np.tanh(xs @ teacher)


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--mesh", default=None, help="dp,tp (default 2,2 on 4 ranks, world,1 else)")
    ap.add_argument("--dense", action="store_true", help="one process, no mesh")
    args = ap.parse_args(argv)

    torch.seed(0)
    model = Model(args.dim, args.hidden, args.out)
    if not args.dense:
        world = dist.get_world_size()
        dp, tp = (int(v) for v in args.mesh.split(",")) if args.mesh else \
            ((2, 2) if world == 4 else (world, 1))
        mesh = dist.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dist.parallelize_module(model, mesh["tp"], {
            "ff.w1": dist.ColwiseParallel(use_local_output=False),
            "ff.w2": dist.RowwiseParallel(use_local_output=False),
        })
        dist.fully_shard(model, mesh=mesh["dp"])
    opt = torch.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())

    xs, ys = data(args.steps, args.batch, args.dim, args.out)
    losses = []
    for step in range(args.steps):
        if args.dense:
            x, y = torch.to_tensor(xs[step]), torch.to_tensor(ys[step])
        else:
            x = dist.distribute_tensor(xs[step], mesh, [Shard(0), Replicate()])
            y = dist.distribute_tensor(ys[step], mesh, [Shard(0), Replicate()])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    if dist.get_rank() == 0:
        print(f"{len(losses)} steps, loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    main()
