import numpy as np
import pytest
from rules_util import coords, meta, run, simulate

from spmd_rules import DistAttr, Partial, Replicate, Shard, local_offset, local_slices

S, R, P = Shard, Replicate, Partial


# ------------------------------------------------------------------ layer_norm

def test_layer_norm():
    x = meta((4, 6, 8), [S(0), S(2)], (2, 2))
    w, b = meta((8,), [R(), S(0)], (2, 2)), meta((8,), [R(), R()], (2, 2))
    r = run("layer_norm", x, w, b, begin_norm_axis=2)
    # mesh 1 leaves the normalized axis for dim 0 (co-shard, one all-to-all, not an all-gather)
    assert r.inputs[0].dims_mapping == ((0, 1), (), ())
    assert r.inputs[1] == DistAttr.replicated(1, (2, 2)) == r.inputs[2]
    out, mean, rstd = r.outputs
    assert out.shape == (4, 6, 8) and out.dist_attr == r.inputs[0]
    assert mean.shape == rstd.shape == (4, 6) and mean.dist_attr.dims_mapping == ((0, 1), ())
    r = run("layer_norm", meta((4, 6, 8), [S(1)]), None, None, begin_norm_axis=1)
    assert r.inputs == (DistAttr((2,), ((0,), (), ())), None, None)  # S(1) -> S(0): all-to-all
    # flattened weight accepted
    run("layer_norm", x, meta((48,), [R(), R()], (2, 2)), None, begin_norm_axis=1)
    with pytest.raises(ValueError, match=r"layer_norm.*weight.*\(7,\)"):
        run("layer_norm", x, meta((7,), [R(), R()], (2, 2)), None, begin_norm_axis=2)
    with pytest.raises(ValueError, match="layer_norm.*begin_norm_axis"):
        run("layer_norm", x, None, None, begin_norm_axis=4)


def test_layer_norm_grad():
    x = meta((4, 6, 8), [S(1), S(2)], (2, 2))
    mean = meta((4, 6), [S(0), R()], (2, 2))
    dout = meta((4, 6, 8), [R(), R()], (2, 2))
    w = meta((8,), [R(), R()], (2, 2))
    r = run("layer_norm_grad", x, w, mean, mean, dout, begin_norm_axis=2)
    # cheapest: dim 1 co-sharded by both mesh dims (x and mean by all-to-alls, dout sliced)
    assert r.inputs[0].dims_mapping == ((), (0, 1), ()) == r.inputs[4].dims_mapping
    assert r.inputs[2].dims_mapping == ((), (0, 1))
    dx, dw, db = r.outputs
    assert dx.dist_attr == r.inputs[0]
    assert dw.shape == (8,) and dw.dist_attr.partial == ((0, "sum"), (1, "sum"))
    assert dw.dist_attr.dims_mapping == ((),)
    r = run("layer_norm_grad", x, None, mean, mean, dout, begin_norm_axis=2)
    assert r.inputs[1] is None and r.outputs[1].shape == (8,)
    with pytest.raises(ValueError, match="layer_norm_grad.*mean"):
        run("layer_norm_grad", x, w, meta((4,), [R(), R()], (2, 2)), mean, dout, begin_norm_axis=2)


# ------------------------------------------------------------------ batch_norm

def test_batch_norm_batch_sharded_channel_sharded_stats():
    x = meta((8, 4, 5, 5), [S(0)])
    stats = meta((4,), [S(0)])
    r = run("batch_norm", x, stats, stats, None, None, training=True)
    # mesh 0 is taken by x's batch axis: the statistics are gathered
    assert r.inputs[0].dims_mapping == ((0,), (), (), ())
    assert r.inputs[1] == DistAttr.replicated(1, (2,)) and r.inputs[3] is None
    assert len(r.outputs) == 5 and all(not o.dist_attr.is_partial() for o in r.outputs)
    assert r.outputs[1].shape == (4,)


def test_batch_norm_channel_merge():
    x = meta((8, 4, 5), [R(), S(2)], (2, 2))
    stats = meta((4,), [S(0), R()], (2, 2))
    r = run("batch_norm", x, stats, stats, stats, stats, training=False, data_format="NCL")
    assert r.inputs[0].dims_mapping == ((), (0,), (1,))
    assert all(a.dims_mapping == ((0,),) for a in r.inputs[1:])
    assert r.outputs[0].dist_attr == r.inputs[0] and r.outputs[3].dist_attr.dims_mapping == ((0,),)
    # channels last
    r = run("batch_norm", meta((8, 5, 4), [S(2)]), stats.__class__((4,),
                                                                   DistAttr.replicated(1, (2,))),
            meta((4,), [R()]), None, None, data_format="NLC")
    assert r.inputs[0].dims_mapping == ((), (), (0,))
    assert r.outputs[1].dist_attr.dims_mapping == ((0,),)


def test_batch_norm_errors():
    with pytest.raises(ValueError, match=r"batch_norm.*running_var.*\(3,\)"):
        run("batch_norm", meta((8, 4), [R()]), meta((4,), [R()]), meta((3,), [R()]), None, None)
    with pytest.raises(ValueError, match="batch_norm.*data_format"):
        run("batch_norm", meta((8, 4), [R()]), meta((4,), [R()]), meta((4,), [R()]), None, None,
            data_format="XYZ")
    with pytest.raises(ValueError, match="batch_norm.*at least 2"):
        run("batch_norm", meta((8,), [R()]), meta((8,), [R()]), meta((8,), [R()]), None, None)


def test_batch_norm_grad():
    x = meta((8, 4, 5, 5), [S(0), S(1)], (2, 2))
    c = meta((4,), [R(), R()], (2, 2))
    r = run("batch_norm_grad", x, c, c, c, meta((8, 4, 5, 5), [P(), R()], (2, 2)))
    assert r.inputs[4] == r.inputs[0] and not r.inputs[4].is_partial()
    dx, dw, db = r.outputs
    assert dw.dist_attr.dims_mapping == ((1,),) and not dw.dist_attr.is_partial()
    with pytest.raises(ValueError, match="batch_norm_grad.*dout"):
        run("batch_norm_grad", x, c, c, c, meta((8, 4, 5, 4), [R(), R()], (2, 2)))


# ------------------------------------------------------------------ embedding

def test_embedding_vocab_sharded_gives_partial():
    r = run("embedding", meta((4, 5), [R()]), meta((10, 8), [S(0)]), padding_idx=None)
    out = r.outputs[0]
    assert out.shape == (4, 5, 8) and out.dist_attr.to_placements() == [P()]
    r = run("embedding", meta((4, 5), [S(0), R()], (2, 2)), meta((10, 8), [S(1), S(0)], (2, 2)))
    # the weight (80 elements) keeps its layout; the ids (20) are gathered on mesh 0 instead
    # of the weight's D: fewer bytes; V on mesh 1 -> Partial
    assert r.inputs[0].dims_mapping == ((), ()) and r.inputs[1].dims_mapping == ((1,), (0,))
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((), (), (0,)), ((1, "sum"),))
    r = run("embedding", meta((4, 5), [R(), S(0)], (2, 2)), meta((10, 8), [S(1), S(0)], (2, 2)))
    assert r.inputs[1].dims_mapping == ((1,), (0,))
    # a large batch of ids against a small table: the table moves instead
    r = run("embedding", meta((64, 50), [R(), S(0)], (2, 2)), meta((10, 8), [S(1), S(0)], (2, 2)))
    assert r.inputs[0].dims_mapping == ((1,), ()) and r.inputs[1].dims_mapping == ((), (0,))
    r = run("embedding", meta((4,), [S(0)]), meta((10, 8), [S(0)]))
    assert r.inputs[0].dims_mapping == ((),) and r.outputs[0].dist_attr.is_partial()
    r = run("embedding", meta((400,), [S(0)]), meta((10, 8), [S(0)]))
    assert r.inputs[1].dims_mapping == ((), ()) and not r.outputs[0].dist_attr.is_partial()
    with pytest.raises(ValueError, match="embedding.*weight"):
        run("embedding", meta((4,), [R()]), meta((10,), [R()]))


@pytest.mark.parametrize("w_pl,ids_pl", [([S(0)], [R()]), ([S(1)], [S(0)]), ([S(0)], [S(1)])])
def test_embedding_masked_lookup_simulation(w_pl, ids_pl):
    ids_meta, w_meta = meta((3, 5), ids_pl, (3,)), meta((7, 4), w_pl, (3,))
    r = run("embedding", ids_meta, w_meta)
    rng = np.random.default_rng(0)
    ids, w = rng.integers(0, 7, size=(3, 5)), rng.standard_normal((7, 4))

    def lookup(i, wl, coord):
        start = local_offset((7, 4), r.inputs[1], coord)[0]
        rel = i.astype(int) - start
        hit = (rel >= 0) & (rel < wl.shape[0])
        out = np.zeros(i.shape + (wl.shape[1],))
        out[hit] = wl[rel[hit]]
        return out
    simulate(r, [ids.astype(float), w], lookup, w[ids])


def test_embedding_grad():
    r = run("embedding_grad", meta((4, 5), [S(0), R()], (2, 2)), meta((4, 5, 8), [R(), S(2)],
                                                                      (2, 2)),
            num_embeddings=10)
    assert r.inputs[1].dims_mapping == ((0,), (), (1,))
    assert r.outputs[0].shape == (10, 8)
    assert r.outputs[0].dist_attr == DistAttr((2, 2), ((), (1,)), ((0, "sum"),))
    with pytest.raises(ValueError, match="embedding_grad.*dout"):
        run("embedding_grad", meta((4, 5), [R()]), meta((4, 8), [R()]), num_embeddings=10)


# ------------------------------------------------------------------ cross entropy

def test_cross_entropy_parallel_class_axis():
    logits = meta((8, 10), [S(0), S(1)], (2, 2))
    label = meta((8, 1), [R(), S(0)], (2, 2))
    r = run("cross_entropy", logits, label, axis=1, ignore_index=-100)
    assert r.inputs[0] == logits.dist_attr
    assert r.inputs[1].dims_mapping == ((0,), ())
    sm, loss = r.outputs
    assert sm.dist_attr == logits.dist_attr and loss.shape == (8, 1)
    assert loss.dist_attr == DistAttr((2, 2), ((0,), ())) and not loss.dist_attr.is_partial()
    r = run("cross_entropy", meta((8, 10), [R()]), meta((8,), [S(0)]), axis=1)
    assert r.inputs[0].dims_mapping == ((0,), ())
    assert r.outputs[1].dist_attr.dims_mapping == ((0,), ())
    r = run("cross_entropy", meta((8, 10), [P()]), meta((8,), [R()]))
    assert not r.inputs[0].is_partial()
    with pytest.raises(ValueError, match=r"cross_entropy.*label.*\(7,\)"):
        run("cross_entropy", meta((8, 10), [R()]), meta((7,), [R()]))


def test_cross_entropy_grad():
    sm = meta((2, 8, 10), [R(), S(2)], (2, 2))
    label = meta((2, 8, 1), [S(1), R()], (2, 2))
    dloss = meta((2, 8, 1), [R(), R()], (2, 2))
    r = run("cross_entropy_grad", sm, label, dloss, axis=2)
    assert r.inputs[0].dims_mapping == ((), (0,), (1,)) and r.outputs[0].dist_attr == r.inputs[0]
    assert r.inputs[2].dims_mapping == ((), (0,), ())
    with pytest.raises(ValueError, match="cross_entropy_grad.*dloss"):
        run("cross_entropy_grad", sm, label, meta((2, 8), [R(), R()], (2, 2)), axis=2)


def test_parallel_cross_entropy_simulation():
    """softmax and loss from the class-sharded pieces with the all-reduces the runtime does."""
    logits_m, label_m = meta((5, 7), [S(1)], (3,)), meta((5,), [R()], (3,))
    r = run("cross_entropy", logits_m, label_m)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 7))
    la = r.inputs[0]
    pieces = {c: logits[local_slices((5, 7), la, c)] for c in coords((3,))}
    gmax = np.max([p.max(axis=1, initial=-np.inf) for p in pieces.values()], axis=0)
    sumexp = sum(np.exp(p - gmax[:, None]).sum(axis=1) for p in pieces.values())
    for c, p in pieces.items():
        sm = np.exp(p - gmax[:, None]) / sumexp[:, None]
        dense = np.exp(logits - logits.max(1, keepdims=True))
        dense /= dense.sum(1, keepdims=True)
        np.testing.assert_allclose(sm, dense[local_slices((5, 7), r.outputs[0].dist_attr, c)])
    assert r.outputs[1].dist_attr.is_replicated()


def test_layer_norm_moves_mesh_dim_with_an_all_to_all_not_an_all_gather():
    """The guide's example: x [64, 32, 128, 128] as [S(0), S(1)] on 2x2, normalized from dim 1:
    mesh dim 1 moves onto dim 0 (one all-to-all) and x stays 4-way sharded; the first-wins
    answer (all-gather mesh dim 1) moves more bytes."""
    from spmd_rules import plan_same_mesh, reshard_cost
    shape = (64, 32, 128, 128)
    x = meta(shape, [S(0), S(1)], (2, 2))
    r = run("layer_norm", x, None, None, begin_norm_axis=1)
    want = r.inputs[0]
    assert want.dims_mapping == ((0, 1), (), (), ())
    steps = plan_same_mesh(shape, 4, x.dist_attr, want)
    assert [s.kind for s in steps] == ["all_to_all"]
    gathered = DistAttr((2, 2), ((0,), (), (), ()))
    assert [s.kind for s in plan_same_mesh(shape, 4, x.dist_attr, gathered)] == ["all_gather"]
    assert reshard_cost(shape, 4, x.dist_attr, want) < reshard_cost(shape, 4, x.dist_attr, gathered)
    assert r.outputs[0].dist_attr == want and r.outputs[1].dist_attr.dims_mapping == ((0, 1),)
