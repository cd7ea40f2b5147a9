"""Paddle's auto-parallel guide MLP demo (section 2.3, "parallel strategies outside the
model") with only the imports changed: DP2 x MP2 through ``dist.parallelize`` and
``dist.shard_dataloader``.

    mpirun -n 4 python examples/paddle_style.py            # 2 x 2 [dp, mp] mesh
    python examples/paddle_style.py --dense                # the same program on one process

Differences from the guide, all outside the program's structure: ``paddle`` is ``disttensor``
and ``paddle.io`` is ``disttensor.io``; the mesh is 2 x 2 (the guide's is 2 x 4); the sizes
are arguments (the guide's are the defaults); the dataset draws each sample from a generator
seeded by its index (the guide's ``np.random.uniform`` gives each rank different numbers, so
no run could be compared with the dense one). ``sharding_level`` 1 is ZeRO stage 1 on "dp"
(AdamW's moments sharded). The model is built under ``LazyGuard``: ``parallelize`` samples
each rank's pieces, ``p.initialize()`` then has nothing left to do (with ``--dense`` it
samples the whole parameters). ``--dense`` skips the mesh, ``parallelize`` and
``shard_dataloader``.
"""
from __future__ import annotations

import argparse

import numpy as np

import disttensor as dist  # was: import paddle.distributed as dist
import disttensor as paddle  # was: import paddle
from disttensor.io import BatchSampler, DataLoader, Dataset  # was: from paddle.io import ...


class RandomDataset(Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        super().__init__()
        self.seq_len = seq_len
        self.hidden = hidden
        self.num_samples = num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng(index)
        input = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        label = rng.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return (input, label)

    def __len__(self):
        return self.num_samples


class MlpModel(paddle.nn.Layer):
    def __init__(self, hidden, inter):
        super(MlpModel, self).__init__()
        self.w0 = paddle.nn.Linear(hidden, inter, bias_attr=False)
        self.w1 = paddle.nn.Linear(inter, hidden, bias_attr=False)

    def forward(self, x):
        y = self.w0(x)
        z = self.w1(y)
        return z


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-samples", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dense", action="store_true", help="one process, no mesh")
    args = ap.parse_args(argv)

    paddle.seed(2024)
    if not args.dense:
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        dist.set_mesh(mesh)

    with paddle.LazyGuard():
        model = MlpModel(args.hidden, args.inter)
    opt = paddle.optimizer.AdamW(learning_rate=0.001, parameters=model.parameters())
    if not args.dense:
        parallel_config = {
            "dp_config": {"sharding_level": 1},
            "mp_config": {"parallelize_plan": {"w0": dist.ColWiseParallel(),
                                               "w1": dist.RowWiseParallel()}},
        }
        model, opt = dist.parallelize(model, opt, config=parallel_config)
    for p in model.parameters():
        p.initialize()

    dataset = RandomDataset(args.seq_len, args.hidden, args.num_samples)
    sampler = BatchSampler(dataset, batch_size=args.batch_size)
    dataloader = DataLoader(dataset, batch_sampler=sampler)
    if not args.dense:
        dataloader = dist.shard_dataloader(dataloader, meshes=[mesh], shard_dims="dp")
    loss_fn = paddle.nn.MSELoss()

    losses = []
    for step, (inputs, labels) in enumerate(dataloader()):
        logits = model(inputs)
        loss = loss_fn(logits, labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    if paddle.get_rank() == 0:
        print(f"{len(losses)} steps, loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    return losses


if __name__ == "__main__":
    main()
