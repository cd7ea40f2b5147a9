import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import coords, meta, run

from spmd_rules import (
    DistAttr,
    Flatten,
    InputDim,
    Partial,
    Replicate,
    Shard,
    Singleton,
    Split,
    TensorMeta,
    local_ranges,
    local_shape,
    make_reshape_dim_trans,
    reshard_cost,
)

S, R, P = Shard, Replicate, Partial


def test_dim_trans_examples():
    assert make_reshape_dim_trans((6, 12, 48), (72, 6, 8)) == [
        Flatten(InputDim(0), InputDim(1)), Split(InputDim(2), (6, 8), 0),
        Split(InputDim(2), (6, 8), 1)]
    f = Flatten(InputDim(0), InputDim(1))
    assert make_reshape_dim_trans((2, 3), (3, 2)) == [Split(f, (3, 2), 0), Split(f, (3, 2), 1)]
    # size-1 dims pair with the size-1 dims of the same gap (a sharding on them survives)
    assert make_reshape_dim_trans((1, 4, 1, 3), (4, 1, 3)) == [InputDim(1), InputDim(2),
                                                               InputDim(3)]
    assert make_reshape_dim_trans((1, 4, 3), (4, 1, 3)) == [InputDim(1), Singleton(), InputDim(2)]
    assert make_reshape_dim_trans((), (1, 1)) == [Singleton(), Singleton()]
    assert repr(f) == "Flatten(InputDim(dim=0), InputDim(dim=1))"
    with pytest.raises(ValueError):
        make_reshape_dim_trans((2, 3), (5,))


def test_flatten_of_sharded_inner_dim_moves_to_the_leading_dim():
    # the inner dim cannot stay sharded through the flatten (its pieces are not whole rows of
    # the flattened dim: 3 rows of 2 over 2 ranks): its mesh dim moves to dim 0 (one
    # all-to-all) rather than being gathered, and the output stays sharded
    r = run("reshape", meta((8, 3, 2), [S(1)]), shape=(48,))
    assert r.inputs[0].dims_mapping == ((0,), (), ()) \
        and r.outputs[0].dist_attr.dims_mapping == ((0,),)
    assert reshard_cost((8, 3, 2), 1, meta((8, 3, 2), [S(1)]).dist_attr, r.inputs[0]) < \
        reshard_cost((8, 3, 2), 1, meta((8, 3, 2), [S(1)]).dist_attr, DistAttr.replicated(3, (2,)))
    # the last dim of the group: the flattened dim is strided by the leading size, no move
    r = run("reshape", meta((8, 6), [S(1)]), shape=(48,))
    assert r.inputs[0].dims_mapping == ((), (0,))
    assert r.outputs[0].dist_attr.to_placements() == [S(0, split_factor=8)]


def test_flatten_of_sharded_leading_dim_survives():
    r = run("reshape", meta((8, 6), [S(0)]), shape=(48,))
    assert r.inputs[0].dims_mapping == ((0,), ()) and r.outputs[0].dist_attr.dims_mapping == ((0,),)


@pytest.mark.parametrize("mesh", [2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_reshape_6_12_48(mesh, dim):
    r = run("reshape", meta((6, 12, 48), [S(dim)], (mesh,)), shape=(72, 6, 8))
    out = r.outputs[0]
    assert out.shape == (72, 6, 8)
    expected = {  # (input dim kept?, output dim)
        (0, 2): ((0,), 0), (0, 4): (None, None),  # 6 % 4 != 0
        (1, 2): (None, None), (1, 4): (None, None),  # not the leftmost dim of the Flatten
        (2, 2): ((0,), 1), (2, 4): (None, None),  # first Split piece 6 % 4 != 0
    }[(dim, mesh)]
    if expected[0] is None:  # dim cannot stay sharded: the cheapest layout the rule keeps
        src = meta((6, 12, 48), [S(dim)], (mesh,)).dist_attr
        assert r.inputs[0] == run("reshape", TensorMeta((6, 12, 48), r.inputs[0]),
                                  shape=(72, 6, 8)).inputs[0]
        assert reshard_cost((6, 12, 48), 1, src, r.inputs[0]) <= \
            reshard_cost((6, 12, 48), 1, src, DistAttr.replicated(3, (mesh,)))
    else:
        assert r.inputs[0].dims_mapping[dim] == (0,)
        assert out.dist_attr.dims_mapping[expected[1]] == (0,)


def test_reshape_2x3_to_3x2():
    for d in (0, 1):
        r = run("reshape", meta((2, 3), [S(d)]), shape=(3, 2))
        assert r.inputs[0].is_replicated()


def test_reshape_split_divisible():
    r = run("reshape", meta((12,), [S(0)], (3,)), shape=(6, 2))
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), ())


def test_uneven_on_mesh_of_3():
    # InputDim keeps an uneven sharding
    r = run("reshape", meta((7, 4), [S(0)], (3,)), shape=(7, 2, 2))
    assert r.inputs[0].dims_mapping == ((0,), ())
    assert r.outputs[0].dist_attr.dims_mapping == ((0,), (), ())
    # Flatten with an uneven leading dim -> replicate
    r = run("reshape", meta((7, 4), [S(0)], (3,)), shape=(28,))
    assert r.inputs[0].is_replicated()
    # split whose first piece is not divisible -> replicate
    r = run("reshape", meta((8,), [S(0)], (3,)), shape=(4, 2))
    assert r.inputs[0].is_replicated()


def test_co_shard_prefix_survives():
    # dim 0 of size 4 co-sharded by mesh (2, 4): 2 divides 4, 2*4 does not -> keep mesh 0 only
    r = run("reshape", meta((4, 3), [S(0), S(0)], (2, 4)), shape=(12,))
    assert r.inputs[0].dims_mapping == ((0,), ()) and r.outputs[0].dist_attr.dims_mapping == ((0,),)


def test_partial_kept_and_2d_mesh():
    r = run("reshape", meta((4, 6), [P(), S(0)], (2, 2)), shape=(2, 2, 6))
    assert r.inputs[0] == DistAttr((2, 2), ((1,), ()), ((0, "sum"),))
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((1,), (), ()), ((0, "sum"),))


def test_size_zero():
    r = run("reshape", meta((0, 4), [S(1)]), shape=(2, 0, 2))
    assert r.inputs[0].is_replicated() and r.outputs[0].shape == (2, 0, 2)


def test_reshape_errors():
    with pytest.raises(ValueError, match=r"reshape.*\(8, 6\).*\(47,\)"):
        run("reshape", meta((8, 6), [R()]), shape=(47,))
    with pytest.raises(ValueError, match="view.*shape"):
        run("reshape", meta((8, 6), [R()]), shape=(-1, 6), op="view")


def test_squeeze_unsqueeze_flatten():
    r = run("squeeze", meta((4, 1, 6), [S(2)]), axis=(1,))
    assert r.outputs[0].shape == (4, 6) and r.outputs[0].dist_attr.dims_mapping == ((), (0,))
    r = run("squeeze", meta((4, 1, 6), [S(1)]), axis=())
    assert r.outputs[0].shape == (4, 6) and r.inputs[0].dims_mapping == ((0,), (), ())
    assert run("squeeze", meta((4, 1, 6), [R()]), axis=(0,)).outputs[0].shape == (4, 1, 6)
    r = run("unsqueeze", meta((4, 6), [S(1), P()], (2, 2)), axis=(0, 2))
    assert r.outputs[0].shape == (1, 4, 1, 6)
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((), (), (), (0,)), ((1, "sum"),))
    with pytest.raises(ValueError, match="unsqueeze.*axis"):
        run("unsqueeze", meta((4, 6), [R()]), axis=(3,))
    r = run("flatten", meta((4, 6, 5), [S(1)], (3,)), start_axis=1, stop_axis=2)
    assert r.outputs[0].shape == (4, 30) and r.outputs[0].dist_attr.dims_mapping == ((), (0,))
    r = run("flatten", meta((4, 6, 5), [S(2)]), start_axis=0, stop_axis=2)
    assert r.inputs[0].dims_mapping == ((), (), (0,))  # no move: strided by the 24 rows
    assert r.outputs[0].dist_attr.to_placements() == [S(0, split_factor=24)]
    r = run("flatten", meta((4, 5, 6), [S(1)]), start_axis=0, stop_axis=2)
    assert r.inputs[0].dims_mapping == ((0,), (), ())  # all-to-all onto the leading dim
    assert run("flatten", meta((), [R()])).outputs[0].shape == (1,)
    with pytest.raises(ValueError, match="flatten.*start_axis"):
        run("flatten", meta((4, 6), [R()]), start_axis=1, stop_axis=0)


# ---------------------------------------------------------------- property

def _primes(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def reshape_cases(draw):
    ndim = draw(st.integers(0, 4))
    src = tuple(draw(st.lists(st.integers(0, 6) if draw(st.booleans()) else st.integers(1, 6),
                              min_size=ndim, max_size=ndim)))
    total = int(np.prod(src))
    if total == 0:
        tgt = list(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        tgt[draw(st.integers(0, len(tgt) - 1))] = 0
    else:
        k = draw(st.integers(1, 4))
        groups = [1] * k
        for p in _primes(total):
            groups[draw(st.integers(0, k - 1))] *= p
        tgt = [g for g in groups if g != 1] if draw(st.booleans()) else groups
        for _ in range(draw(st.integers(0, 2))):
            tgt.insert(draw(st.integers(0, len(tgt))), 1)
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    choices = [R(), P()] + [S(d, split_factor=k) for d in range(ndim) for k in (1, 1, 2, 3)]
    attr = DistAttr.from_placements([draw(st.sampled_from(choices)) for _ in mesh], ndim, mesh)
    return src, tuple(tgt), attr


def _piece(g, attr, c):
    """The piece of ``g`` at ``c`` (strided shards: their ranges in order)."""
    idx = [np.concatenate([np.arange(a, b) for a, b in r] or [np.zeros(0, int)])
           for r in local_ranges(g.shape, attr, c)]
    return g[np.ix_(*idx)] if idx else g


def _check_reshape(src, tgt, attr):
    r = run("reshape", TensorMeta(src, attr), shape=tgt)
    req, out = r.inputs[0], r.outputs[0].dist_attr
    assert req.partial == attr.partial == out.partial
    # the required layout is one the rule keeps as it is, and no dearer than gathering
    assert run("reshape", TensorMeta(src, req), shape=tgt).inputs[0] == req
    plain = attr.without_partial()
    assert reshard_cost(src, 1, plain, req.without_partial()) <= \
        reshard_cost(src, 1, plain, DistAttr.replicated(len(src), attr.mesh_shape))
    g = np.arange(int(np.prod(src))).reshape(src)
    dense = g.reshape(tgt)
    for c in coords(attr.mesh_shape):
        piece = _piece(g, req, c)
        np.testing.assert_array_equal(piece.reshape(local_shape(tgt, out, c)),
                                      _piece(dense, out, c))
    return req


@settings(max_examples=400, deadline=None)
@given(reshape_cases())
def test_reshape_local_pieces_property(case):
    _check_reshape(*case)


@settings(max_examples=100, deadline=None)
@given(reshape_cases())
def test_identity_reshape_keeps_layout(case):
    src, _, attr = case
    if int(np.prod(src)):  # size-1 dims included: each pairs with itself
        assert _check_reshape(src, src, attr) == attr


@pytest.mark.parametrize("target", [(1, 2, 4), (1, 4, 2), (1, 8)])
def test_uneven_size_one_shard_survives_views(target):
    """PyTorch's uneven view cases: [1, 2, 2, 2] as S(0) on 4 ranks (one piece holds the dim,
    three are empty) reshapes without communication and stays sharded on the size-1 dim."""
    x = meta((1, 2, 2, 2), [S(0)], (4,))
    r = run("reshape", x, shape=target)
    assert r.inputs[0] == x.dist_attr
    assert r.outputs[0].dist_attr.dims_mapping == ((0,),) + ((),) * (len(target) - 1)
    _check_reshape((1, 2, 2, 2), target, x.dist_attr)
    r = run("flatten", x, start_axis=1, stop_axis=3)
    assert r.inputs[0] == x.dist_attr and r.outputs[0].dist_attr.dims_mapping == ((0,), ())


def test_flatten_of_sequence_sharded_activation_without_a_gather():
    """[6, seq, 3] as S(1) flattened to [6*seq, 3]: the seq shard becomes the strided shard of
    dim 0 by the 6 leading rows (no communication at all); reshaped back it is S(1) again."""
    from spmd_rules import plan_same_mesh
    x = meta((6, 5, 3), [S(1)])
    r = run("flatten", x, start_axis=0, stop_axis=1)
    assert r.outputs[0].shape == (30, 3)
    assert r.outputs[0].dist_attr.to_placements() == [S(0, split_factor=6)]
    assert plan_same_mesh((6, 5, 3), 4, x.dist_attr, r.inputs[0]) == ()
    back = run("reshape", r.outputs[0], shape=(6, 5, 3))
    assert back.inputs[0] == r.outputs[0].dist_attr and back.outputs[0].dist_attr == x.dist_attr
    _check_reshape((6, 5, 3), (30, 3), x.dist_attr)


@pytest.mark.parametrize("target", [(192,), (12, 2, 8), (8, 6, 4)])
def test_co_sharded_reshape_keeps_four_way_sharding(target):
    """[4, 6, 8] as [S(0), S(1)] on 2x2 (Paddle's co-shard cases): the output stays 4-way
    co-sharded on its first dim; mesh dim 1 moves onto dim 0 by one all-to-all (cheaper than
    the all-gather the dim-1 shard would otherwise need); values checked per coordinate."""
    from spmd_rules import plan_same_mesh
    x = meta((4, 6, 8), [S(0), S(1)], (2, 2))
    r = run("reshape", x, shape=target)
    assert r.outputs[0].dist_attr.dims_mapping[0] == (0, 1)
    steps = plan_same_mesh((4, 6, 8), 4, x.dist_attr, r.inputs[0])
    assert [s.kind for s in steps] == ["all_to_all"]
    _check_reshape((4, 6, 8), target, x.dist_attr)
