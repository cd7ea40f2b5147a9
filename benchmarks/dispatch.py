"""Distributed dispatch overhead and a training step against hand-written mpi4py.

    OMP_NUM_THREADS=1 mpiexec -n 4 python benchmarks/dispatch.py [--quick]

Prints JSON on rank 0:

* ``ops``: steady-state latency of ``add`` (S(0)+S(0)), ``relu``, ``reshape`` (zero
  communication) and ``add_`` on a [64, 64] float32 DistTensor on a 1-d mesh of all ranks, each
  beside the raw numpy call on the local piece: ``overhead_us`` = ours - numpy, ``ratio`` =
  ours / numpy (target: overhead <= 8 us). These ops need no communication, so rank 0 times
  them while the other ranks sleep (4 ranks may share fewer cores);
* ``cache_miss_us``: the first call of an op/layout/shape combination (rule + plans), minus the
  steady-state call;
* ``mlp_step``: one training step (forward, backward, SGD) of the train.py MLP shape on a
  [dp, mp] = [2, 2] mesh (or [world, 1]) written with disttensor, beside the same sharding
  written by hand with numpy and raw mpi4py calls, and ``ratio`` = ours / hand (target <= 1.1);
  ``loss_max_rel_diff`` checks that both compute the same losses.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository first (benchmarks/collectives.py must not shadow the collectives package)
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples")]

import disttensor as dt  # noqa: E402
import disttensor.nn.functional as F  # noqa: E402
from disttensor import Replicate, Shard  # noqa: E402
from disttensor.dispatch import plan_cache_info  # noqa: E402


def _median_time(fn, number: int, repeat: int) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return float(np.median(times))


def _sleep_until_rank0_done(timed) -> dict | None:
    """Rank 0 runs ``timed()``; the others wait without spinning on the CPU."""
    comm = MPI.COMM_WORLD
    result = timed() if comm.rank == 0 else None
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)
    return result


def bench_ops(number: int, repeat: int) -> dict:
    world = dt.get_world_size()
    mesh = dt.ProcessMesh(list(range(world)))
    a = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    x = dt.shard_tensor(a, mesh, [Shard(0)])
    y = dt.shard_tensor(a, mesh, [Shard(0)])
    la, lb = x._value.local.array, y._value.local.array
    cases = {
        "add": (lambda: dt.add(x, y), lambda: np.add(la, lb)),
        "relu": (lambda: dt.relu(x), lambda: np.maximum(la, 0)),
        "reshape": (lambda: dt.reshape(x, [64 * 64]), lambda: la.reshape(-1)),
        "add_": (lambda: x.add_(y), lambda: np.add(la, lb, out=la)),
    }
    return _sleep_until_rank0_done(lambda: _time_ops(cases, mesh, number, repeat))


def _time_ops(cases: dict, mesh, number: int, repeat: int) -> dict:
    out = {}
    for name, (ours, raw) in cases.items():
        t_raw = _median_time(raw, number, repeat)
        t_ours = _median_time(ours, number, repeat)
        out[name] = {"ours_us": round(t_ours * 1e6, 2), "numpy_us": round(t_raw * 1e6, 2),
                     "overhead_us": round((t_ours - t_raw) * 1e6, 2),
                     "ratio": round(t_ours / t_raw, 2)}
    # cache miss: a fresh shape each time forces rule evaluation and planning
    misses = []
    for i in range(1, 41):
        b = dt.shard_tensor(np.ones((64 + i, 8), np.float32), mesh, [Shard(0)])
        t0 = time.perf_counter()
        dt.relu(b)
        misses.append(time.perf_counter() - t0)
    out["cache_miss_us"] = round((float(np.median(misses)) - out["relu"]["ours_us"] * 1e-6)
                                 * 1e6, 2)
    out["plans_cached"] = plan_cache_info()["size"]
    return out


# -- the MLP step ------------------------------------------------------------------------------

class _Sizes:
    def __init__(self, batch: int, din: int, hidden: int, classes: int):
        self.batch, self.din, self.hidden, self.classes = batch, din, hidden, classes


def _data(s: _Sizes, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((s.batch, s.din)).astype(np.float32)
    y = rng.integers(0, s.classes, s.batch).astype(np.int64)
    return x, y


def _mesh_shape(world: int) -> tuple[int, int]:
    return (2, 2) if world == 4 else (world, 1)


def dt_mlp_steps(s: _Sizes, steps: int, lr: float):
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
    losses, times = [], []
    for _ in range(steps):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)  # drop grads: the next backward assigns, not adds
        lv = float(loss.numpy())
        times.append(time.perf_counter() - t0)
        losses.append(lv)
    return init, losses, times


def hand_mlp_steps(s: _Sizes, init: dict, steps: int, lr: float, eps: float = 1e-5,
                   momentum: float = 0.9):
    """The same model and sharding written by hand: numpy kernels, raw mpi4py collectives."""
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
    losses, times = [], []

    def allreduce(c, a):
        c.Allreduce(MPI.IN_PLACE, a)
        return a

    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
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
        dxhat = dh * g
        s2 = allreduce(dp_comm, np.stack([dxhat.sum(0), (dxhat * xhat).sum(0)]))
        dz = rstd * (dxhat - s2[0] / B - xhat * s2[1] / B)
        gw1, gb1 = x.T @ dz, dz.sum(0)
        gw1 = allreduce(dp_comm, gw1)
        gb1 = allreduce(dp_comm, gb1)
        gw2 = allreduce(dp_comm, gw2)
        gb2 = allreduce(dp_comm, gb2)
        rm = momentum * rm + (1 - momentum) * mean
        rv = momentum * rv + (1 - momentum) * var
        for prm, grd in ((w1, gw1), (b1, gb1), (g, dg), (beta, dbeta), (w2, gw2), (b2, gb2)):
            prm -= lr * grd
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return losses, times


def bench_mlp(s: _Sizes, steps: int, lr: float = 0.1) -> dict:
    init, ours_loss, ours_t = dt_mlp_steps(s, steps, lr)
    hand_loss, hand_t = hand_mlp_steps(s, init, steps, lr)
    t_ours, t_hand = float(np.median(ours_t[2:])), float(np.median(hand_t[2:]))
    diff = np.max(np.abs(np.array(ours_loss) - np.array(hand_loss)) / np.abs(hand_loss))
    return {"batch": s.batch, "din": s.din, "hidden": s.hidden, "classes": s.classes,
            "ours_ms": round(t_ours * 1e3, 3), "hand_ms": round(t_hand * 1e3, 3),
            "ratio": round(t_ours / t_hand, 3), "loss_max_rel_diff": float(f"{diff:.2e}")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = p.parse_args()
    dt.init_parallel_env()
    number, repeat, steps = (200, 3, 6) if args.quick else (2000, 7, 30)
    result = {"world_size": dt.get_world_size(), "ops": bench_ops(number, repeat),
              "mlp_step": {
                  "train_py_shape": bench_mlp(_Sizes(16, 16, 32, 8), steps),
                  "larger": bench_mlp(_Sizes(256, 256, 512, 64), steps),
                  "compute_bound": bench_mlp(_Sizes(1024, 1024, 2048, 256), max(steps // 3, 4))}}
    if dt.get_rank() == 0:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
