"""The op checks on ``place="gpu"`` (cupy): forward values and gradients equal the numpy ones.

Skipped where cupy with a CUDA device is not importable."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor.ops import OPS
from disttensor.dispatch import apply

from core_samples import SAMPLES


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return False


pytestmark = [pytest.mark.gpu]
if not _cuda_available():
    pytestmark.append(pytest.mark.skip(reason="cupy with a CUDA device is not available on "
                                              "this machine"))

# a representative list: every kernel family, every kernel that branches on xp (erf, scatter-add)
GPU_OPS = ["add", "divide", "maximum", "pow", "exp", "gelu", "sigmoid", "relu", "scale", "cast",
           "clip", "where", "matmul", "sum", "max", "reshape", "transpose", "slice", "set_value",
           "split", "concat", "stack", "expand", "tile", "softmax", "log_softmax", "layer_norm",
           "batch_norm", "batch_norm_infer", "embedding", "cross_entropy", "dropout", "gather"]


def _run(op, arrays, attrs, place, weights=None):
    """Outputs (numpy) and, with weights, the grads of sum_i <w_i, out_i> (numpy)."""
    gin = [i for i in (op.grad_inputs if op.grad_inputs is not None else range(len(arrays)))
           if arrays[i] is not None and np.asarray(arrays[i]).dtype.kind == "f"]
    ts = [None if a is None else dt.to_tensor(a, place=place, stop_gradient=i not in gin)
          for i, a in enumerate(arrays)]
    outs = apply(op, tuple(ts), attrs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    for o in outs:
        assert o.place.startswith(place), (op.name, o.place)
    values = [o.numpy() for o in outs]
    if weights is None:
        return values, None
    slots = sorted(weights)
    seeds = [dt.to_tensor(weights[i].astype(values[i].dtype), place=place) for i in slots]
    grads = dt.grad([outs[i] for i in slots], [ts[i] for i in gin], grad_outputs=seeds,
                    allow_unused=True)
    return values, [None if g is None else g.numpy() for g in grads]


@pytest.mark.parametrize("name", GPU_OPS)
def test_gpu_matches_cpu(name):
    op = OPS[name]
    for k, build in enumerate(SAMPLES[name]):
        rng = np.random.default_rng(2000 + k)
        arrays, attrs = build(rng)
        cpu_vals, _ = _run(op, arrays, attrs, "cpu")
        weights = {i: rng.standard_normal(v.shape) for i, v in enumerate(cpu_vals)
                   if i not in op.nondiff_outputs and v.dtype.kind == "f"}
        cpu_vals, cpu_grads = _run(op, arrays, attrs, "cpu", weights)
        gpu_vals, gpu_grads = _run(op, arrays, attrs, "gpu", weights)
        for c, g in zip(cpu_vals, gpu_vals):
            np.testing.assert_allclose(g, c, rtol=1e-7, atol=1e-9, err_msg=f"{name} forward")
        for c, g in zip(cpu_grads, gpu_grads):
            if c is None:
                assert g is None
                continue
            np.testing.assert_allclose(g, c, rtol=1e-7, atol=1e-9, err_msg=f"{name} backward")


def test_gpu_public_functions_and_inplace():
    x_np = np.random.default_rng(0).standard_normal((4, 3))
    x = dt.to_tensor(x_np, place="gpu", stop_gradient=False)
    loss = dt.cross_entropy(x, dt.to_tensor(np.array([0, 2, 1, -100]), place="gpu"))
    loss.backward()
    ref = dt.to_tensor(x_np, stop_gradient=False)
    ref_loss = dt.cross_entropy(ref, dt.to_tensor(np.array([0, 2, 1, -100])))
    ref_loss.backward()
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), ref.grad.numpy(), rtol=1e-10)
    assert x.grad.place.startswith("gpu")
    y = dt.to_tensor(x_np, place="gpu")
    v = y[1:]
    assert y.add_(1.0) is y and v.inplace_version == 1
    np.testing.assert_allclose(v.numpy(), x_np[1:] + 1)
    dt.seed(3)
    d_gpu = dt.dropout(dt.to_tensor(np.ones((5, 7)), place="gpu"), 0.5).numpy()
    dt.seed(3)
    d_cpu = dt.dropout(dt.to_tensor(np.ones((5, 7))), 0.5).numpy()
    np.testing.assert_array_equal(d_gpu, d_cpu)
    nm = dt.numel(y)
    assert nm.item() == 12 and nm.place.startswith("gpu")
