import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import meta, run, simulate

from spmd_rules import DistAttr, Partial, Replicate, Shard, TensorMeta

S, R, P = Shard, Replicate, Partial


def placements(r, i):
    return r.inputs[i].to_placements()


def out_pl(r):
    return r.outputs[0].dist_attr.to_placements()


def test_row_times_replicated():
    r = run("matmul", meta((8, 6), [S(0)]), meta((6, 4), [R()]))
    assert out_pl(r) == [S(0)] and r.outputs[0].shape == (8, 4)


def test_replicated_times_col():
    r = run("matmul", meta((8, 6), [R()]), meta((6, 4), [S(1)]))
    assert out_pl(r) == [S(1)]


def test_k_sharded_x_replicated_y():
    r = run("matmul", meta((8, 6), [S(1)]), meta((6, 4), [R()]))
    assert placements(r, 1) == [S(0)] and out_pl(r) == [P()]


def test_k_times_k():
    r = run("matmul", meta((8, 6), [S(1)]), meta((6, 4), [S(0)]))
    assert placements(r, 0) == [S(1)] and placements(r, 1) == [S(0)] and out_pl(r) == [P()]


def test_conflict_m_and_n_on_same_mesh_dim():
    r = run("matmul", meta((8, 6), [S(0)]), meta((6, 4), [S(1)]))
    assert placements(r, 1) == [R()] and out_pl(r) == [S(0)]


def test_2d_mesh_megatron():
    # dp (mesh 0) shards the rows of x, mp (mesh 1) shards k in both operands
    x = meta((8, 6), [S(0), S(1)], mesh=(2, 2))
    y = meta((6, 4), [R(), S(0)], mesh=(2, 2))
    r = run("matmul", x, y)
    assert out_pl(r) == [S(0), P()]


def test_transposes():
    x = meta((6, 8), [S(1)])  # x^T is [8, 6]; dim 1 of x is m
    y = meta((4, 6), [S(1)])  # y^T is [6, 4]; dim 1 of y is k
    r = run("matmul", x, y, transpose_x=True, transpose_y=True)
    assert r.outputs[0].shape == (8, 4)
    assert out_pl(r) == [S(0)] and placements(r, 1) == [R()]
    r = run("matmul", meta((6, 8), [S(0)]), meta((4, 6), [R()]), transpose_x=True, transpose_y=True)
    assert placements(r, 1) == [S(1)] and out_pl(r) == [P()]


def test_batch_dims_broadcast():
    x = meta((3, 1, 8, 6), [S(0), S(1)], mesh=(3, 2))
    y = meta((5, 6, 4), [R(), S(0)], mesh=(3, 2))
    r = run("matmul", x, y)
    assert r.outputs[0].shape == (3, 5, 8, 4)
    assert r.inputs[0].dims_mapping == ((0,), (), (), ())  # size-1 batch dim: replicated
    assert r.inputs[1].dims_mapping == ((1,), (), ())
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), (1,), (), ())


def test_vectors():
    r = run("matmul", meta((6,), [S(0)]), meta((6,), [R()]))
    assert r.outputs[0].shape == () and r.outputs[0].dist_attr.partial == ((0, "sum"),)
    r = run("matmul", meta((6,), [R()]), meta((2, 6, 4), [S(2)]))
    assert r.outputs[0].shape == (2, 4) and out_pl(r) == [S(1)]
    r = run("matmul", meta((3, 8, 6), [S(1)]), meta((6,), [R()]))
    assert r.outputs[0].shape == (3, 8) and out_pl(r) == [S(1)]


def test_partial_inputs():
    r = run("matmul", meta((8, 6), [P()]), meta((6, 4), [R()]))
    assert out_pl(r) == [P()] and r.inputs[0].is_partial()
    # P @ P: the smaller operand (y: 24 < 48 elements) is resolved, x stays Partial
    r = run("matmul", meta((8, 6), [P()]), meta((6, 4), [P()]))
    assert out_pl(r) == [P()] and r.inputs[0].is_partial() and not r.inputs[1].is_partial()
    r = run("matmul", meta((2, 6), [P()]), meta((6, 4), [P()]))
    assert out_pl(r) == [P()] and not r.inputs[0].is_partial() and r.inputs[1].is_partial()
    # keeping x's partial on mesh 0 would gather y's columns and leave the whole [8, 4] output
    # Partial on both mesh dims; resolving x (24 elements a rank) keeps y's columns sharded
    r = run("matmul", meta((8, 6), [P(), S(1)], (2, 2)), meta((6, 4), [S(1), R()], (2, 2)))
    assert not r.inputs[0].is_partial() and r.inputs[1].dims_mapping == ((1,), (0,))
    assert out_pl(r) == [S(1), P()]


def test_shape_errors():
    with pytest.raises(ValueError, match=r"my_matmul.*\(8, 6\).*\(5, 4\)"):
        run("matmul", meta((8, 6), [R()]), meta((5, 4), [R()]), op="my_matmul")
    with pytest.raises(ValueError, match="matmul.*broadcast"):
        run("matmul", meta((2, 8, 6), [R()]), meta((3, 6, 4), [R()]))
    with pytest.raises(ValueError, match="matmul.*at least 1 dim"):
        run("matmul", meta((), [R()]), meta((3,), [R()]))
    with pytest.raises(ValueError, match="matmul.*mesh"):
        run("matmul", meta((8, 6), [R()]), meta((6, 4), [R(), R()], mesh=(2, 2)))


@st.composite
def mm_cases(draw):
    k = draw(st.integers(0, 5))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    x_nd, y_nd = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    m, n = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    tx, ty = draw(st.booleans()), draw(st.booleans())
    xs = (k,) if x_nd == 1 else \
        batch[draw(st.integers(0, len(batch))):] + ((k, m) if tx else (m, k))
    ys = (k,) if y_nd == 1 else \
        tuple(1 if draw(st.booleans()) else b for b in batch) + ((n, k) if ty else (k, n))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    attrs = []
    for shape in (xs, ys):
        choices = [R(), P()] + [S(d) for d in range(len(shape))]
        attrs.append(DistAttr.from_placements([draw(st.sampled_from(choices)) for _ in mesh],
                                              len(shape), mesh))
    return xs, ys, tx and x_nd > 1, ty and y_nd > 1, attrs


@settings(max_examples=200, deadline=None)
@given(mm_cases())
def test_matmul_local_op_gives_global_result(case):
    xs, ys, tx, ty, (xa, ya) = case
    r = run("matmul", TensorMeta(xs, xa), TensorMeta(ys, ya), transpose_x=tx, transpose_y=ty)

    def mm(a, b, coord=None):
        return np.matmul(np.swapaxes(a, -1, -2) if tx else a, np.swapaxes(b, -1, -2) if ty else b)
    rng = np.random.default_rng(1)
    x, y = rng.integers(-3, 4, size=xs).astype(float), rng.integers(-3, 4, size=ys).astype(float)
    simulate(r, [x, y], mm, mm(x, y), rng)
