"""Central finite differences against the registered backward of EVERY differentiable op.

The ops are called through :func:`disttensor.dispatch.apply` with the attrs the public
functions would pass; the scalar checked is a random projection ``sum_i <w_i, out_i>`` over the
differentiable outputs, differentiated with respect to every floating (grad) input.
"""
from __future__ import annotations

import numpy as np
import pytest
from core_samples import OPTIONS, SAMPLES

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.ops import OPS

# the distributed entry points (rule None: reshard, shard_tensor, ...) have their gradient
# tests in tests/distributed/test_api.py
DIFFERENTIABLE = sorted(name for name, op in OPS.items()
                        if op.differentiable and op.rule is not None)


def test_every_differentiable_op_has_samples():
    missing = [name for name in DIFFERENTIABLE if not SAMPLES.get(name)]
    assert not missing, f"differentiable ops without finite-difference samples: {missing}"
    stale = sorted(set(SAMPLES) - set(DIFFERENTIABLE))
    assert not stale, f"samples for ops that are not differentiable (or not registered): {stale}"


def grad_input_indices(op, arrays) -> list[int]:
    idx = op.grad_inputs if op.grad_inputs is not None else range(len(arrays))
    return [i for i in idx if arrays[i] is not None and np.asarray(arrays[i]).dtype.kind == "f"]


def as_tuple(outs):
    return outs if isinstance(outs, (tuple, list)) else (outs,)


def diff_slots(op, outs) -> list[int]:
    return [i for i, o in enumerate(outs)
            if i not in op.nondiff_outputs and np.dtype(o.dtype).kind == "f"]


def forward(op, arrays, attrs, to=lambda a: dt.to_tensor(a)):
    with dt.no_grad():
        return as_tuple(apply(op, tuple(None if a is None else to(a) for a in arrays), attrs))


def projected(op, arrays, attrs, weights) -> float:
    outs = forward(op, arrays, attrs)
    return float(sum(np.sum(weights[i] * outs[i].numpy().astype(np.float64)) for i in weights))


def check_case(name, build, seed, to_tensor=dt.to_tensor, numpy_of=lambda t: t.numpy()):
    """Compare the analytic gradient with central differences; returns the analytic grads."""
    op = OPS[name]
    opts = OPTIONS.get(name, {})
    h, rtol, atol = opts.get("h", 1e-6), opts.get("rtol", 1e-6), opts.get("atol", 1e-5)
    rng = np.random.default_rng(seed)
    arrays, attrs = build(rng)
    gin = grad_input_indices(op, arrays)
    assert gin, f"{name}: sample has no floating grad input"

    outs0 = forward(op, arrays, attrs)
    slots = diff_slots(op, outs0)
    assert slots, f"{name}: no differentiable output"
    weights = {i: rng.standard_normal(outs0[i].shape) for i in slots}

    tensors = [None if a is None else to_tensor(a, stop_gradient=i not in gin)
               for i, a in enumerate(arrays)]
    outs = as_tuple(apply(op, tuple(tensors), attrs))
    roots = [outs[i] for i in slots]
    seeds = [to_tensor(weights[i].astype(outs[i].dtype)) for i in slots]
    grads = dt.grad(roots, [tensors[i] for i in gin], grad_outputs=seeds, allow_unused=True)

    for k, i in enumerate(gin):
        base = np.array(arrays[i])
        fd = np.zeros(base.shape, dtype=np.float64)
        for j in range(base.size):
            plus, minus = base.copy(), base.copy()
            plus.reshape(-1)[j] += h
            minus.reshape(-1)[j] -= h
            step = float(plus.reshape(-1)[j]) - float(minus.reshape(-1)[j])
            args_p = list(arrays)
            args_m = list(arrays)
            args_p[i], args_m[i] = plus, minus
            fd.reshape(-1)[j] = (projected(op, args_p, attrs, weights)
                                 - projected(op, args_m, attrs, weights)) / step
        g = grads[k]
        got = np.zeros(base.shape) if g is None else numpy_of(g).astype(np.float64)
        assert got.shape == base.shape, f"{name}: grad of input {i} has shape {got.shape}, " \
                                        f"input {base.shape}"
        np.testing.assert_allclose(got, fd, rtol=rtol, atol=atol,
                                   err_msg=f"{name}: gradient of input {i} (attrs {attrs})")
    return grads


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_backward_matches_finite_differences(name):
    cases = SAMPLES.get(name)
    assert cases, f"op {name!r} is differentiable but has no sample in core_samples.SAMPLES"
    for k, build in enumerate(cases):
        check_case(name, build, seed=1000 + k)
