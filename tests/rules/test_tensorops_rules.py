"""The tensor ops' rules as pure functions of metadata: which axes stay sharded, which are
gathered, where a Partial stays, and the errors (op, argument, shapes)."""
import pytest
from rules_util import meta, run

from spmd_rules import DistAttr, Partial, Replicate, Shard

S, R, P = Shard, Replicate, Partial


def test_along_axes_gathers_only_the_axis():
    x = meta((4, 6, 8), [S(0), S(2)], (2, 2))
    r = run("along_axes", x, axis=2, out_size=3, num_outputs=2)  # topk over the sharded axis
    # the axis is whole; its mesh dim co-shards dim 0 (an all-to-all beats the all-gather)
    assert r.inputs[0].dims_mapping[0][0] == 0 and r.inputs[0].dims_mapping[2] == ()
    assert [o.shape for o in r.outputs] == [(4, 6, 3)] * 2
    assert r.outputs[0].dist_attr == r.inputs[0]
    # linear ops (cumsum, flip, roll) keep a Partial(sum); sort resolves it
    xp = meta((4, 6), [S(0), P()], (2, 2))
    assert run("along_axes", xp, axis=1, linear=True).outputs[0].dist_attr.partial == (
        (1, "sum"),)
    assert run("along_axes", xp, axis=1).inputs[0].partial == ()
    with pytest.raises(ValueError, match=r"sort: axis=2 out of range for ndim 2"):
        run("along_axes", meta((4, 6), [R()]), axis=2, op="sort")


def test_unbind_and_take_along_axis():
    r = run("unbind", meta((3, 8), [S(1)]), axis=0)
    assert len(r.outputs) == 3 and r.outputs[0].dist_attr == DistAttr((2,), ((0,),))
    x, i = meta((6, 8), [S(0), R()], (2, 2)), meta((6, 3), [S(0), S(1)], (2, 2))
    r = run("take_along_axis", x, i, axis=1)
    assert r.inputs[0].dims_mapping == ((0,), ())  # arr's axis whole
    assert r.inputs[1].dims_mapping == ((0,), (1,))  # the indices' axis stays sharded
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), (1,))
    g = run("take_along_axis_grad", i, meta((6, 3), [S(0), S(1)], (2, 2)), axis=1,
            input_shape=(6, 8))
    assert g.outputs[0].shape == (6, 8) and g.outputs[0].dist_attr.partial == ((1, "sum"),)
    with pytest.raises(ValueError, match=r"take_along_axis: indices of shape \[5, 3\] must match "
                                         r"arr of shape \[6, 8\]"):
        run("take_along_axis", x, meta((5, 3), [R(), R()], (2, 2)), axis=1)


def test_scatter_and_put_along_axis():
    x, ids, v = meta((6, 8), [S(0), S(1)], (2, 2)), meta((2,), [R(), R()], (2, 2)), \
        meta((2, 8), [R(), S(1)], (2, 2))
    r = run("scatter", x, ids, v, index=(slice(0, 6, 1), slice(0, 8, 1)), axis=0)
    assert r.inputs[0].dims_mapping[0] == () and r.inputs[0].dims_mapping[1][0] == 1
    assert r.inputs[2].dims_mapping == r.inputs[0].dims_mapping  # value follows x's slices
    assert r.outputs[0].dist_attr == r.inputs[0]
    with pytest.raises(ValueError, match=r"scatter: value of shape \[3, 8\] must have shape "
                                         r"\[2, 8\]"):
        run("scatter", x, ids, meta((3, 8), [R(), R()], (2, 2)),
            index=(slice(0, 6, 1), slice(0, 8, 1)), axis=0)
    r = run("put_along_axis", meta((6, 8), [S(1)]), meta((6, 2), [S(0)]), meta((6, 2), [R()]),
            axis=1)
    assert all(a.dims_mapping[1] == () for a in r.inputs)


def test_einsum_and_statistics():
    a, b = meta((4, 6), [S(0), S(1)], (2, 2)), meta((6, 5), [R(), R()], (2, 2))
    r = run("einsum", a, b, equation="ij,jk->ik")
    assert r.inputs[1].dims_mapping == ((1,), ())  # j follows a's shard: no gather of a
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((0,), ()), ((1, "sum"),))
    with pytest.raises(ValueError, match=r"einsum: label 'j' has size 6 and 5"):
        run("einsum", a, meta((5, 5), [R(), R()], (2, 2)), equation="ij,jk->ik")
    # the reduced axis keeps its shard; the output is whole there and not Partial
    r = run("axis_statistics", meta((4, 6), [S(0), S(1)], (2, 2)), axis=(1,), keepdim=False)
    assert r.inputs[0].dims_mapping == ((0,), (1,))
    assert r.outputs[0].shape == (4,) and r.outputs[0].dist_attr == DistAttr((2, 2), ((0,),))
    r = run("axis_statistics", meta((4, 6), [P(), R()], (2, 2)), axis=(0,), keepdim=True)
    assert r.inputs[0].partial == () and r.outputs[0].shape == (1, 6)
