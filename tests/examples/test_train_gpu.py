"""train.py's models on the GPU (cupy): the same losses and weights as on the CPU, eager and
captured, dense and on a mesh (ranks sharing one GPU exchange through host-staged MPI).

Skipped where cupy with a CUDA device is not importable."""
from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest

import disttensor as dt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)

STEPS = 4


def _run(model_name: str, device: str, mesh, captured: bool):
    """Losses of STEPS steps and the global parameters after them."""
    model, opt, batches = train.build(model_name, 11, mesh, device=device)
    for name, p in model.named_parameters():
        assert p.place.startswith(device), (name, p.place)

    def step(x, y):
        return train.train_step(model, opt, x, y)
    if captured:
        step = dt.jit.to_static(step)
    losses = []
    for k in range(STEPS):
        x, y = train.to_tensors(*batches[k % 4], mesh, device)
        loss = step(x, y)
        assert loss.place.startswith(device)
        losses.append(float(loss.numpy()))
    params = {n: p.numpy() for n, p in model.named_parameters()}  # global values
    return np.array(losses), params


#: parameters whose exact gradient is zero: the MLP's fc1 bias (batch norm subtracts it again)
#: and attention's key bias (it adds one constant to a row of scores, which softmax ignores).
#: Their gradients are rounding noise, which Adam scales to steps of about lr, so cuBLAS's and
#: OpenBLAS's noise move them differently (float32 against float64 on the CPU does the same):
#: they are held only to Adam's bound, 3 lr per step.
GRADIENT_FREE = {"mlp": r"^fc1\.bias$", "gpt": r"attn\.k\.bias$"}
LR = {"mlp": 1e-2, "gpt": 3e-3}


def _compare(model_name: str, mesh, captured: bool) -> None:
    # float32 through cuBLAS and through OpenBLAS sum in different orders
    cpu_l, cpu_p = _run(model_name, "cpu", mesh, captured)
    gpu_l, gpu_p = _run(model_name, "gpu", mesh, captured)
    np.testing.assert_allclose(gpu_l, cpu_l, rtol=2e-4, err_msg=f"{model_name} losses")
    assert cpu_l[-1] < cpu_l[0]
    for name in cpu_p:
        if re.search(GRADIENT_FREE[model_name], name):
            tol = {"rtol": 0.0, "atol": 2 * 3 * LR[model_name] * STEPS}
        else:
            tol = {"rtol": 2e-3, "atol": 2e-4}
        np.testing.assert_allclose(gpu_p[name], cpu_p[name], **tol,
                                   err_msg=f"{model_name} {name}")


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_dense_training_on_gpu_equals_cpu(model_name, captured):
    _compare(model_name, None, captured)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_mesh_training_on_gpu_equals_cpu(model_name, captured):
    dt.init_parallel_env()
    _compare(model_name, train.default_mesh(dt.get_world_size()), captured)


def test_a_captured_gpu_step_keeps_host_values_on_the_host():
    """Replay runs each op with the array module eager ran it with: the learning rate (a
    ``host_scalar``, place None) is numpy while Adam's update is cupy, so replaying reads no
    value back from the device (bound to the program's module, the learning rate was a cupy
    0-d array and each parameter's update waited for the GPU: 3-4 ms a step at xl)."""
    import cupy

    model, opt, batches = train.build("gpt", 11, None, device="gpu")
    step = dt.jit.to_static(lambda x, y: train.train_step(model, opt, x, y))
    for k in range(3):
        step(*train.to_tensors(*batches[k % 4], None, "gpu"))
    modules = {}
    for op in step.program.ops:
        for s in op.steps:
            modules.setdefault(op.name, set()).add(s.xp)
    assert modules["host_scalar"] == {np}
    assert modules["adam_update"] == {cupy}
    assert modules["matmul"] == {cupy}
