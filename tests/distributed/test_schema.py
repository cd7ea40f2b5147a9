"""The static op schema (single process): what the registry declares before a kernel runs
matches what the kernels do.

- dtype inference: for every registered op and every oracle case, ``op.out_dtypes`` equals the
  dtypes the kernel returns (so ranks outside a mesh, which run no kernel, label outputs right);
- views: an output declared a view shares the buffer of its input, one that is not does not;
  ``reshape`` decides the view up front exactly as numpy does (hypothesis over strided arrays);
- mutated pairs: the kernel returns the very arrays it was given for them;
- registration checks rule names and pairs.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_util import op_cases

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.ops import OPS
from disttensor.ops.shape import reshape_is_view
from disttensor.schema import DENSE_CTX, register

RULE_OPS = sorted(n for n, op in OPS.items() if op.rule is not None)


def _kernel(op, arrays, attrs):
    res = op.kernel(np, *arrays, ctx=DENSE_CTX, **attrs) if op.needs_ctx else \
        op.kernel(np, *arrays, **attrs)
    return res if isinstance(res, tuple) else (res,)


@pytest.mark.parametrize("name", RULE_OPS)
def test_dtype_inference_matches_the_kernel(name):
    op = OPS[name]
    for arrays, attrs in op_cases()[name]:
        for cast in (None, np.float32):  # float64 samples, and the same in float32
            ins = [None if a is None else (np.asarray(a).astype(cast) if cast and np.asarray(
                a).dtype == np.float64 else np.array(a)) for a in arrays]
            got = tuple(np.asarray(r).dtype for r in _kernel(op, ins, attrs))
            want = op.out_dtypes([None if a is None else a.dtype for a in ins], attrs)
            if op.n_out == -1:
                want = want * len(got)
            assert got == tuple(want), f"{name}: kernel gives {got}, schema says {want}"


@pytest.mark.parametrize("name", RULE_OPS)
def test_declared_views_and_mutated_pairs(name):
    op = OPS[name]
    for arrays, attrs in op_cases()[name]:
        ins = [None if a is None else np.array(a) for a in arrays]
        res = _kernel(op, ins, attrs)
        for slot, out in enumerate(res):
            src = op.view_source(slot)
            mut = op.mutated_input(slot)
            if mut is not None:
                assert out is ins[mut], f"{name}: output {slot} must be input {mut} itself"
            elif src is not None and op.view_if is None and np.asarray(out).size:
                assert np.shares_memory(out, ins[src]), f"{name}: output {slot} is no view"
            elif src is None and ins and np.asarray(out).size:
                for a in ins:
                    if a is not None:
                        assert not np.shares_memory(out, a), \
                            f"{name}: output {slot} shares memory with an input"


_dims = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(_dims, st.data())
def test_reshape_view_decision_matches_numpy(shape, data):
    perm = data.draw(st.permutations(range(len(shape))))
    steps = data.draw(st.lists(st.integers(1, 2), min_size=len(shape), max_size=len(shape)))
    big_shape = [n * s for n, s in zip(shape, steps)]
    big = np.arange(int(np.prod(big_shape)), dtype=np.float32).reshape(big_shape)
    arr = big[tuple(slice(None, None, s) for s in steps)].transpose(perm)
    total = arr.size
    # a target shape: a random factorisation of the element count (with size-1 dims)
    target, rest = [], total
    for p in (2, 3, 2, 1, 5):
        while rest % p == 0 and rest > 1 and data.draw(st.booleans()):
            target.append(p)
            rest //= p
    target.append(rest)
    if data.draw(st.booleans()):
        target.insert(data.draw(st.integers(0, len(target))), 1)
    out = arr.reshape(target)
    assert reshape_is_view(arr.shape, arr.strides, {"shape": tuple(target)}) == \
        np.shares_memory(out, arr), (arr.shape, arr.strides, target)


def test_reshape_view_or_copy_through_the_api():
    x = dt.to_tensor(np.arange(24.0).reshape(2, 3, 4))
    v = x.reshape([6, 4])  # contiguous: a view sharing the holder
    assert v._value.holder is x._value.holder and v._is_view
    t = x.transpose([0, 2, 1])  # a view with permuted strides
    c = t.reshape([2, 12])  # not expressible with strides: a copy with its own holder
    assert c._value.holder is not x._value.holder and not c._is_view
    np.testing.assert_array_equal(c.numpy(), np.arange(24.0).reshape(2, 3, 4)
                                  .transpose(0, 2, 1).reshape(2, 12))
    w = t.reshape([2, 4, 3, 1])  # only a size-1 dim added: still a view
    assert w._value.holder is x._value.holder


def test_registration_checks_rule_names_and_pairs():
    with pytest.raises(ValueError, match="no_such_rule"):
        register("bad_rule_op", lambda xp, x: x, rule="no_such_rule")
    with pytest.raises(ValueError, match="output 3"):
        register("bad_pair_op", lambda xp, x: x, rule="elementwise", mutates=((0, 3),))
    assert "bad_rule_op" not in OPS and "bad_pair_op" not in OPS


def test_every_public_function_is_exported_and_methods_bound():
    from disttensor.schema import API, METHODS

    for name, fn in API.items():
        assert getattr(dt, name) is fn, name
    for name in METHODS:
        assert callable(getattr(dt.Tensor, name)), name
    x = dt.to_tensor([1.0, 2.0])
    assert (x + 1).tolist() == [2.0, 3.0] and (2 - x).tolist() == [1.0, 0.0]


def test_inplace_result_that_cannot_be_cast_is_refused():
    x = dt.to_tensor(np.array([1, 2, 3]))
    v = x.inplace_version
    with pytest.raises(TypeError, match="add: inputs of different dtypes .*int64.*float32"):
        x.add_(0.5)  # Paddle: an int tensor with a float scalar is float32
    with pytest.raises(TypeError, match="divide_"):
        x.divide_(dt.to_tensor(np.array([2, 2, 2])))
    with pytest.raises(TypeError, match="add: inputs of different dtypes"):
        x.add_(dt.to_tensor(np.array([1, 1, 1], dtype=np.int32)))  # Paddle refuses int mixes
    assert x.tolist() == [1, 2, 3] and x.inplace_version == v  # nothing was modified
    x.add_(dt.to_tensor(np.array([1, 1, 1])))
    assert x.tolist() == [2, 3, 4]
    f = dt.to_tensor(np.array([1.0, 2.0], dtype=np.float32))
    f.add_(dt.to_tensor(np.array([0.5, 0.5])))  # float64 result cast back into float32
    assert f.dtype == dt.float32 and f.tolist() == [1.5, 2.5]


def test_mutating_ops_return_their_inputs():
    p = dt.to_tensor(np.ones((3, 2)))
    g = dt.to_tensor(np.full((3, 2), 0.5))
    holder, v = p._value.holder, p.inplace_version
    out = apply(OPS["sgd_update"], (p, g, dt.to_tensor(0.1, dtype="float64")),
                {"l2": 0.0, "lr_scale": 1.0})
    assert out is p and p._value.holder is holder and p.inplace_version == v + 1
    np.testing.assert_allclose(p.numpy(), np.full((3, 2), 0.95))
