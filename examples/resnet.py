"""Train a ResNet-18-shaped network (BasicBlocks, Paddle API) on synthetic images, data
parallel: the batch is sharded over every rank, the weights replicated (their gradients are
all-reduced), batch norm all-reduces its statistics. ``--spatial`` shards the images' height
over the ranks instead: convolutions and max pooling exchange halos with their neighbours.

    mpirun -n 4 python examples/resnet.py               # data parallel on 4 ranks
    mpirun -n 4 python examples/resnet.py --to-static   # each step a captured program
    mpirun -n 4 python examples/resnet.py --spatial --image-size 64   # H over the 4 ranks
    python examples/resnet.py --dense                   # plain dense tensors, no mesh

Prints the loss and images/s; the loss curve does not depend on the number of ranks
(tests/vision/test_resnet.py checks it against the dense run and a numpy reference).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard, nn


class BasicBlock(nn.Layer):
    """Two 3x3 conv + BatchNorm2D; a 1x1 conv + BatchNorm2D shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2D(cin, cout, 3, stride=stride, padding=1, bias_attr=False)
        self.bn1 = nn.BatchNorm2D(cout)
        self.conv2 = nn.Conv2D(cout, cout, 3, padding=1, bias_attr=False)
        self.bn2 = nn.BatchNorm2D(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2D(cin, cout, 1, stride=stride, bias_attr=False),
                                      nn.BatchNorm2D(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Layer):
    """ResNet-18's shape at width ``width`` (stages of ``width * 1, 2, 4, 8`` channels, two
    blocks each by default); a 3x3 stem and a max pool for small images."""

    def __init__(self, width: int = 16, classes: int = 10, blocks: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2D(3, width, 3, padding=1, bias_attr=False),
                                  nn.BatchNorm2D(width), nn.ReLU(), nn.MaxPool2D(3, 2, 1))
        layers, cin = [], width
        for k, n in enumerate(blocks):
            cout = width * 2 ** k
            for b in range(n):
                layers.append(BasicBlock(cin, cout, 2 if b == 0 and k > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(dt.flatten(self.pool(self.layers(self.stem(x))), 1))


def images(rng, n: int, size: int, classes: int, dtype: str):
    """Synthetic images whose class is the quadrant and colour of a bright patch."""
    y = rng.integers(0, classes, n)
    x = rng.standard_normal((n, 3, size, size)) * 0.5
    h = size // 2
    for i, c in enumerate(y):
        r, q = divmod(int(c) % 4, 2)
        x[i, int(c) % 3, r * h:(r + 1) * h, q * h:(q + 1) * h] += 1.0 + int(c) // 4
    return x.astype(dtype), y.astype(np.int64)


def build(args, mesh: dt.ProcessMesh | None):
    """(model, optimizer, batches): the model, Momentum SGD, and four global batches."""
    dt.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = ResNet(args.width, args.classes, tuple(args.blocks))
    if args.dtype != "float32":
        model.to(dtype=args.dtype)
    if mesh is not None:  # every parameter and buffer replicated on the mesh
        dt.shard_layer(model, mesh)
    opt = dt.optimizer.Momentum(args.lr, momentum=0.9, parameters=model.parameters())
    x_all, y_all = images(rng, args.batch * 4, args.image_size, args.classes, args.dtype)
    batches = [(x_all[k * args.batch:(k + 1) * args.batch],
                y_all[k * args.batch:(k + 1) * args.batch]) for k in range(4)]
    return model, opt, batches


def to_tensors(xb, yb, mesh, spatial: bool = False):
    """A batch: sharded on the batch (or with ``spatial`` the images' H) over the mesh."""
    x, y = dt.to_tensor(xb), dt.to_tensor(yb)
    if mesh is None:
        return x, y
    if spatial:
        return dt.shard_tensor(x, mesh, [Shard(2)]), dt.shard_tensor(y, mesh, [Replicate()])
    return dt.shard_tensor(x, mesh, [Shard(0)]), dt.shard_tensor(y, mesh, [Shard(0)])


def train(args, mesh: dt.ProcessMesh | None) -> list[float]:
    model, opt, batches = build(args, mesh)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss
    if args.to_static:
        step = dt.jit.to_static(step)
    losses, rank0 = [], dt.get_rank() == 0
    t_start = time.perf_counter()
    for k in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = float(step(*to_tensors(*batches[(k - 1) % 4], mesh, args.spatial)).numpy())
        losses.append(loss)
        took = time.perf_counter() - t0
        if rank0 and (k % args.log_interval == 0 or k == 1):
            print(f"[resnet] step {k:4d}  loss {loss:.6f}  step time {took * 1e3:8.2f} ms  "
                  f"{args.batch / took:8.1f} images/s", flush=True)
    total = time.perf_counter() - t_start
    if rank0 and losses:
        print(f"[resnet] done: {args.steps} steps in {total:.2f} s, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, {args.steps * args.batch / total:.1f} images/s", flush=True)
    return losses


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", action="store_true", help="no mesh: plain dense tensors")
    p.add_argument("--to-static", action="store_true", help="capture each step into a program")
    p.add_argument("--spatial", action="store_true",
                   help="shard the images' H over the ranks instead of the batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--blocks", type=int, nargs="+", default=[2, 2, 2, 2],
                   help="BasicBlocks per stage")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--log-interval", type=int, default=5)
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    dt.init_parallel_env()
    mesh = None if args.dense else dt.ProcessMesh(list(range(dt.get_world_size())),
                                                  dim_names=["h" if args.spatial else "dp"])
    return train(args, mesh)


if __name__ == "__main__":
    main()
