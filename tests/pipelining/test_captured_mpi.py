"""Captured pipelines (``to_static`` with ``strategy.pipeline``) equal the eager schedules bit
for bit over 5 steps (dropout on), and stop capturing once every program exists."""
from __future__ import annotations

import numpy as np
import pytest
from test_pipeline_mpi import SCHEDULES, data, full, layout, loss_fn
from test_step_sync_dropout_mpi import fresh

import disttensor as dt

pytestmark = pytest.mark.mpi

STEPS = 5


def _model(kind: str, schedule: str, v: int):
    mesh, cfg = layout(kind)
    pp = mesh.get_dim_size("pp")
    model, opt = fresh(2 * pp)
    cfg["pp_config"] = {"split_spec": "blocks", "schedule": schedule, "vpp_degree": v}
    model, opt = dt.parallelize(model, opt, mesh, cfg)
    return model, opt, pp


def _eager(kind, schedule, v, m):
    model, opt, _ = _model(kind, schedule, v)
    kw = {"vpp_degree": v} if schedule == "VPP" else {}
    sched = SCHEDULES[schedule](model, n_microbatches=m, loss_fn=loss_fn, **kw)
    losses = []
    for s in range(STEPS):
        losses.append(float(sched.step(*data(s, 4 * m)).numpy()))
        opt.step()
        opt.clear_grad(set_to_zero=False)
    return losses, {n: full(p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["pp_dp", "pp"])
@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "VPP"])
def test_captured_equals_eager_bitwise(kind, schedule):
    pp = layout(kind)[0].get_dim_size("pp")
    v = 2 if schedule == "VPP" else 1
    m = 4 if schedule != "VPP" or 4 % pp == 0 else 2 * pp
    want_losses, want_params = _eager(kind, schedule, v, m)
    model, opt, _ = _model(kind, schedule, v)
    strategy = dt.Strategy()
    strategy.pipeline.enable = True
    strategy.pipeline.schedule_mode = schedule
    strategy.pipeline.accumulate_steps = m
    strategy.pipeline.vpp_degree = v
    dist_model = dt.to_static(model, None, loss_fn, opt, strategy=strategy)
    captures = []
    for s in range(STEPS):
        loss = dist_model(*data(s, 4 * m))
        assert not loss.is_dist() and loss.shape == []
        assert float(loss.numpy()) == want_losses[s], f"step {s}"
        runner = dist_model._pipeline
        captures.append(sum(p.captures for p in runner.schedule.programs.values())
                        + runner.update.captures)
    assert captures[2] == captures[-1]  # nothing captured after the second step
    assert captures[-1] > 0 or not runner.schedule.actions
    for n, p in model.named_parameters():
        got = full(p)
        if got is not None:
            np.testing.assert_array_equal(got, want_params[n], err_msg=n)


def test_strategy_spellings_and_bad_input():
    s = dt.Strategy({"pipeline": {"enable": True, "accumulate_steps": 2}})
    assert s.pipeline.enable and s.pipeline.accumulate_steps == 2
    assert s.pipeline.schedule_mode == "1F1B" and s.pipeline.micro_batch_size == 1
    assert s.pipeline.vpp_degree == 1
    with pytest.raises(ValueError, match=r"unknown pipeline settings \['schedule'\]"):
        dt.Strategy({"pipeline": {"schedule": "1F1B"}})
    with pytest.raises(ValueError, match="unknown groups"):
        dt.Strategy({"pipelines": {}})
    model, opt = fresh(2)
    with pytest.raises(ValueError, match="has no pipeline stages"):
        dt.to_static(model, None, loss_fn, opt, strategy=s)
    model, opt, _ = _model("pp", "1F1B", 1)
    s.pipeline.schedule_mode = "GPipe"
    with pytest.raises(ValueError, match="schedule_mode must be one of"):
        dt.to_static(model, None, loss_fn, opt, strategy=s)
    s.pipeline.schedule_mode = "1F1B"
    with pytest.raises(ValueError, match="needs both loss and optimizer"):
        dt.to_static(model, None, loss_fn, None, strategy=s)
    s.gradient_merge.enable = True
    with pytest.raises(ValueError, match="gradient_merge cannot be enabled beside"):
        dt.to_static(model, None, loss_fn, opt, strategy=s)
