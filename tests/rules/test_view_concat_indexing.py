import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import check_output, meta, pieces_of, run, simulate

from spmd_rules import (
    RULES,
    DistAttr,
    Partial,
    Replicate,
    Shard,
    TensorMeta,
    get_rule,
    local_shape,
    register_rule,
    rule_coverage,
)

S, R, P = Shard, Replicate, Partial


def test_transpose():
    r = run("transpose", meta((4, 6, 8), [S(0), P()], (2, 2)), perm=(2, 0, 1))
    assert r.inputs[0].dims_mapping == ((0,), (), ())
    assert r.outputs[0].shape == (8, 4, 6)
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((), (0,), ()), ((1, "sum"),))
    with pytest.raises(ValueError, match=r"transpose.*perm=\(0, 0\)"):
        run("transpose", meta((4, 6), [R()]), perm=(0, 0))


def test_slice():
    x = meta((4, 6, 8), [S(0), S(2)], (2, 2))
    r = run("slice", x, index=(slice(0, 4, 1), None, 2, slice(1, 8, 2)))
    assert r.outputs[0].shape == (4, 1, 4)
    # mesh 1 leaves the partially sliced dim 2 for dim 0 (all-to-all beats all-gather)
    assert r.inputs[0].dims_mapping == ((0, 1), (), ())
    assert r.outputs[0].dist_attr.dims_mapping == ((0, 1), (), ())
    r = run("slice", meta((4, 6), [S(1), P()], (2, 2)), index=(1,))
    assert r.outputs[0].shape == (6,)
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((0,),), ((1, "sum"),))
    r = run("slice", meta((4, 6), [S(0)]), index=(slice(0, 100, 1),))
    assert r.inputs[0].dims_mapping == ((0,), ())  # clipped stop: still full range
    with pytest.raises(ValueError, match="getitem.*out of range"):
        run("slice", meta((4, 6), [R()]), index=(4,), op="getitem")
    with pytest.raises(ValueError, match="slice.*3 items"):
        run("slice", meta((4, 6), [R()]), index=(0, 0, 0))


def test_slice_grad():
    dout = meta((4, 1, 4), [S(0), S(2)], (2, 2))
    r = run("slice_grad", dout, index=(slice(0, 4, 1), None, 2, slice(1, 8, 2)),
            input_shape=(4, 6, 8))
    assert r.inputs[0].dims_mapping == ((0, 1), (), ())
    assert r.outputs[0].shape == (4, 6, 8)
    assert r.outputs[0].dist_attr.dims_mapping == ((0, 1), (), ())
    with pytest.raises(ValueError, match="slice_grad.*dout"):
        run("slice_grad", meta((4, 1, 3), [R()]), index=(slice(0, 4, 1), None, 2, slice(1, 8, 2)),
            input_shape=(4, 6, 8))


def test_set_value():
    x = meta((4, 6, 8), [S(0), S(2)], (2, 2))
    v = meta((4, 3), [R(), R()], (2, 2))
    index = (slice(0, 4, 1), 2, slice(1, 7, 2))
    r = run("set_value", x, v, index=index)
    assert r.inputs[0].dims_mapping == ((0, 1), (), ())  # partial slice on dim 2: mesh 1 moves
    assert r.inputs[1].dims_mapping == ((0, 1), ())      # value follows region dim 0
    assert r.outputs[0].shape == (4, 6, 8) and r.outputs[0].dist_attr == r.inputs[0]
    # a broadcast (size-1) value dim stays replicated
    r = run("set_value", x, meta((1, 3), [R(), R()], (2, 2)), index=index)
    assert r.inputs[1].dims_mapping == ((), ())
    # numeric check on every coordinate: the local assignment gives the output's local piece
    g, val = np.arange(4 * 6 * 8.0).reshape(4, 6, 8), -np.arange(12.0).reshape(4, 3)
    expected = g.copy()
    expected[index] = val
    r = run("set_value", x, v, index=index)
    xs, vs = pieces_of(g, r.inputs[0]), pieces_of(val, r.inputs[1])
    out = {}
    for c, piece in xs.items():
        local = tuple(slice(None) if dm else it for dm, it in zip(r.inputs[0].dims_mapping, index))
        out[c] = piece.copy()
        out[c][local] = vs[c]
    check_output(r.outputs[0], out, expected)
    with pytest.raises(ValueError, match="set_value.*broadcast"):
        run("set_value", x, meta((5, 3), [R(), R()], (2, 2)), index=index)


def test_concat_stack_split():
    a, b = meta((4, 6), [S(0)]), meta((3, 6), [S(1)])
    r = run("concat", a, b, axis=0)
    assert r.outputs[0].shape == (7, 6) and r.inputs == (DistAttr((2,), ((), (0,))),) * 2
    r = run("concat", meta((4, 6), [S(0)]), meta((4, 2), [R()]), axis=1)
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), ())
    pa = meta((4, 6), [P()])
    assert run("concat", pa, pa, axis=0).outputs[0].dist_attr.is_partial()
    assert not run("concat", pa, meta((4, 6), [R()]), axis=0).inputs[0].is_partial()
    with pytest.raises(ValueError, match=r"concat.*input 1.*\(3, 5\)"):
        run("concat", a, meta((3, 5), [R()]), axis=0)
    r = run("stack", meta((4, 6), [S(1)]), meta((4, 6), [S(0)]), axis=1)
    assert r.outputs[0].shape == (4, 2, 6) and r.outputs[0].dist_attr.dims_mapping == ((), (), (0,))
    with pytest.raises(ValueError, match="stack.*input 1"):
        run("stack", meta((4, 6), [R()]), meta((4, 5), [R()]), axis=0)
    r = run("split", meta((7, 6), [S(0), S(1)], (2, 2)), sections=(3, 4), axis=0)
    assert [o.shape for o in r.outputs] == [(3, 6), (4, 6)]
    # mesh dim 0 leaves the split axis for dim 1, inside mesh dim 1's pieces (an all-to-all)
    assert r.inputs[0].dims_mapping == ((), (1, 0)) == r.outputs[1].dist_attr.dims_mapping
    with pytest.raises(ValueError, match="split.*sections"):
        run("split", meta((7, 6), [R()]), sections=(3, 3), axis=0)


def test_gather():
    r = run("gather", meta((10, 6), [S(0), S(1)], (2, 2)), meta((5,), [S(0), R()], (2, 2)), axis=0)
    # x's mesh dim 0 moves onto dim 1 inside mesh dim 1's pieces (an all-to-all of x's quarter)
    # rather than x all-gathering it; the index is gathered (10 elements moved, not 15)
    assert r.inputs[0].dims_mapping == ((), (1, 0)) and r.inputs[1].dims_mapping == ((),)
    assert r.outputs[0].shape == (5, 6) and r.outputs[0].dist_attr.dims_mapping == ((), (1, 0))
    with pytest.raises(ValueError, match="index_select.*index"):
        run("gather", meta((10, 6), [R()]), meta((5, 2), [R()]), axis=0, op="index_select")


def test_gather_grad():
    r = run("gather_grad", meta((5,), [S(0), R()], (2, 2)), meta((5, 6), [R(), S(1)], (2, 2)),
            axis=0, input_shape=(10, 6))
    assert r.inputs[1].dims_mapping == ((0,), (1,))
    assert r.outputs[0].shape == (10, 6)
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((), (1,)), ((0, "sum"),))
    with pytest.raises(ValueError, match="gather_grad.*dout"):
        run("gather_grad", meta((5,), [R()]), meta((4, 6), [R()]), axis=0, input_shape=(10, 6))


def test_gather_simulations():
    rng = np.random.default_rng(0)
    x, idx = rng.standard_normal((7, 3)), np.array([6, 0, 2, 2, 5])
    r = run("gather", meta((7, 3), [S(0)], (3,)), meta((5,), [S(0)], (3,)), axis=0)
    simulate(r, [x, idx.astype(float)], lambda a, i, coord: a[i.astype(int)], x[idx])
    dout = rng.standard_normal((5, 3))
    r = run("gather_grad", meta((5,), [S(0)], (3,)), meta((5, 3), [R()], (3,)), axis=0,
            input_shape=(7, 3))

    def scatter(i, d, coord):
        out = np.zeros((7, 3))
        np.add.at(out, i.astype(int), d)
        return out
    want = np.zeros((7, 3))
    np.add.at(want, idx, dout)
    simulate(r, [idx.astype(float), dout], scatter, want)


def test_one_hot_tile_expand():
    r = run("one_hot", meta((4, 5), [S(1)]), num_classes=3)
    assert r.outputs[0].shape == (4, 5, 3) and r.outputs[0].dist_attr.dims_mapping == ((), (0,), ())
    with pytest.raises(ValueError, match="one_hot.*num_classes"):
        run("one_hot", meta((4,), [R()]), num_classes=None)
    r = run("tile", meta((4, 6), [S(0), S(1)], (2, 2)), repeat_times=(2, 1, 3))
    assert r.outputs[0].shape == (2, 4, 18)
    assert r.inputs[0].dims_mapping == ((0, 1), ())
    assert r.outputs[0].dist_attr.dims_mapping == ((), (0, 1), ())
    r = run("tile", meta((4, 6), [S(1)]), repeat_times=(2,))
    assert r.outputs[0].shape == (4, 12) and r.inputs[0].dims_mapping == ((0,), ())
    r = run("expand", meta((4, 1), [S(0), S(1)], (2, 2)), shape=(3, 4, 5))
    assert r.outputs[0].shape == (3, 4, 5)
    assert r.inputs[0].dims_mapping == ((0, 1), ())
    assert r.outputs[0].dist_attr.dims_mapping == ((), (0, 1), ())
    with pytest.raises(ValueError, match=r"expand.*\(4, 2\).*\(4, 5\)"):
        run("expand", meta((4, 2), [R()]), shape=(4, 5))


def test_replicated_fallback_and_registry():
    r = run("replicated", meta((4, 6), [S(0), P()], (2, 2)), None, out_shapes=((3,), (2, 2)),
            op="svd")
    assert r.inputs[0] == DistAttr.replicated(2, (2, 2)) and r.inputs[1] is None
    assert [o.shape for o in r.outputs] == [(3,), (2, 2)] and all(o.dist_attr.is_replicated()
                                                                  for o in r.outputs)
    r = run("replicated", out_shapes=((2,),), mesh_shape=(4,))
    assert r.outputs[0].dist_attr.mesh_shape == (4,)
    with pytest.raises(ValueError, match="svd.*out_shapes"):
        run("replicated", meta((4,), [R()]), op="svd")
    with pytest.raises(KeyError, match="nope"):
        get_rule("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_rule("matmul")(lambda metas, attrs: None)
    cov = rule_coverage({"add": "elementwise", "svd": "replicated", "foo": None, "bar": "missing"})
    assert cov == {"rule": ["add"], "fallback": ["foo", "svd"], "unknown": ["bar"]}
    expected = {"elementwise", "matmul", "reduction", "softmax", "layer_norm", "layer_norm_grad",
                "batch_norm", "batch_norm_grad", "embedding", "embedding_grad", "cross_entropy",
                "cross_entropy_grad", "reshape", "transpose", "squeeze", "unsqueeze", "flatten",
                "slice", "slice_grad", "concat", "stack", "split", "gather", "gather_grad",
                "one_hot", "tile", "expand", "replicated"}
    assert expected <= set(RULES)


def test_mesh_mismatch_and_missing_inputs():
    with pytest.raises(ValueError, match="concat.*different shapes"):
        run("concat", meta((4,), [R()]), meta((4,), [R(), R()], (2, 2)), axis=0)
    with pytest.raises(ValueError, match="embedding.*input 1"):
        run("embedding", meta((4,), [R()]), None)
    with pytest.raises(ValueError, match="layer_norm.*expected 3 inputs"):
        run("layer_norm", meta((4,), [R()]))


# ---------------------------------------------------------------- properties

@st.composite
def layout_of(draw, shape, mesh, partial=True):
    choices = [R()] + ([P()] if partial else []) + [S(d) for d in range(len(shape))]
    return DistAttr.from_placements([draw(st.sampled_from(choices)) for _ in mesh], len(shape),
                                    mesh)


@st.composite
def view_cases(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    return shape, mesh, draw(layout_of(shape, mesh))


def _g(shape):
    return np.arange(int(np.prod(shape)), dtype=float).reshape(shape) - 3


@settings(max_examples=150, deadline=None)
@given(view_cases(), st.randoms())
def test_transpose_property(case, rnd):
    shape, mesh, attr = case
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    r = run("transpose", TensorMeta(shape, attr), perm=tuple(perm))
    assert r.inputs[0] == attr
    simulate(r, [_g(shape)], lambda a, coord: a.transpose(perm), _g(shape).transpose(perm))


@st.composite
def index_for(draw, shape):
    items = []
    for size in shape[:draw(st.integers(0, len(shape)))]:
        if draw(st.booleans()) and size:
            items.append(draw(st.integers(0, size - 1)))
        else:
            items.append(slice(draw(st.integers(0, size + 1)), draw(st.integers(0, size + 2)),
                               draw(st.integers(1, 3))))
        if draw(st.integers(0, 4)) == 0:
            items.append(None)
    return tuple(items)


def _local_index(index, required, shape):
    """The runtime's local index: full-range axes become slice(None), other items stay global."""
    out, axis = [], 0
    for it in index:
        if it is None:
            out.append(None)
            continue
        full = isinstance(it, slice) and range(shape[axis])[it] == range(shape[axis])
        out.append(slice(None) if full else it)
        axis += 1
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(view_cases(), st.data())
def test_slice_and_slice_grad_property(case, data):
    shape, mesh, attr = case
    index = data.draw(index_for(shape))
    r = run("slice", TensorMeta(shape, attr), index=index)
    local = _local_index(index, r.inputs[0], shape)
    g = _g(shape)
    simulate(r, [g], lambda a, coord: a[local], g[index])
    # slice_grad: scatter dout into zeros of the local dx shape
    out_shape = g[index].shape
    dattr = data.draw(layout_of(out_shape, mesh))
    rg = run("slice_grad", TensorMeta(out_shape, dattr), index=index, input_shape=shape)
    dout = _g(out_shape)

    def grad(d, coord):
        dx = np.zeros(local_shape(shape, rg.outputs[0].dist_attr, coord))
        dx[local] = d
        return dx
    want = np.zeros(shape)
    want[index] = dout
    simulate(rg, [dout], grad, want)


@settings(max_examples=150, deadline=None)
@given(view_cases(), st.data())
def test_tile_expand_concat_property(case, data):
    shape, mesh, attr = case
    g = _g(shape)
    reps = tuple(data.draw(st.lists(st.integers(0, 3), max_size=len(shape) + 1)))
    r = run("tile", TensorMeta(shape, attr), repeat_times=reps)
    simulate(r, [g], lambda a, coord: np.tile(a, reps), np.tile(g, reps))
    if 1 in shape or not shape:
        tgt = tuple(data.draw(st.integers(0, 3)) if s == 1 else s for s in shape)
        tgt = tuple(data.draw(st.lists(st.integers(0, 3), max_size=2))) + tgt
        r = run("expand", TensorMeta(shape, attr), shape=tgt)
        simulate(r, [g], lambda a, coord: np.broadcast_to(a, _local_out(r, coord)),
                 np.broadcast_to(g, tgt))
    if shape:
        axis = data.draw(st.integers(0, len(shape) - 1))
        other = shape[:axis] + (data.draw(st.integers(0, 3)),) + shape[axis + 1:]
        b = TensorMeta(other, data.draw(layout_of(other, mesh)))
        r = run("concat", TensorMeta(shape, attr), b, axis=axis)
        simulate(r, [g, _g(other)], lambda x, y, coord: np.concatenate([x, y], axis),
                 np.concatenate([g, _g(other)], axis))


def _local_out(result, coord):
    return local_shape(result.outputs[0].shape, result.outputs[0].dist_attr, coord)
