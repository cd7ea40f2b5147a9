"""Pipeline parallelism end to end: a model cut by ``pp_config`` and trained with the eager
schedules equals the un-pipelined dense run over the same micro-batches (losses, gradients and
parameters), on pp x dp, pp alone and pp x mp meshes; bad input fails on every rank before any
parameter moves."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import nn

pytestmark = pytest.mark.mpi

V, D, T = 16, 8, 4


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, bias):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) + bias


class TinyLM(nn.Layer):
    """Embedding, a list of blocks sharing a root buffer (as a causal mask is), a head."""

    def __init__(self, layers: int):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.LayerList([Block() for _ in range(layers)])
        self.head = nn.Linear(D, V)
        self.register_buffer("shift", dt.to_tensor(np.linspace(-0.1, 0.1, D).astype(np.float32)))

    def forward(self, tokens):
        x = self.wte(tokens)
        for blk in self.blocks:
            x = blk(x, self.shift)
        return self.head(x)


PLAN = {r"blocks\.\d+\.fc1": dt.ColWiseParallel(), r"blocks\.\d+\.fc2": dt.RowWiseParallel()}
SCHEDULES = {"FThenB": dt.pipelining.ScheduleFThenB, "1F1B": dt.pipelining.Schedule1F1B,
             "VPP": dt.pipelining.ScheduleVPP}


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape([-1, V]), y.reshape([-1]))


def layout(kind: str):
    """(mesh, config) of ``kind`` at this world size: pp x dp and pp x mp are 2 x 2 at 4 ranks,
    pp = world size otherwise (with a size-1 dp/mp dim)."""
    n = collectives.init().size
    if kind == "pp":
        return dt.ProcessMesh(list(range(n)), dim_names=["pp"]), {}
    grid = [[0, 1], [2, 3]] if n == 4 else [[r] for r in range(n)]
    second = kind.split("_")[1]
    mesh = dt.ProcessMesh(grid, dim_names=["pp", second])
    cfg = {"dp_config": {}} if second == "dp" else {"mp_config": {"parallelize_plan": PLAN}}
    return mesh, cfg


def data(step: int, batch: int = 16):
    rng = np.random.default_rng(step)
    return rng.integers(0, V, (batch, T)), rng.integers(0, V, (batch, T))


def fresh(layers: int):
    dt.seed(3)
    model = TinyLM(layers)
    return model, dt.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())


def dense_run(layers: int, m: int, steps: int):
    """The un-pipelined run: each step accumulates the m micro-batches' loss / m."""
    model, opt = fresh(layers)
    losses, grads = [], []
    b = 4
    for s in range(steps):
        x, y = data(s, b * m)
        total = 0.0
        for i in range(m):
            loss = loss_fn(model(dt.to_tensor(x[i * b:(i + 1) * b])),
                           dt.to_tensor(y[i * b:(i + 1) * b]))
            (loss * (1.0 / m)).backward()
            total += float(loss.numpy()) / m
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses, grads, {n: p.numpy() for n, p in model.named_parameters()}


def full(p):
    """The global value of ``p`` on the ranks of its mesh (None elsewhere)."""
    mesh = p.process_mesh
    if not mesh.contains(dt.get_rank()):
        return None
    return dt.reshard(p, mesh, [dt.Replicate()] * mesh.ndim)._value.local.array


def assert_close(got, want, scale, what):
    err = np.max(np.abs(np.asarray(got) - want)) if np.size(want) else 0.0
    assert err <= 1e-5 * scale + 1e-6 * np.max(np.abs(want)), f"{what}: error {err}"


@pytest.mark.parametrize("kind", ["pp_dp", "pp", "pp_mp"])
@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "VPP"])
@pytest.mark.parametrize("m", [4, 8])
def test_schedule_equals_dense_run(kind, schedule, m):
    mesh, cfg = layout(kind)
    pp = mesh.get_dim_size("pp")
    v = 2 if schedule == "VPP" else 1
    m = m if m % pp == 0 or schedule != "VPP" else pp * 2
    layers, steps = max(4, 2 * pp), 3
    want_losses, want_grads, want_params = dense_run(layers, m, steps)
    model, opt = fresh(layers)
    cfg["pp_config"] = {"split_spec": "blocks", "schedule": schedule, "vpp_degree": v}
    model, opt = dt.parallelize(model, opt, mesh, cfg)
    kw = {"vpp_degree": v} if schedule == "VPP" else {}
    sched = SCHEDULES[schedule](model, n_microbatches=m, loss_fn=loss_fn, **kw)
    for s in range(steps):
        loss = sched.step(*data(s, 4 * m))
        assert not loss.is_dist() and loss.shape == []
        assert float(loss.numpy()) == pytest.approx(want_losses[s], rel=1e-6)
        gscale = max(np.max(np.abs(g)) for g in want_grads[s].values())
        for n, p in model.named_parameters():
            g = None if p.grad is None else full(p.grad)
            if p.process_mesh.contains(dt.get_rank()):
                assert_close(g, want_grads[s][n], gscale, f"step {s} grad {n}")
        opt.step()
        opt.clear_grad()
    for n, p in model.named_parameters():
        got = full(p)
        if got is not None:
            assert_close(got, want_params[n], 1.0, f"param {n}")


def test_stages_live_on_their_sub_meshes():
    mesh, cfg = layout("pp_dp")
    pp = mesh.get_dim_size("pp")
    model, opt = fresh(2 * pp)
    cfg["pp_config"] = {"split_spec": "blocks"}
    model, opt = dt.parallelize(model, opt, mesh, cfg)
    stage = [mesh.get_mesh_with_dim("pp", i) for i in range(pp)]
    assert model.wte.weight.process_mesh == stage[0]
    assert model.head.weight.process_mesh == stage[-1]
    for j, blk in enumerate(model.blocks):
        assert blk.fc1.weight.process_mesh == stage[j // 2]
    assert model.shift.process_mesh == stage[0]


def test_explicit_cuts_and_naive_call():
    """A dict of cuts; a plain model(x) runs as a naive pipeline and equals the dense model."""
    n = collectives.init().size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["pp"])
    layers = n + 2
    dense, _ = fresh(layers)
    x, _ = data(0)
    want = dense(dt.to_tensor(x)).numpy()
    model, _ = fresh(layers)
    cuts = {f"blocks.{i}": dt.SplitPoint.END for i in range(2, n + 1)} if n > 1 else "blocks"
    model, _ = dt.parallelize(model, None, mesh, {"pp_config": {"split_spec": cuts}})
    stage = [mesh.get_mesh_with_dim("pp", i) for i in range(n)]
    assert [b.ln.weight.process_mesh for b in model.blocks] == \
        ([stage[0]] * 3 + [stage[i] for i in range(1, n)] if n > 1 else [stage[0]] * 3)
    out = model(dt.to_tensor(x))
    got = full(out)
    if got is not None:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _refused(model, mesh, cfg, match):
    before = [p for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        dt.parallelize(model, None, mesh, cfg)
    assert all(not p.is_dist() for p in model.parameters())
    assert [p for p in model.parameters()] == before


def test_bad_configs_fail_before_any_parameter_moves():
    n = collectives.init().size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["pp"])
    model, _ = fresh(2)
    _refused(model, dt.ProcessMesh(list(range(n)), dim_names=["dp"]),
             {"pp_config": {"split_spec": "blocks"}}, "no dim named 'pp'")
    _refused(model, mesh, {"pp_config": {"split_spec": "blocks", "schedule": "VPP",
                                         "vpp_degree": 2 + n}}, "fewer than the")
    _refused(model, mesh, {"pp_config": {"split_spec": {"blocks.0": dt.SplitPoint.BEGINNING}}},
             "leaves a stage empty")
    _refused(model, mesh, {"pp_config": {"split_spec": {"blocks.5": dt.SplitPoint.END}}},
             "is not a layer of 'blocks'")
    _refused(model, mesh, {"pp_config": {"split_spec": "trunk"}}, "names no sublayer")
    _refused(model, mesh, {"pp_config": {"split_spec": "blocks", "schedule": "GPipe"}},
             "schedule must be one of")
    _refused(model, mesh, {"pp_config": {"split_spec": "blocks", "global_spec": "x"}},
             "global_spec is not supported")
    if n > 1:  # a weight of the first stage tied into the last one
        model, _ = fresh(n)
        model.blocks[n - 1].fc1.weight = model.blocks[0].fc1.weight
        _refused(model, mesh, {"pp_config": {"split_spec": "blocks"}},
                 r"'blocks.0.fc1.weight' \(stage 0\)")


def test_bad_schedule_arguments():
    n = collectives.init().size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["pp"])
    with pytest.raises(ValueError, match="has no pipeline stages"):
        dt.pipelining.Schedule1F1B(fresh(2)[0], n_microbatches=2, loss_fn=loss_fn)
    model, _ = fresh(2 * n)
    model, _ = dt.parallelize(model, None, mesh, {"pp_config": {"split_spec": "blocks"}})
    with pytest.raises(ValueError, match="cut into 1 chunk"):
        dt.pipelining.ScheduleVPP(model, n_microbatches=2 * n, loss_fn=loss_fn, vpp_degree=2)
    sched = dt.pipelining.Schedule1F1B(model, n_microbatches=4, loss_fn=loss_fn)
    x, y = data(0)
    with pytest.raises(ValueError, match=r"shape \[6, 4\]: 4 micro-batches x dp=1 do not divide"):
        sched.step(x[:6], y[:6])


def test_micro_batches_default_and_missing_loss_fn():
    n = collectives.init().size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["pp"])
    model, _ = fresh(n)
    model, _ = dt.parallelize(model, None, mesh, {"pp_config": {"split_spec": "blocks",
                                                                "micro_batches": 2}})
    assert dt.pipelining.ScheduleFThenB(model, loss_fn=loss_fn).n_microbatches == 2
    with pytest.raises(TypeError, match="Schedule1F1B: loss_fn must be callable"):
        dt.pipelining.Schedule1F1B(model, n_microbatches=2)
