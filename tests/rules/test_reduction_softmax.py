import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import meta, run, simulate

from spmd_rules import DistAttr, Partial, Replicate, Shard, TensorMeta

S, R, P = Shard, Replicate, Partial


def test_sum_sharded_axis_gives_partial():
    r = run("reduction", meta((8, 6), [S(0)]), axis=(0,), keepdim=False, reduce_type="sum")
    assert r.outputs[0].shape == (6,) and r.outputs[0].dist_attr.to_placements() == [P()]
    r = run("reduction", meta((8, 6), [S(0)]), axis=(1,), keepdim=True, reduce_type="mean")
    assert r.outputs[0].shape == (8, 1) and r.outputs[0].dist_attr.to_placements() == [S(0)]
    r = run("reduction", meta((8, 6), [S(1)]), axis=(1,), keepdim=True, reduce_type="mean")
    assert r.outputs[0].shape == (8, 1) and r.outputs[0].dist_attr.to_placements() == [P()]


@pytest.mark.parametrize("kind,rt", [("max", "max"), ("min", "min"), ("prod", "prod"),
                                     ("mean", "sum")])
def test_partial_types(kind, rt):
    r = run("reduction", meta((8, 6), [S(1), S(0)], (2, 3)), axis=None, reduce_type=kind)
    assert r.outputs[0].shape == () and r.outputs[0].dist_attr.partial == ((0, rt), (1, rt))


@pytest.mark.parametrize("kind", ["argmax", "argmin", "any", "all"])
def test_arg_reductions_replicate_reduced_axis(kind):
    r = run("reduction", meta((8, 6), [S(1), S(0)], (2, 3)), axis=(1,), reduce_type=kind)
    # mesh dim 0 leaves the reduced axis for dim 0, split inside mesh dim 1's pieces (one
    # all-to-all; before co-shard orders it was all-gathered)
    assert r.inputs[0].dims_mapping == ((1, 0), ())
    assert r.outputs[0].dist_attr == DistAttr((2, 3), ((1, 0),))


def test_partial_input():
    ps = meta((8, 6), [P()])
    r = run("reduction", ps, axis=(0,), reduce_type="sum")
    assert r.outputs[0].dist_attr.partial == ((0, "sum"),)
    # max of a Partial(sum): resolved (the Partial's mesh dim is not moved onto a dim)
    r = run("reduction", ps, axis=(0,), reduce_type="max")
    assert not r.inputs[0].is_partial() and not r.outputs[0].dist_attr.is_partial()
    pm = meta((8, 6), [P("max")])
    assert run("reduction", pm, axis=(0,), reduce_type="max").inputs[0].is_partial()
    r = run("reduction", meta((8, 6), [P(), S(0)], (2, 2)), axis=(0,), reduce_type="sum")
    assert r.outputs[0].dist_attr.partial == ((0, "sum"), (1, "sum"))


def test_reduction_errors():
    with pytest.raises(ValueError, match="sum.*axis=2"):
        run("reduction", meta((8, 6), [R()]), axis=(2,), op="sum")
    with pytest.raises(ValueError, match="mean.*duplicate"):
        run("reduction", meta((8, 6), [R()]), axis=(1, 1), op="mean", reduce_type="mean")
    with pytest.raises(ValueError, match="reduce_type"):
        run("reduction", meta((8, 6), [R()]), reduce_type="median")


@st.composite
def red_cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    kind = draw(st.sampled_from(["sum", "mean", "max", "min", "prod", "argmax", "any"]))
    # a Partial input of every type: kept when the reduction commutes with it, else resolved
    choices = [R()] + [S(d) for d in range(ndim)] + [P(t) for t in ("sum", "avg", "max", "min",
                                                                     "prod")]
    attr = DistAttr.from_placements([draw(st.sampled_from(choices)) for _ in mesh], ndim, mesh)
    axes = tuple(sorted(draw(st.sets(st.integers(0, max(ndim - 1, 0)), max_size=ndim)))) \
        if ndim else ()
    return shape, attr, kind, axes, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(red_cases())
def test_reduction_local_op_gives_global_result(case):
    shape, attr, kind, axes, keepdim = case
    full_axes = axes or tuple(range(len(shape)))
    if kind in ("max", "min", "argmax") and any(shape[a] == 0 for a in full_axes):
        return  # the dense op rejects empty max/min
    r = run("reduction", TensorMeta(shape, attr), axis=axes, keepdim=keepdim, reduce_type=kind)
    count = int(np.prod([shape[a] for a in full_axes]))
    ax = full_axes

    def dense(a):
        if kind == "argmax":
            return np.argmax(a, axis=ax[0], keepdims=keepdim) if len(ax) == 1 else None
        f = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min, "prod": np.prod,
             "any": np.any}[kind]
        out = f(a, axis=ax, keepdims=keepdim).astype(float)
        return out / count if kind == "mean" and count else out

    def local(a, coord):
        # the runtime's kernels: mean divides by the GLOBAL count; max/min over an empty
        # local piece give the reduction's identity
        if kind in ("max", "min"):
            f = np.max if kind == "max" else np.min
            return f(a, axis=ax, keepdims=keepdim, initial=-np.inf if kind == "max" else np.inf)
        if kind == "argmax":
            return np.argmax(a, axis=ax[0], keepdims=keepdim)
        return dense(a)

    if kind == "argmax" and len(ax) != 1:
        return
    g = np.random.default_rng(2).integers(-3, 4, size=shape).astype(float)
    simulate(r, [g], local, dense(g))


def test_softmax():
    x = meta((4, 6, 8), [S(0), S(2)], (2, 2))
    r = run("softmax", x, axis=2)
    assert r.inputs[0].dims_mapping == ((0, 1), (), ())  # mesh 1 moves onto dim 0 (all-to-all)
    assert len(r.outputs) == 1 and r.outputs[0].dist_attr == r.inputs[0]
    r = run("softmax", meta((4, 6), [R()]), meta((4, 6), [S(0)]), axis=1, num_outputs=1,
            op="softmax_grad")
    assert r.inputs[0].dims_mapping == ((0,), ()) == r.inputs[1].dims_mapping
    r = run("softmax", meta((4, 6), [P()]), axis=0, num_outputs=2)
    assert not r.inputs[0].is_partial() and len(r.outputs) == 2
    assert r.outputs[0].shape == (4, 6)
    with pytest.raises(ValueError, match="softmax_grad.*input 1"):
        run("softmax", meta((4, 6), [R()]), meta((4, 5), [R()]), axis=1, op="softmax_grad")
    with pytest.raises(ValueError, match="log_softmax.*axis=2"):
        run("softmax", meta((4, 6), [R()]), axis=2, op="log_softmax")
    assert run("softmax", meta((), [R()]), axis=0).outputs[0].shape == ()
