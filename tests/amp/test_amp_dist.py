"""Mixed precision on meshes (run at 1-4 ranks): bfloat16 pieces and their reductions against
numpy, the O1 step dense vs on a [dp, mp] mesh vs captured, O2 master weights sharded like
their parameters (ZeRO stages 1-3 too), and an inf in one rank's gradient piece skipping the
step on every rank."""
from __future__ import annotations

import numpy as np
import pytest
from amp_oracle import BF16, bf, model_arrays, o1_step

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard

pytestmark = pytest.mark.mpi


def dp_mp():
    n = collectives.init().size
    grid = [[0, 1], [2, 3]] if n == 4 else [list(range(n))]
    return dt.ProcessMesh(grid, dim_names=["dp", "mp"])


def test_bfloat16_pieces_and_partial_reduction():
    mesh = dp_mp()
    rng = np.random.default_rng(5)
    a, b = bf(rng.standard_normal((7, 6))), bf(rng.standard_normal((6, 5)))
    x = dt.shard_tensor(a, mesh, [Shard(0), Shard(1)], dtype="bfloat16")
    w = dt.shard_tensor(b, mesh, [Replicate(), Shard(0)], dtype="bfloat16")
    y = dt.matmul(x, w)                   # contracted dim sharded on mp: Partial pieces
    assert y.dtype == BF16
    got = dt.reshard(y, mesh, [Replicate(), Replicate()]).numpy().astype(np.float32)
    # each rank's partial product is rounded to bfloat16, the sum is taken in float32
    np.testing.assert_allclose(got, a @ b, rtol=2 ** -6, atol=2 ** -6)
    p = dt.shard_tensor(a, mesh, [Partial(), Replicate()], dtype="bfloat16")
    np.testing.assert_array_equal(dt.reshard(p, mesh, [Replicate(), Replicate()]).numpy()
                                  .astype(np.float32), a)


def _o1_run(layout, captured=False, steps=3, x_pl=None):
    """Losses and final (w, b) of ``steps`` O1 SGD steps: dense (layout None) or on the mesh
    with x laid out as ``x_pl`` (default: batch on dp) and w column-parallel on mp."""
    xa, wa, ba = model_arrays(draw=7, n=8, k=8, h=6)
    mesh = dp_mp() if layout else None

    def place(a, pl, grad=False):
        t = dt.to_tensor(a) if mesh is None else dt.shard_tensor(a, mesh, pl)
        t.stop_gradient = not grad
        return t
    w = place(wa, [Replicate(), Shard(1)], grad=True)
    b = place(ba, [Replicate(), Shard(0)], grad=True)
    opt = dt.optimizer.SGD(learning_rate=0.05, parameters=[w, b])

    def step(x):
        with dt.amp.auto_cast(dtype="bfloat16"):
            loss = dt.pow(dt.exp(dt.matmul(x, w) + b), 2.0).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss
    f = dt.jit.to_static(step) if captured else step
    x_pl = list(x_pl or (Shard(0), Replicate()))
    losses = [float(f(place(xa * (k + 1) / 3, x_pl)).numpy())
              for k in range(steps)]
    return losses, w.numpy(), b.numpy()


def test_o1_dense_mesh_and_captured_agree_and_match_numpy():
    # several steps with the batch whole on every rank: each weight gradient element is the
    # same float32 sum as in the dense step, so the weights (and their bfloat16 casts) agree;
    # only the loss's pieces are summed in another order (<= 1e-6)
    whole = (Replicate(), Replicate())
    dense = _o1_run(None)
    mesh = _o1_run("dp_mp", x_pl=whole)
    captured = _o1_run("dp_mp", captured=True, x_pl=whole)
    np.testing.assert_allclose(mesh[0], dense[0], rtol=1e-6)
    np.testing.assert_array_equal(mesh[1], dense[1])
    np.testing.assert_array_equal(mesh[2], dense[2])
    np.testing.assert_array_equal(captured[0], mesh[0])          # replay: bitwise
    np.testing.assert_array_equal(captured[1], mesh[1])
    np.testing.assert_array_equal(captured[2], mesh[2])
    # the batch on dp: the loss agrees to 1e-6, but each rank's weight gradient is its own
    # bfloat16 matmul (rounded before the float32 dp sum, as under PyTorch's DDP + autocast),
    # so the updated weights agree to bfloat16 precision of the update
    one_dense, one_mesh = _o1_run(None, steps=1), _o1_run("dp_mp", steps=1)
    np.testing.assert_allclose(one_mesh[0], one_dense[0], rtol=1e-6)
    for a, b, start in zip(one_mesh[1:], one_dense[1:], model_arrays(draw=7, n=8, k=8, h=6)[1:]):
        np.testing.assert_allclose(a - start, b - start, rtol=2 ** -6, atol=1e-6)
    # the first step against the numpy oracle
    xa, wa, ba = model_arrays(draw=7, n=8, k=8, h=6)
    loss0, _, _ = o1_step(xa / 3, wa, ba)
    np.testing.assert_allclose(dense[0][0], loss0, rtol=1e-6)


def _column_parallel_linear(mesh, wa):
    layer = dt.nn.Linear(*wa.shape)
    layer.weight.set_value(wa)
    dt.shard_layer(layer, mesh, lambda name, sub, m: setattr(
        sub, "weight", dt.shard_tensor(sub.weight, m, [Replicate(), Shard(1)])) if isinstance(
            sub, dt.nn.Linear) else None)
    return layer


def test_o2_masters_keep_the_parameter_layout():
    mesh = dp_mp()
    xa, wa, _ = model_arrays(draw=8, n=4, k=8, h=6)
    layer = _column_parallel_linear(mesh, wa)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
    layer, opt = dt.amp.decorate(layer, opt, level="O2", dtype="bfloat16")
    w = layer.weight
    master = opt._amp_master.master_of(w)
    assert w.dtype == BF16 and master.dtype == np.float32
    assert master.placements == w.placements and master.process_mesh == w.process_mesh
    with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
        loss = layer(dt.shard_tensor(xa, mesh, [Shard(0), Replicate()])).mean()
    loss.backward()
    g = w.grad.numpy().astype(np.float32)
    opt.step()
    want = wa - np.float32(0.1) * g
    np.testing.assert_allclose(master.numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(w.numpy().astype(np.float32), bf(want))
    assert w.placements == [Replicate(), Shard(1)]


@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Replicate(), Shard(1)],
                                        [Shard(0), Shard(0)]])
def test_inf_on_one_ranks_piece_skips_the_step_on_every_rank(placements):
    mesh = dp_mp()
    world = collectives.init()
    xa, wa, _ = model_arrays(draw=9, n=4, k=8, h=6)
    w = dt.shard_tensor(wa, mesh, placements, stop_gradient=False)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=[w])
    scaler = dt.amp.GradScaler(init_loss_scaling=64.0)
    x = dt.shard_tensor(xa, mesh, [Shard(0), Replicate()])
    scaler.scale(dt.matmul(x, w).mean()).backward()
    piece = w.grad._local_array()
    # the last rank holding a non-empty piece poisons it
    sizes = world.all_gather(np.array([piece.size]))
    bad = max(r for r in range(world.size) if sizes[r] > 0)
    if world.rank == bad:
        piece.reshape(-1)[0] = np.inf
    before = w.numpy()
    scaler.step(opt)
    assert scaler.found_inf                         # on every rank
    scaler.update()
    np.testing.assert_array_equal(w.numpy(), before)
    assert scaler.get_loss_scaling() == 32.0
    # the next, clean step is taken on every rank
    opt.clear_grad()
    scaler.scale(dt.matmul(x, w).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert not np.array_equal(w.numpy(), before)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_o2_under_zero_matches_numpy(stage):
    mesh = dp_mp()
    xa, wa, _ = model_arrays(draw=10, n=4, k=8, h=6)
    layer = _column_parallel_linear(mesh, wa)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
    cls = (dt.ShardingStage1, dt.ShardingStage2, dt.ShardingStage3)[stage - 1]
    opt = dt.shard_optimizer(opt, cls("dp", mesh))
    w = layer.weight
    layout = w.placements                       # stage 3 shards the parameter on dp
    layer, opt = dt.amp.decorate(layer, opt, level="O2", dtype="bfloat16")
    master = opt._amp_master.master_of(w)
    assert w.dtype == BF16 and master.placements == w.placements == layout
    with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
        loss = layer(dt.shard_tensor(xa, mesh, [Shard(0), Replicate()])).mean()
    loss.backward()
    g = w.grad.numpy().astype(np.float32)
    opt.step()
    want = wa - np.float32(0.1) * g
    np.testing.assert_allclose(master.numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(w.numpy().astype(np.float32), bf(want))
    assert w.placements == layout
