import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rules_util import coords

from spmd_rules import (
    DistAttr,
    Partial,
    ProcessMesh,
    ReduceType,
    Replicate,
    Shard,
    local_offset,
    local_shape,
    local_slices,
    split_range,
)


def test_placement_basics():
    assert repr(Shard(0)) == "Shard(dim=0)"
    assert repr(Replicate()) == "Replicate()"
    assert repr(Partial()) == "Partial(sum)" and repr(Partial("max")) == "Partial(max)"
    assert Partial("sum") == Partial(ReduceType.SUM) and hash(Partial("sum")) == hash(Partial())
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicated() and not Replicate().is_partial()
    assert Partial().is_partial() and not Partial().is_shard()
    assert len({Shard(0), Shard(0), Replicate(), Replicate()}) == 2
    assert ReduceType.SUM == "sum" and ReduceType.kRedMax is ReduceType.MAX
    with pytest.raises(ValueError, match="reduce type"):
        Partial("mean")


def test_process_mesh():
    m = ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["dp", "mp"])
    assert m.shape == [2, 3] and m.ndim == 2 and m.process_ids == [0, 1, 2, 3, 4, 5]
    assert m.mesh == [[0, 1, 2], [3, 4, 5]]
    assert m.get_dim_size("mp") == 3 and m.get_dim_size(0) == 2
    assert m.get_coord(4) == (1, 1) and m.get_coord(9) is None
    assert m.contains(5) and not m.contains(6) and 3 in m
    assert m.rank_at((1, 2)) == 5
    t = m.get_mesh_with_dim("mp")
    assert t.mesh == [[0, 3], [1, 4], [2, 5]] and t.dim_names == ["mp", "dp"]
    assert m.get_mesh_with_dim("mp", 1) == ProcessMesh([1, 4], ["dp"])
    assert m.get_mesh_with_dim("dp", 1) == ProcessMesh([3, 4, 5], ["mp"])
    assert ProcessMesh(np.arange(4).reshape(2, 2)) == ProcessMesh([[0, 1], [2, 3]])
    assert ProcessMesh([0, 1]).dim_names == ["d0"]
    assert ProcessMesh([0, 1]) != ProcessMesh([1, 0])
    assert len({ProcessMesh([0, 1]), ProcessMesh([0, 1])}) == 1
    assert "ProcessMesh" in repr(m)


@pytest.mark.parametrize("bad", [[[0, 1], [2]], [[0, 1], 2], [0, 0], [-1, 0], [], [[0], [[1]]], 3])
def test_process_mesh_bad(bad):
    with pytest.raises(ValueError, match="mesh"):
        ProcessMesh(bad)


def test_process_mesh_bad_names():
    with pytest.raises(ValueError, match="dim_names"):
        ProcessMesh([[0, 1]], dim_names=["x"])
    with pytest.raises(ValueError, match="dim_names"):
        ProcessMesh([[0, 1]], dim_names=["x", "x"])


def test_dist_attr_roundtrip():
    a = DistAttr.from_placements([Shard(0), Shard(-1), Partial("max")], 2, (2, 3, 2))
    assert a.dims_mapping == ((0,), (1,)) and a.partial == ((2, ReduceType.MAX),)
    assert a.to_placements() == [Shard(0), Shard(1), Partial("max")]
    assert a.is_partial() and not a.is_replicated() and a.partial_dims() == (2,)
    assert a.sharded_mesh_dims() == (0, 1) and a.mesh_dims_of(1) == (1,)
    assert a.shard_counts() == (2, 3)
    co = DistAttr.from_placements([Shard(1), Shard(1)], 2, (2, 3))
    assert co.dims_mapping == ((), (0, 1)) and co.shard_counts() == (1, 6)
    assert co.to_placements() == [Shard(1), Shard(1)]
    r = DistAttr.replicated(3, (2,))
    assert r.is_replicated() and r.to_placements() == [Replicate()]
    assert a.without_partial().partial == ()
    assert r.with_partial({0: "sum"}).partial == ((0, ReduceType.SUM),)
    assert r.with_dims_mapping([(0,), (), ()]).dims_mapping == ((0,), (), ())
    assert hash(a) == hash(DistAttr((2, 3, 2), ((0,), (1,)), ((2, "max"),)))


def test_dist_attr_errors():
    with pytest.raises(ValueError, match=r"Shard\(dim=2\).*ndim 2"):
        DistAttr.from_placements([Shard(2)], 2, (2,))
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        DistAttr.from_placements([Shard(0)], 2, (2, 2))
    with pytest.raises(ValueError, match="used twice"):
        DistAttr((2,), ((0,), (0,)))
    with pytest.raises(ValueError, match=r"tensor dim 0 give shard_order \[1, None\]"):
        DistAttr.from_placements([Shard(0, shard_order=1), Shard(0)], 1, (2, 2))
    with pytest.raises(ValueError, match=r"shard_order \[0, 0\].*distinct order 0..1"):
        DistAttr.from_placements([Shard(0, shard_order=0), Shard(0, shard_order=0)], 1, (2, 2))
    with pytest.raises(ValueError, match="shard_order.*int >= 0"):
        Shard(0, shard_order=-1)
    with pytest.raises(ValueError, match="out of range"):
        DistAttr((2,), ((1,),))


def test_split_range_matches_array_split():
    for size in range(8):
        for parts in range(1, 5):
            pieces = np.array_split(np.arange(size), parts)
            for i in range(parts):
                a, b = split_range(size, parts, i)
                assert list(range(a, b)) == list(pieces[i])


def test_local_shape_uneven_and_nested():
    a = DistAttr.from_placements([Shard(0), Shard(0)], 1, (2, 2))
    # 7 -> [4, 3] -> [[2, 2], [2, 1]]
    assert [local_shape((7,), a, c) for c in coords((2, 2))] == [(2,), (2,), (2,), (1,)]
    assert [local_offset((7,), a, c) for c in coords((2, 2))] == [(0,), (2,), (4,), (6,)]
    empty = DistAttr.from_placements([Shard(0)], 2, (3,))
    assert local_slices((2, 5), empty, (2,)) == (slice(2, 2), slice(0, 5))
    p = DistAttr.from_placements([Partial()], 2, (4,))
    assert local_shape((3, 5), p, (3,)) == (3, 5)


@st.composite
def layouts(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    placements = [draw(st.sampled_from(choices)) for _ in mesh]
    return shape, mesh, DistAttr.from_placements(placements, ndim, mesh)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_local_pieces_tile_global_array(case):
    """Every element is owned exactly once per group of coordinates that differ only in the
    replicated mesh dims, and each piece is the nested numpy.array_split piece."""
    shape, mesh, attr = case
    count = np.zeros(shape, dtype=int)
    for c in coords(mesh):
        sl = local_slices(shape, attr, c)
        assert local_offset(shape, attr, c) == tuple(s.start for s in sl)
        assert local_shape(shape, attr, c) == tuple(s.stop - s.start for s in sl)
        for d, (size, dm) in enumerate(zip(shape, attr.dims_mapping)):
            idx = np.arange(size)
            for m in dm:
                idx = np.array_split(idx, mesh[m])[c[m]]
            assert list(range(sl[d].start, sl[d].stop)) == list(idx)
        count[sl] += 1
    replicas = int(np.prod([n for m, n in enumerate(mesh) if m not in attr.sharded_mesh_dims()]))
    assert (count == replicas).all()
