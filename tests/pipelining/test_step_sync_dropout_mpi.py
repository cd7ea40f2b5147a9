"""A pipelined step syncs data-parallel gradients once per step (not per micro-batch), and its
dropout masks are the un-pipelined run's: every schedule equals the dense run over the same
micro-batches with dropout before, inside and after the split layer list."""
from __future__ import annotations

import numpy as np
import pytest
from test_pipeline_mpi import (
    SCHEDULES,
    TinyLM,
    assert_close,
    data,
    full,
    layout,
    loss_fn,
)

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import nn
from disttensor.generator import default_generator
from disttensor.pipelining.schedules import (
    first_forwards_first,
    schedule_actions,
    simulate,
)

pytestmark = pytest.mark.mpi

P = 0.25


class DropBlock(nn.Layer):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(P)

    def forward(self, x, bias):
        return x + self.drop(F.gelu(self.fc(x))) + bias


class DropLM(TinyLM):
    """TinyLM with dropout after the embedding, in every block and before the head."""

    def __init__(self, layers: int):
        super().__init__(layers)
        self.blocks = nn.LayerList([DropBlock(self.head.weight.shape[0]) for _ in range(layers)])
        self.drop = nn.Dropout(P)

    def forward(self, tokens):
        x = self.drop(self.wte(tokens))
        for blk in self.blocks:
            x = blk(x, self.shift)
        return self.head(F.dropout(x, 0.1))


def fresh(layers: int):
    dt.seed(5)
    model = DropLM(layers)
    return model, dt.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())


def dense_run(layers: int, m: int, steps: int):
    """The un-pipelined run over the same micro-batches (one after the other)."""
    model, opt = fresh(layers)
    losses, b = [], 4
    for s in range(steps):
        x, y = data(s, b * m)
        total = 0.0
        for i in range(m):
            loss = loss_fn(model(dt.to_tensor(x[i * b:(i + 1) * b])),
                           dt.to_tensor(y[i * b:(i + 1) * b]))
            (loss * (1.0 / m)).backward()
            total += float(loss.numpy()) / m
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses, {n: p.numpy() for n, p in model.named_parameters()}, \
        default_generator.next_seed()


@pytest.mark.parametrize("schedule,v,pp,m", [
    (s, v, pp, m) for s, v in [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("VPP", 3)]
    for pp, m in [(1, 1), (2, 2), (2, 4), (3, 6), (4, 8), (3, 5)] if s != "VPP" or m % pp == 0])
def test_first_forwards_first_never_deadlocks(schedule, v, pp, m):
    acts = [first_forwards_first(a) for a in schedule_actions(schedule, pp, m, v)]
    for stage in acts:
        n0 = sum(1 for a in stage if a.kind == "F" and a.mb == 0)
        assert n0 == v and all(a.kind == "F" and a.mb == 0 for a in stage[:n0])
    simulate(acts, v)  # raises on a deadlock


@pytest.mark.parametrize("kind", ["pp_dp", "pp"])
@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "VPP"])
def test_dropout_masks_equal_the_unpipelined_run(kind, schedule):
    mesh, cfg = layout(kind)
    pp = mesh.get_dim_size("pp")
    v = 2 if schedule == "VPP" else 1
    m = 4 if schedule != "VPP" or 4 % pp == 0 else 2 * pp
    layers, steps = 2 * pp, 3
    want_losses, want_params, want_next = dense_run(layers, m, steps)
    model, opt = fresh(layers)
    cfg["pp_config"] = {"split_spec": "blocks", "schedule": schedule, "vpp_degree": v}
    model, opt = dt.parallelize(model, opt, mesh, cfg)
    kw = {"vpp_degree": v} if schedule == "VPP" else {}
    sched = SCHEDULES[schedule](model, n_microbatches=m, loss_fn=loss_fn, **kw)
    for s in range(steps):
        loss = sched.step(*data(s, 4 * m))
        assert float(loss.numpy()) == pytest.approx(want_losses[s], rel=1e-6)
        opt.step()
        opt.clear_grad()
    for n, p in model.named_parameters():
        got = full(p)
        if got is not None:
            assert_close(got, want_params[n], 1.0, f"param {n}")
    assert sched._per_mb == layers + 2
    assert default_generator.next_seed() == want_next  # every rank where the dense run is


def test_dropout_changes_the_loss():
    """The masks matter: without dropout the same run gives other losses."""
    mesh, cfg = layout("pp")
    pp = mesh.get_dim_size("pp")
    with_drop = dense_run(2 * pp, 2, 1)[0]
    model, _ = fresh(2 * pp)
    model.eval()
    x, y = data(0, 8)
    plain = float(loss_fn(model(dt.to_tensor(x[:4])), dt.to_tensor(y[:4])).numpy())
    assert abs(plain - with_drop[0]) > 1e-4


def test_changed_draw_count_is_reported_on_every_rank():
    n = collectives.init().size
    mesh = dt.ProcessMesh(list(range(n)), dim_names=["pp"])
    model, _ = fresh(2 * n)
    model, _ = dt.parallelize(model, None, mesh, {"pp_config": {"split_spec": "blocks"}})
    sched = dt.pipelining.Schedule1F1B(model, n_microbatches=2, loss_fn=loss_fn)
    sched.step(*data(0, 8))
    model.drop.p = 0.0  # one draw fewer per micro-batch (p = 0 draws nothing)
    with pytest.raises(RuntimeError, match=f"drew {2 * n + 1} random seeds per micro-batch "
                                           f".* planned {2 * n + 2}"):
        sched.step(*data(1, 8))
    assert sched._per_mb is None
    sched.step(*data(2, 8))
    assert sched._per_mb == 2 * n + 1


def _square_loss(out, y):
    return (out * out).mean()  # no collective in its forward


@pytest.mark.parametrize("schedule", ["1F1B", "VPP"])
def test_grad_sync_once_per_step(schedule):
    """The gradient all-reduces of a step do not grow with the micro-batches (one bucket per
    chunk on the stage), and the gradients are the dense run's."""
    mesh, cfg = layout("pp_dp")
    pp, dp = mesh.get_dim_size("pp"), mesh.get_dim_size("dp")
    v = 2 if schedule == "VPP" else 1
    counts = {}
    for m in (pp, 4 * pp):
        dt.seed(3)
        model = TinyLM(2 * pp)
        dense = TinyLM(2 * pp)
        dense.set_state_dict(model.state_dict())
        model, _ = dt.parallelize(model, None, mesh, dict(cfg, pp_config={
            "split_spec": "blocks", "schedule": schedule, "vpp_degree": v}))
        kw = {"vpp_degree": v} if schedule == "VPP" else {}
        sched = SCHEDULES[schedule](model, n_microbatches=m, loss_fn=_square_loss, **kw)
        x, y = data(0, 4 * m)
        sched.step(x, y)  # the first step learns the draws (one broadcast more)
        model.clear_gradients()
        with dt.jit.record() as calls:
            sched.step(x, y)
        counts[m] = [str(c.op) for c in calls].count("grad_bucket_start")
        for i in range(m):
            xb = dt.to_tensor(x[i * 4:(i + 1) * 4])
            (_square_loss(dense(xb), None) * (1.0 / m)).backward()
        for (name, p), q in zip(model.named_parameters(), dense.parameters()):
            g = None if p.grad is None else full(p.grad)
            if p.process_mesh.contains(dt.get_rank()):
                want = q.grad.numpy()
                assert_close(g, want, np.max(np.abs(want)), f"m={m} grad {name}")
    assert counts[pp] == counts[4 * pp]
    if dp > 1:  # every stage's chunks hold replicated weights with Partial gradients
        assert counts[pp] == v
    else:
        assert counts[pp] == 0
