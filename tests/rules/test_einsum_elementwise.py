import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import meta, run, simulate

from spmd_rules import (
    DistAttr,
    Partial,
    ReduceType,
    Replicate,
    Shard,
    contracted_partial,
    layout,
    merge_shardings,
)

S, R, P = Shard, Replicate, Partial


def test_merge_first_input_wins_and_mesh_dim_used_once():
    a = DistAttr((2, 2), ((0,), ()))
    b = DistAttr((2, 2), ((1,), (0,)))
    merged = merge_shardings(["mk", "mk"], [a, b])
    # m: from a (mesh 0); k: b wants mesh 0, already used by m -> dropped
    assert merged == {"m": (0,)}
    merged = merge_shardings(["mk", "kn"], [DistAttr((2, 2), ((), (0, 1))),
                                            DistAttr((2, 2), ((0,), (1,)))])
    assert merged == {"k": (0, 1)}
    assert layout("kn", merged, (2, 2)).dims_mapping == ((0, 1), ())
    assert contracted_partial(merged, "mn") == [(0, ReduceType.SUM), (1, ReduceType.SUM)]
    assert merge_shardings(["ab"], [DistAttr((2,), ((0,), ()))], exclude={0}) == {}


def test_replicated_first_does_not_block_later_sharding():
    x, y = meta((4, 6), [R()]), meta((4, 6), [S(1)])
    r = run("elementwise", x, y)
    assert r.inputs[0].dims_mapping == ((), (0,)) == r.outputs[0].dist_attr.dims_mapping


def test_elementwise_same_shape_conflict():
    x, y = meta((4, 6), [S(0)]), meta((4, 6), [S(1)])
    r = run("elementwise", x, y, op="add")
    assert r.inputs == (x.dist_attr, x.dist_attr)
    assert r.outputs[0].shape == (4, 6) and r.outputs[0].dist_attr.to_placements() == [S(0)]


def test_elementwise_broadcast_dims_replicated():
    x = meta((4, 1, 6), [S(1), S(2)], mesh=(2, 3))
    y = meta((5, 6), [S(0), R()], mesh=(2, 3))
    r = run("elementwise", x, y, op="multiply")
    assert r.outputs[0].shape == (4, 5, 6)
    # x's size-1 dim broadcast -> replicated; y's dim 0 (letter of output axis 1) gets mesh 0
    assert r.inputs[0].dims_mapping == ((), (), (1,))
    assert r.inputs[1].dims_mapping == ((0,), (1,))
    assert r.outputs[0].dist_attr.dims_mapping == ((), (0,), (1,))


def test_elementwise_2d_mesh_co_shard():
    x = meta((8, 3), [S(0), S(0)], mesh=(2, 2))
    y = meta((8, 3), [R(), S(0)], mesh=(2, 2))
    r = run("elementwise", x, y)
    # y keeps mesh dim 1 outermost; x reorders its split (one pairwise exchange of its quarter)
    # instead of y all-gathering its half: co-shard order (1, 0)
    assert r.inputs[0].dims_mapping == r.inputs[1].dims_mapping == ((1, 0), ())
    assert r.outputs[0].dist_attr.to_placements() == [S(0, shard_order=1), S(0, shard_order=0)]


def test_elementwise_shape_error_names_op():
    with pytest.raises(ValueError, match=r"add.*\(4, 6\).*\(5, 6\)"):
        run("elementwise", meta((4, 6), [R()]), meta((5, 6), [R()]), op="add")


def test_elementwise_partials():
    ps, rep = meta((4,), [P()]), meta((4,), [R()])
    # default: partial resolved
    r = run("elementwise", ps, rep, op="maximum")
    assert not r.inputs[0].is_partial() and not r.outputs[0].dist_attr.is_partial()
    # add: all partial on the same mesh dims -> kept
    r = run("elementwise", ps, ps, op="add", linear="add")
    assert r.inputs == (ps.dist_attr, ps.dist_attr)
    assert r.outputs[0].dist_attr.partial == ((0, "sum"),)
    # add with one non-partial input -> that input becomes Partial locally, output Partial
    r = run("elementwise", ps, rep, op="add", linear="add")
    assert r.inputs == (ps.dist_attr, ps.dist_attr) and r.outputs[0].dist_attr == ps.dist_attr
    # add with partial max -> resolved; maximum of P(max) and R -> P(max)
    pm = meta((4,), [P("max")])
    assert not run("elementwise", pm, pm, linear="add").outputs[0].dist_attr.is_partial()
    r = run("elementwise", pm, rep, op="maximum", linear="max")
    assert r.inputs == (pm.dist_attr, pm.dist_attr)
    assert r.outputs[0].dist_attr == pm.dist_attr
    r = run("elementwise", pm, rep, op="minimum", linear="min")
    assert not r.outputs[0].dist_attr.is_partial()
    # mul: input 0 partial by default; input 1 only when allowed
    r = run("elementwise", ps, rep, op="divide", linear="mul")
    assert r.outputs[0].dist_attr.is_partial() and r.inputs[0].is_partial()
    r = run("elementwise", rep, ps, op="divide", linear="mul")
    assert not r.outputs[0].dist_attr.is_partial()
    r = run("elementwise", rep, ps, op="multiply", linear="mul", linear_inputs=(0, 1))
    assert r.outputs[0].dist_attr.is_partial() and r.inputs[1].is_partial()
    # P * P: one factor stays Partial, the other is resolved (one all-reduce, not two)
    r = run("elementwise", ps, ps, linear="mul", linear_inputs=(0, 1))
    assert r.inputs == (ps.dist_attr, rep.dist_attr) and r.outputs[0].dist_attr == ps.dist_attr
    # unary
    assert run("elementwise", ps, op="neg", linear="unary").outputs[0].dist_attr.is_partial()
    # like: no reshard of the input, output not partial
    r = run("elementwise", ps, op="zeros_like", linear="like")
    assert r.inputs[0].is_partial() and not r.outputs[0].dist_attr.is_partial()
    with pytest.raises(ValueError, match="linear"):
        run("elementwise", ps, linear="bogus")


def test_elementwise_mul_partial_with_sharded_other_on_same_mesh_dim():
    x = meta((4, 6), [P(), R()], mesh=(2, 2))
    y = meta((4, 6), [S(0), S(1)], mesh=(2, 2))
    r = run("elementwise", x, y, linear="mul")
    # mesh 0 carries x's partial, so y's Shard on mesh 0 is gathered; mesh 1 kept
    assert r.inputs[0] == DistAttr((2, 2), ((), (1,)), ((0, "sum"),))
    assert r.inputs[1].dims_mapping == ((), (1,)) and not r.inputs[1].is_partial()
    assert r.outputs[0].dist_attr == r.inputs[0]


def test_where_three_inputs():
    c, x, y = meta((4, 6), [S(0)]), meta((6,), [S(0)]), meta((4, 1), [R()])
    r = run("elementwise", c, x, y, op="where")
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), ())
    assert r.inputs[1].dims_mapping == ((),)


# ---------------------------------------------------------------- property

@st.composite
def ew_cases(draw):
    ndim = draw(st.integers(0, 3))
    out = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    linear = draw(st.sampled_from([None, "add", "mul"]))
    shapes, attrs = [], []
    for _ in range(2):
        k = draw(st.integers(0, ndim))
        shape = tuple(1 if draw(st.booleans()) else s for s in out[ndim - k:])
        choices = [R(), P()] + [S(d) for d in range(k)]
        placements = [draw(st.sampled_from(choices)) for _ in mesh]
        shapes.append(shape)
        attrs.append(DistAttr.from_placements(placements, k, mesh))
    return shapes, attrs, linear


@settings(max_examples=200, deadline=None)
@given(ew_cases(), st.randoms())
def test_elementwise_local_op_gives_global_result(case, rnd):
    from spmd_rules import TensorMeta
    shapes, attrs, linear = case
    fn = {None: np.maximum, "add": np.add, "mul": np.multiply}[linear]
    metas = [TensorMeta(s, a) for s, a in zip(shapes, attrs)]
    r = run("elementwise", *metas, linear=linear, linear_inputs=(0, 1))
    rng = np.random.default_rng(rnd.randint(0, 1000))
    gs = [rng.integers(-5, 6, size=s).astype(float) for s in shapes]
    simulate(r, gs, lambda a, b, coord: fn(a, b), fn(*gs), rng)


def test_partial_plus_replicate_values_on_simulated_ranks():
    """``P + R`` / ``P - R`` with broadcasting and a sharded R on the partial mesh dim: the
    required layouts (R turned Partial: value on coordinate 0 / own block) give the dense sum."""
    rng = np.random.default_rng(3)
    for mesh, xp, yp, ys in [((2,), [P()], [R()], (6,)), ((2, 2), [P(), S(0)], [S(1), R()], (5, 6)),
                             ((2, 2), [S(0), P()], [R(), S(0)], (6,))]:
        x, y = rng.standard_normal((5, 6)), rng.standard_normal(ys)
        for name, fn in (("add", np.add), ("subtract", np.subtract)):
            r = run("elementwise", meta(x.shape, xp, mesh), meta(y.shape, yp, mesh), op=name,
                    linear="add")
            assert r.outputs[0].dist_attr.is_partial()
            _simulate_with_to_partial(r, [x, y], lambda a, b, coord: fn(a, b), fn(x, y))


def _simulate_with_to_partial(result, globals_, fn, expected):
    """Like rules_util.simulate, but each input's pieces are made from its global value the way
    reshard's local steps make them (Partial(sum) from Replicate: value at coordinate 0)."""
    from rules_util import check_output, coords

    from spmd_rules import local_slices
    mesh = result.inputs[0].mesh_shape
    per_input = []
    for g, a in zip(globals_, result.inputs):
        pieces = {}
        for c in coords(mesh):
            first = all(c[m] == 0 for m, _ in a.partial)
            piece = g[local_slices(g.shape, a, c)]
            pieces[c] = piece if first else np.zeros_like(piece)
        per_input.append(pieces)
    out = {c: fn(*(p[c] for p in per_input), coord=c) for c in coords(mesh)}
    check_output(result.outputs[0], out, expected)


def test_add_of_conflicting_shards_co_shards_the_output_for_one_all_to_all():
    """[S(0), R] + [S(1), R] on 2x2: one input's shard moves (one all-to-all on mesh dim 0),
    and the free mesh dim 1 co-shards dim 0 at no extra cost (a local slice): the output is
    4-way sharded, [S(0), S(0)], for the bytes the 2-way answer would move."""
    from spmd_rules import plan_same_mesh, reshard_cost
    x, y = meta((8, 8), [S(0), R()], (2, 2)), meta((8, 8), [S(1), R()], (2, 2))
    r = run("elementwise", x, y, op="add", linear="add")
    co = meta((8, 8), [S(0), S(0)], (2, 2)).dist_attr
    assert r.inputs == (co, co) and r.outputs[0].dist_attr == co
    assert [s.kind for s in plan_same_mesh((8, 8), 8, x.dist_attr, co)] == ["slice"]
    assert [s.kind for s in plan_same_mesh((8, 8), 8, y.dist_attr, co)] == ["all_to_all", "slice"]
    assert reshard_cost((8, 8), 8, y.dist_attr, co) == reshard_cost((8, 8), 8, y.dist_attr,
                                                                     x.dist_attr)
    # nothing to move: the layout is kept as it is
    r = run("elementwise", x, meta((8, 8), [R(), R()], (2, 2)), op="add", linear="add")
    assert r.outputs[0].dist_attr == x.dist_attr
