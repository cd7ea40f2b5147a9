"""A plan runs only as its compiled form: every kernel an instruction names is called from the
plan's generated function (eager, dense and distributed, inplace too) or from a captured
program's generated step (which binds the same instructions), never by an interpreter."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor import dispatch
from disttensor.schema import OPS

SPIED = ("add", "multiply", "matmul", "relu", "sum", "split", "reshape", "add_grad",
         "matmul_grad", "relu_grad", "multiply_grad", "sum_grad")


@pytest.fixture
def callers(monkeypatch):
    """The file names of the functions that called the spied kernels (plans rebuilt)."""
    seen: list[tuple[str, str]] = []
    for name in SPIED:
        op = OPS.get(name)
        if op is None:
            continue

        def spy(*args, _kernel=op.kernel, _name=name, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_name == "into_arg":  # Instr.bind's out= wrapper
                frame = frame.f_back
            seen.append((_name, frame.f_code.co_filename))
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(op, "kernel", spy)
        monkeypatch.setattr(op, "plans", {})
        monkeypatch.setattr(op, "plan0", None)
    dispatch.clear_plan_cache()
    yield seen
    dispatch.clear_plan_cache()


def _check(seen: list, *prefixes: str) -> None:
    assert seen, "no spied kernel ran"
    bad = [(name, where) for name, where in seen if not where.startswith(prefixes)]
    assert not bad, f"kernels called outside a compiled plan or program: {bad}"


def test_eager_calls_run_through_compiled_plans(callers):
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((4, 6)), rng.standard_normal((6, 3))
    mesh = dt.ProcessMesh([0])
    for make in (dt.to_tensor, lambda a, **kw: dt.shard_tensor(a, mesh, [dt.Shard(0)], **kw)):
        a, b = make(A, stop_gradient=False), make(B, stop_gradient=False)
        y = dt.relu(dt.matmul(a, b)) * 2.0
        parts = dt.split(dt.reshape(y, [12, 1]), 3, axis=0)
        loss = dt.sum(parts[0] + parts[2])
        loss.backward()
        c = make(A)
        c.add_(c)
        h = np.maximum(A @ B, 0) * 2.0
        np.testing.assert_allclose(float(loss.numpy()), h.reshape(-1)[:4].sum()
                                   + h.reshape(-1)[8:].sum(), rtol=1e-12)
        np.testing.assert_allclose(c.numpy(), 2 * A)
        g = np.zeros(12)
        g[:4] = g[8:] = 2.0
        gh = g.reshape(4, 3) * (A @ B > 0)
        np.testing.assert_allclose(a.grad.numpy(), gh @ B.T, rtol=1e-12)
        np.testing.assert_allclose(b.grad.numpy(), A.T @ gh, rtol=1e-12)
    _check(callers, "<disttensor plan>")


def test_captured_programs_run_the_same_instructions(callers):
    rng = np.random.default_rng(1)
    W = rng.standard_normal((6, 3))
    w = dt.to_tensor(W, stop_gradient=False)

    def step(x):
        loss = dt.sum(dt.relu(dt.matmul(x, w)))
        loss.backward()
        return loss
    f = dt.jit.to_static(step)
    for k in range(3):
        X = rng.standard_normal((4, 6))
        w.clear_grad()
        loss = f(dt.to_tensor(X))
        np.testing.assert_allclose(float(loss.numpy()), np.maximum(X @ W, 0).sum(), rtol=1e-12)
        np.testing.assert_allclose(w.grad.numpy(), X.T @ (X @ W > 0), rtol=1e-12)
    replayed = [c for c in callers if c[1].startswith("<disttensor program")]
    assert {name for name, _ in replayed} >= {"matmul", "relu"}
    _check(callers, "<disttensor plan>", "<disttensor program")
