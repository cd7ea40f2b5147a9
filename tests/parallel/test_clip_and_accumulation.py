"""The global gradient norm over every placement (sharded, replicated, Partial, co-sharded,
ZeRO 1/2/3) against numpy, with one all-reduce per step; ``no_sync`` accumulation: no sync
inside, one sync after, gradients equal numpy's full-batch ones."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from parallel_models import TwoLayer

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Partial, Replicate, Shard
from disttensor.nn.clip import global_norm

pytestmark = pytest.mark.mpi

RNG = np.random.default_rng(3)
SHAPES = [(7, 5), (5,), (6, 3)]                          # uneven over 2, 3 and 4 ranks
X = RNG.standard_normal((3, 8, 6)).astype(np.float32)
Y = RNG.standard_normal((3, 8, 4)).astype(np.float32)


def world():
    return collectives.init().size


def _layouts():
    """(name, mesh, placements per grad) covering every kind of placement."""
    w = world()
    flat = dt.ProcessMesh(list(range(w)), dim_names=["x"])
    out = [("sharded", flat, [[Shard(0)], [Shard(0)], [Shard(1)]]),
           ("replicated", flat, [[Replicate()]] * 3),
           ("partial", flat, [[Partial()], [Partial()], [Shard(0)]])]
    if w == 4:
        grid = dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
        out += [("co-sharded", grid, [[Shard(0), Shard(0)], [Shard(0, shard_order=1),
                                                               Shard(0, shard_order=0)],
                                      [Shard(1), Shard(0)]]),
                ("partial-2d", grid, [[Partial(), Shard(1)], [Replicate(), Partial()],
                                      [Partial(), Partial()]])]
    return out


def _dist(a: np.ndarray, mesh, placements, rank: int) -> dt.Tensor:
    """``a`` laid out as ``placements``; over the Partial dims the pieces are addends summing to
    ``a`` exactly (small integers as floats): ``b`` on every rank but the first, the rest there."""
    if not any(isinstance(p, Partial) for p in placements):
        return dt.shard_tensor(a, mesh, placements)
    dense = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = dt.shard_tensor(a, mesh, dense).to_local().numpy()
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    count = int(np.prod([mesh.shape[i] for i in partial_dims]))
    b = np.round(np.random.default_rng(1).standard_normal(local.shape) * 4).astype(a.dtype)
    coord = _coord(mesh, rank)
    first = all(coord[i] == 0 for i in partial_dims)
    piece = local - (count - 1) * b if first else b
    return dt.dtensor_from_local(piece, mesh, placements, shape=a.shape)


def _coord(mesh, rank: int) -> list[int]:
    ids = np.asarray(mesh.process_ids).reshape(mesh.shape)
    return [int(c[0]) for c in np.nonzero(ids == rank)]


def _arrays():
    return [np.round(RNG.standard_normal(s) * 8).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("name", ["sharded", "replicated", "partial", "co-sharded",
                                  "partial-2d"])
def test_global_norm_every_placement(comm, name):
    layouts = {n: (m, pl) for n, m, pl in _layouts()}
    if name not in layouts:
        pytest.skip(f"{name} needs 4 ranks")
    mesh, placements = layouts[name]
    arrays = _arrays()
    grads = [_dist(a, mesh, pl, comm.rank) for a, pl in zip(arrays, placements)]
    ref = math.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays))
    collectives.reset_collective_counts()
    norm = global_norm(grads)
    value = float(norm.numpy())
    counts = collectives.collective_counts()
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    # the squared sums' total: one all-reduce over the mesh's ranks (not per gradient, not
    # per mesh dim), plus the reduction of each Partial gradient before it is squared
    reductions = sum(isinstance(p, Partial) for pl in placements for p in pl)
    assert counts.get("all_reduce", 0) == (1 + reductions if world() > 1 else 0), counts
    clipped = dt.nn.ClipGradByGlobalNorm(ref / 4)([(None, g) for g in grads])
    for (_, c), a in zip(clipped, arrays):
        np.testing.assert_allclose(c.numpy(), a / 4, rtol=1e-5, atol=1e-6)


def test_nonfinite_on_one_rank_raises_on_every_rank(comm):
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["x"])
    p = dt.shard_tensor(np.zeros((world() * 2,), np.float32), mesh, [Shard(0)])
    p.stop_gradient = False
    local = np.ones(2, np.float32)
    if comm.rank == world() - 1:
        local[1] = np.inf
    p.grad = dt.dtensor_from_local(local, mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="clip_grad_norm_: the total norm .* inf"):
        dt.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def _numpy_grads(x, y, p):
    """d(mean squared error)/d(params) of the TwoLayer MLP, numpy only."""
    h = x @ p["fc1.weight"] + p["fc1.bias"]
    r = np.maximum(h, 0)
    d = r @ p["fc2.weight"] + p["fc2.bias"] - y
    g_out = 2 * d / d.size
    g_h = (g_out @ p["fc2.weight"].T) * (h > 0)
    return {"fc2.weight": r.T @ g_out, "fc2.bias": g_out.sum(0), "fc1.weight": x.T @ g_h,
            "fc1.bias": g_h.sum(0)}


def _model(stage: int, mesh):
    dt.seed(7)
    model = TwoLayer(6, 10, 4)
    p0 = {n: v.numpy().astype(np.float64) for n, v in model.named_parameters()}
    dt.shard_layer(model, mesh)
    opt = dt.optimizer.AdamW(parameters=model.parameters())
    if stage:
        stage_cls = [None, dt.ShardingStage1, dt.ShardingStage2, dt.ShardingStage3][stage]
        opt = dt.shard_optimizer(opt, stage_cls("dp", mesh))
    return model, opt, p0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_under_zero(comm, stage):
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["dp"])
    model, _, p0 = _model(stage, mesh)
    F.mse_loss(model(dt.shard_tensor(X[0], mesh, [Shard(0)])),
               dt.shard_tensor(Y[0], mesh, [Shard(0)])).backward()
    ref = _numpy_grads(X[0].astype(np.float64), Y[0].astype(np.float64), p0)
    total = math.sqrt(sum(float((g ** 2).sum()) for g in ref.values()))
    collectives.reset_collective_counts()
    norm = dt.nn.utils.clip_grad_norm_(model.parameters(), max_norm=total / 2)
    assert collectives.collective_counts().get("all_reduce", 0) == (world() > 1)
    np.testing.assert_allclose(float(norm.numpy()), total, rtol=1e-5)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), ref[n] * (total / 2) / (total + 1e-6),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 2])
def test_no_sync_accumulates_then_syncs_once(comm, stage):
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["dp"])
    model, opt, p0 = _model(stage, mesh)
    counts = []
    for i in range(3):
        ctx = dt.no_sync(model) if i < 2 else contextlib.nullcontext()
        collectives.reset_collective_counts()
        with ctx:
            loss = F.mse_loss(model(dt.shard_tensor(X[i], mesh, [Shard(0)])),
                              dt.shard_tensor(Y[i], mesh, [Shard(0)])) / 3
            loss.backward()
        counts.append(collectives.collective_counts())
    sync = "reduce_scatter" if stage == 2 else "all_reduce"
    if world() > 1:
        assert [c[sync] for c in counts[:2]] == [0, 0], counts
        assert [c["all_reduce"] + c["reduce_scatter"] for c in counts[:2]] == [0, 0], counts
        assert 1 <= counts[2][sync] <= 4, counts          # once per gradient at most
    grads = {n: sum(_numpy_grads(X[i].astype(np.float64), Y[i].astype(np.float64), p0)[n]
                    for i in range(3)) / 3 for n in p0}
    for n, p in model.named_parameters():
        assert not p.grad._value.dist_attr.partial, n       # synced: no held Partial left
        np.testing.assert_allclose(p.grad.numpy(), grads[n], rtol=1e-5, atol=1e-6)
    opt.step()                                               # the step takes the synced grads


def test_no_sync_bad_input(comm):
    with pytest.raises(TypeError, match="no_sync: model must be a Layer"):
        with dt.no_sync([1.0]):
            pass
