"""The train.py MLP step (Linear, BatchNorm1D, ReLU, Linear, cross entropy, SGD) on a [dp, mp]
mesh written with disttensor — eager, or captured with ``dt.jit.to_static`` — beside the same
sharding written by hand with numpy kernels and raw mpi4py collectives (shared by
``benchmarks/dispatch.py`` and ``benchmarks/capture.py``)."""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard


class Sizes:
    def __init__(self, batch: int, din: int, hidden: int, classes: int):
        self.batch, self.din, self.hidden, self.classes = batch, din, hidden, classes


def _data(s: Sizes, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s.batch, s.din)).astype(np.float32)
    y = rng.integers(0, s.classes, s.batch).astype(np.int64)
    return x, y


def _mesh_shape(world: int) -> tuple[int, int]:
    return (2, 2) if world == 4 else (world, 1)


def dt_mlp_step(s: Sizes, lr: float, captured: bool = False):
    """(initial state, step): ``step()`` runs one disttensor step and returns its loss."""
    import train

    dt.seed(1)
    world = dt.get_world_size()
    dp, mp = _mesh_shape(world)
    mesh = dt.ProcessMesh(np.arange(world).reshape(dp, mp).tolist(), dim_names=["dp", "mp"])
    model = train.MLP(s.din, s.hidden, s.classes, dropout=0.0)
    init = {k: v.numpy() for k, v in model.state_dict().items()}
    dt.shard_layer(model, mesh, train.shard_mlp)
    opt = dt.optimizer.SGD(learning_rate=lr, parameters=model.parameters())
    xg, yg = _data(s)
    x = dt.shard_tensor(xg, mesh, [Shard(0), Replicate()])
    y = dt.shard_tensor(yg, mesh, [Shard(0), Replicate()])

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)  # drop grads: the next backward assigns, not adds
        return loss
    if captured:
        step = dt.jit.to_static(step)
    return init, lambda: float(step(x, y).numpy())


def _spans(arrays):
    """(array, start, end) of each array's elements in their concatenation."""
    start = 0
    for a in arrays:
        yield a, start, start + a.size
        start += a.size


def hand_mlp_step(s: Sizes, init: dict, lr: float, eps: float = 1e-5, momentum: float = 0.9):
    """The same model and sharding written by hand: numpy kernels, raw mpi4py collectives.
    Returns (step, calls): ``step()`` runs one step and returns its loss; ``calls[0]`` counts
    the all-reduces over more than one rank so far."""
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    dp, mp = _mesh_shape(world)
    i, j = divmod(rank, mp)
    dp_comm = comm.Split(color=j, key=i)   # varies along dp
    mp_comm = comm.Split(color=i, key=j)   # varies along mp

    def part(n, parts, k):
        q, r = divmod(n, parts)
        lo = k * q + min(k, r)
        return slice(lo, lo + q + (1 if k < r else 0))

    rows, cols = part(s.batch, dp, i), part(s.hidden, mp, j)
    w1 = init["fc1.weight"][:, cols].copy()
    b1 = init["fc1.bias"][cols].copy()
    g = init["bn.weight"][cols].copy()
    beta = init["bn.bias"][cols].copy()
    rm, rv = init["bn._mean"][cols].copy(), init["bn._variance"][cols].copy()
    w2 = init["fc2.weight"][cols, :].copy()
    b2 = init["fc2.bias"].copy()
    xg, yg = _data(s)
    x, y = xg[rows], yg[rows]
    B = s.batch
    calls = [0]
    state = {"rm": rm, "rv": rv}

    def allreduce(c, a):
        c.Allreduce(MPI.IN_PLACE, a)
        calls[0] += c.Get_size() > 1
        return a

    def step() -> float:
        z = x @ w1 + b1
        st = allreduce(dp_comm, np.stack([z.sum(0), (z * z).sum(0)]))
        mean = st[0] / B
        var = st[1] / B - mean * mean
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = (z - mean) * rstd
        bn = xhat * g + beta
        h = np.maximum(bn, 0)
        logits = allreduce(mp_comm, h @ w2) + b2
        m = logits.max(1, keepdims=True)
        e = np.exp(logits - m)
        p = e / e.sum(1, keepdims=True)
        nll = -np.log(p[np.arange(len(y)), y]).sum()
        loss = allreduce(dp_comm, np.array([nll]))[0] / B
        dlog = p.copy()
        dlog[np.arange(len(y)), y] -= 1
        dlog /= B
        gw2, gb2 = h.T @ dlog, dlog.sum(0)
        dh = (dlog @ w2.T) * (bn > 0)
        dsum = allreduce(dp_comm, np.stack([(dh * xhat).sum(0), dh.sum(0)]))
        dg, dbeta = dsum[0], dsum[1]
        dxhat = dh * g  # sum(dxhat) = g * dbeta, sum(dxhat * xhat) = g * dg: no 2nd all-reduce
        dz = rstd * (dxhat - g * dbeta / B - xhat * (g * dg) / B)
        gw1, gb1 = x.T @ dz, dz.sum(0)
        # the dp gradients in one all-reduce, as a careful hand would bucket them
        flat = allreduce(dp_comm, np.concatenate([gw1.ravel(), gb1, gw2.ravel(), gb2]))
        gw1, gb1, gw2, gb2 = (flat[a:b].reshape(t.shape) for t, a, b in _spans(
            (gw1, gb1, gw2, gb2)))
        state["rm"] = momentum * state["rm"] + (1 - momentum) * mean
        state["rv"] = momentum * state["rv"] + (1 - momentum) * var
        for prm, grd in ((w1, gw1), (b1, gb1), (g, dg), (beta, dbeta), (w2, gw2), (b2, gb2)):
            prm -= lr * grd
        return float(loss)
    return step, calls


def bench_mlp(s: Sizes, steps: int, lr: float = 0.1, captured: bool = False) -> dict:
    """Median step times (after 2 warm-up steps) of disttensor and of the hand-written step,
    run alternately (load on the machine hits both alike), and the collectives of one step."""
    init, ours = dt_mlp_step(s, lr, captured)
    hand, calls = hand_mlp_step(s, init, lr)
    runs = {"ours": (ours, [], []), "hand": (hand, [], [])}
    coll = {}
    for _ in range(steps):
        for name, (step, losses, times) in runs.items():
            MPI.COMM_WORLD.Barrier()
            before = sum(collectives.collective_counts().values()) + calls[0]
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
            coll[name] = sum(collectives.collective_counts().values()) + calls[0] - before
    (_, ours_loss, ours_t), (_, hand_loss, hand_t) = runs["ours"], runs["hand"]
    t_ours, t_hand = float(np.median(ours_t[2:])), float(np.median(hand_t[2:]))
    diff = np.max(np.abs(np.array(ours_loss) - np.array(hand_loss)) / np.abs(hand_loss))
    return {"batch": s.batch, "din": s.din, "hidden": s.hidden, "classes": s.classes,
            "ours_ms": round(t_ours * 1e3, 3), "hand_ms": round(t_hand * 1e3, 3),
            "ratio": round(t_ours / t_hand, 3), "loss_max_rel_diff": float(f"{diff:.2e}"),
            "ours_collectives": coll["ours"], "hand_collectives": coll["hand"]}
