"""A checkpoint saved under one pipeline degree loads under another (and under none) and the
training goes on with the same loss (parameters and Adam states resharded across stages)."""
from __future__ import annotations

import numpy as np
import pytest
from test_pipeline_mpi import data, fresh, loss_fn

import collectives
import disttensor as dt

pytestmark = pytest.mark.mpi

M, LAYERS = 4, 4


def state(model, opt) -> dict:
    """Parameters and optimizer states keyed by structured names (the auto-generated
    parameter names differ between two builds of the model)."""
    opt.create_states()
    states = opt.state_dict()
    by_name = {}
    for sname, p in model.named_parameters():
        prefix = p.name + "_"
        by_name.update({f"{sname}.{k[len(prefix):]}": v for k, v in states.items()
                        if k.startswith(prefix)})
    return {"model": model.state_dict(), "opt": by_name}


def pipelined(mesh, schedule=dt.pipelining.Schedule1F1B, cfg=None):
    model, opt = fresh(LAYERS)
    config = dict(cfg or {}, pp_config={"split_spec": "blocks"})
    model, opt = dt.parallelize(model, opt, mesh, config)
    return model, opt, schedule(model, n_microbatches=M, loss_fn=loss_fn)


def next_loss_dense(model, opt) -> float:
    x, y = data(2, 4 * M)
    b = 4
    total = 0.0
    for i in range(M):
        loss = loss_fn(model(dt.to_tensor(x[i * b:(i + 1) * b])),
                       dt.to_tensor(y[i * b:(i + 1) * b]))
        (loss * (1.0 / M)).backward()
        total += float(loss.numpy()) / M
    return total


def test_checkpoint_moves_between_pipeline_degrees(tmp_path_factory, comm):
    n = collectives.init().size
    path = comm.bcast(str(tmp_path_factory.mktemp("pp_ckpt")) if comm.rank == 0 else None)
    grid = [[0, 1], [2, 3]] if n == 4 else [[r] for r in range(n)]
    model, opt, sched = pipelined(dt.ProcessMesh(grid, dim_names=["pp", "dp"]),
                                  cfg={"dp_config": {}})
    for k in range(2):
        sched.step(*data(k, 4 * M))
        opt.step()
        opt.clear_grad()
    dt.save_state_dict(state(model, opt), path)
    want = float(sched.step(*data(2, 4 * M)).numpy())

    # pp = world size, another schedule
    model2, opt2, sched2 = pipelined(dt.ProcessMesh(list(range(n)), dim_names=["pp"]),
                                     dt.pipelining.ScheduleFThenB)
    st = state(model2, opt2)
    dt.load_state_dict(st, path)
    assert float(sched2.step(*data(2, 4 * M)).numpy()) == pytest.approx(want, rel=1e-6)

    # no pipeline: a dense model, one step later still equal
    model3, opt3 = fresh(LAYERS)
    st = state(model3, opt3)
    dt.load_state_dict(st, path)
    assert next_loss_dense(model3, opt3) == pytest.approx(want, rel=1e-6)
    opt3.step()
    opt3.clear_grad()
    opt.step()
    opt.clear_grad()
    after = float(sched.step(*data(3, 4 * M)).numpy())
    x, y = data(3, 4 * M)
    dense_after = np.mean([float(loss_fn(model3(dt.to_tensor(x[i * 4:(i + 1) * 4])),
                                         dt.to_tensor(y[i * 4:(i + 1) * 4])).numpy())
                           for i in range(M)])
    assert after == pytest.approx(dense_after, rel=1e-5)
