"""shard_optimizer and ZeRO stages 1-3: 5 AdamW steps equal the unsharded run on [world] and,
at 4 ranks, on [2, 2] with tensor parallelism; states, gradients and parameters take the dp
layout each stage promises; bad input fails before anything changes."""
from __future__ import annotations

import numpy as np
import pytest
from parallel_models import TwoLayer

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard

pytestmark = pytest.mark.mpi

X = np.random.default_rng(0).standard_normal((5, 8, 6)).astype(np.float32)
Y = np.random.default_rng(1).standard_normal((5, 8, 4)).astype(np.float32)


def MLP():
    return TwoLayer(6, 10, 4)


def world():
    return collectives.init().size


def meshes():
    out = [("flat", dt.ProcessMesh(list(range(world())), dim_names=["dp"]))]
    if world() == 4:
        out.append(("2x2", dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])))
    return out


def _numpy_adamw(steps: int):
    """The unsharded reference, written with numpy alone: the MLP, MSE loss and AdamW. Returns
    the losses, the parameters, the moments and the last step's gradients (by parameter name)."""
    dt.seed(7)
    ref = MLP()
    p = {n: v.numpy().astype(np.float64) for n, v in ref.named_parameters()}
    m = {n: np.zeros_like(v) for n, v in p.items()}
    v2 = {n: np.zeros_like(v) for n, v in p.items()}
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-8, 0.01
    losses = []
    for t in range(1, steps + 1):
        x, y = X[t - 1].astype(np.float64), Y[t - 1].astype(np.float64)
        h = x @ p["fc1.weight"] + p["fc1.bias"]
        r = np.maximum(h, 0)
        out = r @ p["fc2.weight"] + p["fc2.bias"]
        d = out - y
        losses.append(float((d * d).mean()))
        g_out = 2 * d / d.size
        g = {"fc2.weight": r.T @ g_out, "fc2.bias": g_out.sum(0)}
        g_h = (g_out @ p["fc2.weight"].T) * (h > 0)
        g.update({"fc1.weight": x.T @ g_h, "fc1.bias": g_h.sum(0)})
        for n in p:
            p[n] *= 1 - lr * wd
            m[n] = b1 * m[n] + (1 - b1) * g[n]
            v2[n] = b2 * v2[n] + (1 - b2) * g[n] ** 2
            p[n] -= lr / (1 - b1 ** t) * m[n] / (np.sqrt(v2[n] / (1 - b2 ** t)) + eps)
    return losses, p, {"moment1": m, "moment2": v2}, g


def _check_state(model, opt, want_params, want_moments, what: str) -> None:
    """Parameters and both AdamW moments against the numpy reference."""
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.numpy(), want_params[n], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{what}: {n}")
        for acc, want in want_moments.items():
            np.testing.assert_allclose(opt._accumulators[acc][id(p)].numpy(), want[n],
                                       rtol=1e-4, atol=1e-9, err_msg=f"{what}: {acc} of {n}")


def _run(mesh_kind: str, mesh, stage: int, steps: int = 5):
    dt.seed(7)
    model = MLP()
    if mesh_kind == "2x2":
        model, _ = dt.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": {
            "fc1": dt.ColWiseParallel(), "fc2": dt.RowWiseParallel()}}})
    else:
        dt.shard_layer(model, mesh)
    opt = dt.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters(),
                             weight_decay=0.01)
    if stage:
        stage_cls = [None, dt.ShardingStage1, dt.ShardingStage2, dt.ShardingStage3][stage]
        opt = dt.shard_optimizer(opt, stage_cls("dp", mesh))
    data_pl = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    losses = []
    for t in range(steps):
        x, y = dt.shard_tensor(X[t], mesh, data_pl), dt.shard_tensor(Y[t], mesh, data_pl)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if t == steps - 1:
            grads = {n: p.grad for n, p in model.named_parameters()}
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    return model, opt, losses, grads


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_equal_numpy_adamw(stage, comm):
    ref_losses, ref_params, ref_moments, ref_grads = _numpy_adamw(5)
    for kind, mesh in meshes():
        model, opt, losses, grads = _run(kind, mesh, stage)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        _check_state(model, opt, ref_params, ref_moments, f"{kind} stage {stage}")
        for n, g in grads.items():
            np.testing.assert_allclose(g.numpy(), ref_grads[n], rtol=1e-4, atol=1e-7,
                                       err_msg=f"{kind} stage {stage}: last gradient of {n}")
        dp = 0
        for n, p in model.named_parameters():
            states = [opt._accumulators[a][id(p)] for a in ("moment1", "moment2")]
            p_dp = any(dp in dm for dm in p._value.dist_attr.dims_mapping)
            g_dp = any(dp in dm for dm in grads[n]._value.dist_attr.dims_mapping)
            s_dp = all(any(dp in dm for dm in s._value.dist_attr.dims_mapping) for s in states)
            assert (s_dp, g_dp, p_dp) == (stage >= 1, stage >= 2, stage >= 3), \
                f"{kind} stage {stage}: {n} states/grad/param sharded on dp: {s_dp, g_dp, p_dp}"
            if kind == "2x2" and n == "fc1.weight":  # TP kept, dp added on the other dim
                assert p._value.dist_attr.dims_mapping[1] == (1,)


def test_stage2_reduce_scatters_gradients(comm):
    """Stage 2 moves each weight's gradient by a reduce-scatter (no all-reduce of it)."""
    if world() == 1:
        pytest.skip("one rank: there is nothing to reduce")
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["dp"])
    dt.seed(7)
    model = MLP()
    dt.shard_layer(model, mesh)
    opt = dt.shard_optimizer(dt.optimizer.AdamW(learning_rate=0.01, weight_decay=0.01,
                                                parameters=model.parameters()),
                             dt.ShardingStage2("dp", mesh))
    loss = F.mse_loss(model(dt.shard_tensor(X[0], mesh, [Shard(0)])),
                      dt.shard_tensor(Y[0], mesh, [Shard(0)]))
    collectives.reset_collective_counts()
    loss.backward()
    counts = collectives.collective_counts()
    assert counts["reduce_scatter"] == 4, counts
    assert counts["all_reduce"] == 0, counts
    collectives.reset_collective_counts()
    opt.step()                                       # one all-gather of each updated slice
    assert collectives.collective_counts()["all_gather"] == 4
    _, want_params, want_moments, _ = _numpy_adamw(1)
    _check_state(model, opt, want_params, want_moments, "stage 2")


def test_dense_parameters_replicated_on_the_stage_mesh(comm):
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["dp"])
    dt.seed(7)
    model = MLP()
    dense = {n: p.numpy() for n, p in model.named_parameters()}
    opt = dt.optimizer.AdamW(parameters=model.parameters())
    before = model.fc1.weight
    dt.shard_optimizer(opt, dt.ShardingStage3("dp", mesh))
    assert model.fc1.weight is before and before.is_dist()
    assert before.placements == [Shard(0)]
    for n, p in model.named_parameters():  # placed, not changed
        assert p.is_dist()
        np.testing.assert_array_equal(p.numpy(), dense[n], err_msg=n)


def test_bad_input_changes_nothing(comm):
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["x"])
    dt.seed(7)
    model = MLP()
    dt.shard_layer(model, mesh)
    opt = dt.optimizer.AdamW(parameters=model.parameters())
    layouts = [p.placements for p in model.parameters()]
    with pytest.raises(ValueError, match="shard_optimizer .*ShardingStage3.*no dim named 'dp'"):
        dt.shard_optimizer(opt, dt.ShardingStage3("dp", mesh))
    assert [p.placements for p in model.parameters()] == layouts
    assert opt._shard_fn is None
    dense = MLP()
    with pytest.raises(ValueError, match="is dense; pass mesh="):
        dt.shard_optimizer(dt.optimizer.AdamW(parameters=dense.parameters()),
                           dt.ShardingStage1("dp"))
    assert not dense.fc1.weight.is_dist()
    with pytest.raises(TypeError, match="shard_optimizer: optimizer must be"):
        dt.shard_optimizer(model, dt.ShardingStage1("dp"))


def test_custom_shard_fn_lays_out_states(comm):
    """Paddle's shard_fn contract: (accumulator name, param, state) -> state."""
    mesh = dt.ProcessMesh(list(range(world())), dim_names=["dp"])
    dt.seed(7)
    model = MLP()
    dt.shard_layer(model, mesh)
    seen = []

    def shard_fn(name, param, acc):
        seen.append(name)
        if acc.shape != param.shape or acc.ndim != 2:
            return acc
        return dt.reshard(acc, mesh, [Shard(1)])
    opt = dt.shard_optimizer(dt.optimizer.AdamW(learning_rate=0.01, weight_decay=0.01,
                                                parameters=model.parameters()), shard_fn)
    loss = F.mse_loss(model(dt.shard_tensor(X[0], mesh, [Shard(0)])),
                      dt.shard_tensor(Y[0], mesh, [Shard(0)]))
    loss.backward()
    opt.step()
    assert {"moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"} <= set(seen)
    assert opt._accumulators["moment1"][id(model.fc1.weight)].placements == [Shard(1)]
    _, want_params, want_moments, _ = _numpy_adamw(1)
    _check_state(model, opt, want_params, want_moments, "custom shard_fn")
