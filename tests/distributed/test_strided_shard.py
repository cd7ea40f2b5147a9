"""The strided shard ``Shard(dim, split_factor=k)``: the placement, its index maps (against a
numpy-only definition), reshard to and from every placement on 1-d and 2-d meshes (uneven
too), split/chunk and flatten without communication, and ops that cannot use it (they see a
plain shard and reshard first): values and gradients against numpy at 1-4 ranks."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from spmd_rules import DistAttr, local_ranges, local_shape, local_slices, locate

S, R, P = Shard, Replicate, Partial


# -- numpy-only definition of a piece ----------------------------------------------------------

def ref_indices(size: int, attr: DistAttr, dim: int, coord) -> np.ndarray:
    """Global indices of tensor dim ``dim`` held at ``coord``: for each mesh dim in split order,
    the current index list is cut into k sections (array_split) and each section into n pieces
    (array_split); the coordinate takes its piece of every section."""
    idx = np.arange(size)
    for m in attr.dims_mapping[dim]:
        k, n = attr.factor_of(m), attr.mesh_shape[m]
        idx = np.concatenate([np.array_split(sec, n)[coord[m]]
                              for sec in np.array_split(idx, k)] or [idx[:0]])
    return idx


def ref_piece(G: np.ndarray, attr: DistAttr, coord) -> np.ndarray:
    return G[np.ix_(*[ref_indices(n, attr, d, coord) for d, n in enumerate(G.shape)])]


def holds(x: dt.Tensor, G: np.ndarray) -> None:
    """This rank's piece of ``x`` is the numpy-defined piece of ``G``."""
    mesh = x.process_mesh
    attr = DistAttr.from_placements(x.placements, G.ndim, mesh.shape)
    coord = mesh.get_coord(dt.get_rank())
    np.testing.assert_allclose(x._local_array(), ref_piece(G, attr, coord), rtol=1e-12)


def moved(before: dict) -> dict:
    after = collectives.collective_counts()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def data(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


# -- the placement and its index maps (one process) ---------------------------------------------

def test_placement_equality_hash_repr():
    assert S(1, split_factor=3) == S(1, split_factor=3) != S(1)
    assert S(0, split_factor=1) == S(0) and hash(S(0, split_factor=1)) == hash(S(0))
    assert len({S(0, split_factor=2), S(0, split_factor=2), S(0)}) == 2
    assert repr(S(1, split_factor=3)) == "Shard(dim=1, split_factor=3)"
    assert repr(S(0, shard_order=1, split_factor=2)) == \
        "Shard(dim=0, shard_order=1, split_factor=2)"
    assert S(1, split_factor=3).is_shard() and S(1, split_factor=3).is_shard(1)
    assert not S(1, split_factor=3).is_shard(0) and S(1, split_factor=3).is_strided()
    assert dt.Shard is S and S(2, split_factor=2).get_dim() == 2
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="split_factor"):
            S(0, split_factor=bad)


def test_dist_attr_round_trip():
    pl = [S(0, split_factor=3), S(1)]
    a = DistAttr.from_placements(pl, 2, (2, 2))
    assert a.split_factors == ((0, 3),) and a.to_placements() == pl
    assert a.without_split_factors().to_placements() == [S(0), S(1)]
    b = DistAttr.from_placements([S(0, split_factor=3), R()], 2, (2, 2))
    assert b.with_partial({1: "sum"}).to_placements() == [S(0, split_factor=3), P()]
    co = [S(0, shard_order=1, split_factor=2), S(0, shard_order=0)]
    assert DistAttr.from_placements(co, 1, (2, 2)).to_placements() == co
    with pytest.raises(ValueError, match="split_factors"):
        DistAttr((2,), ((),), (), ((0, 2),))


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (4,), (2, 2), (3, 2)])
def test_local_pieces_and_index_maps_match_numpy(mesh_shape):
    """local_ranges / local_shape / locate against the numpy definition, sizes 0..13 (uneven
    sections and pieces, empty ones too), every factor 1..4 on every mesh dim."""
    for size, *ks in itertools.product(range(14), *[range(1, 5)] * len(mesh_shape)):
        for dm in itertools.permutations(range(len(mesh_shape))):
            attr = DistAttr(mesh_shape, (dm,), (), tuple(zip(range(len(mesh_shape)), ks)))
            owners = np.zeros(size, int)
            for coord in itertools.product(*map(range, mesh_shape)):
                want = ref_indices(size, attr, 0, coord)
                (ranges,) = local_ranges((size,), attr, coord)
                got = np.concatenate([np.arange(a, b) for a, b in ranges] or [np.zeros(0, int)])
                np.testing.assert_array_equal(got, want)
                assert local_shape((size,), attr, coord) == (len(want),)
                for pos, g in enumerate(want):
                    where, local = locate((size,), attr, 0, int(g))
                    assert local == pos and all(where[m] == coord[m] for m in dm)
                owners[want] += 1
            assert (owners == 1).all()  # the pieces partition the dim


def test_local_slices_refuses_a_split_piece():
    attr = DistAttr.from_placements([S(0, split_factor=2)], 1, (2,))
    with pytest.raises(ValueError, match="strided"):
        local_slices((8,), attr, (0,))
    # one non-empty section piece is still a slice
    assert local_slices((1,), attr, (0,)) == (slice(0, 1),)


def test_reshard_plans_say_what_they_do():
    """Strided -> Replicate is one all-gather and a local reorder; to strided a local cut;
    Partial -> strided all-reduces first (a composition through Replicate)."""
    from spmd_rules import plan_same_mesh
    st = DistAttr.from_placements([S(0, split_factor=3)], 2, (4,))
    rep = DistAttr.replicated(2, (4,))
    part = DistAttr.from_placements([P()], 2, (4,))
    s1 = DistAttr.from_placements([S(1)], 2, (4,))
    assert [(s.kind, s.split_factor) for s in plan_same_mesh((9, 5), 8, st, rep)] == \
        [("all_gather", 3)]
    assert [(s.kind, s.split_factor) for s in plan_same_mesh((9, 5), 8, rep, st)] == \
        [("slice", 3)]
    assert [s.kind for s in plan_same_mesh((9, 5), 8, part, st)] == ["all_reduce", "slice"]
    assert [s.kind for s in plan_same_mesh((9, 5), 8, st, s1)] == ["all_gather", "slice"]
    assert "split factor 3" in plan_same_mesh((9, 5), 8, st, rep)[0].describe()


# -- reshard on meshes (MPI) --------------------------------------------------------------------

def _meshes():
    n = dt.get_world_size()
    out = [dt.ProcessMesh(list(range(n)), dim_names=["x"])]
    if n == 4:
        out.append(dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]))
    elif n == 2:
        out.append(dt.ProcessMesh([[0, 1]], dim_names=["x", "y"]))
    return out


def _layouts(mesh_ndim: int) -> list[list]:
    one = [R(), P(), S(0), S(1), S(1, split_factor=2), S(1, split_factor=3),
           S(0, split_factor=2)]
    if mesh_ndim == 1:
        return [[p] for p in one]
    return [[R(), R()], [S(1, split_factor=3), R()], [S(1, split_factor=2), S(1)],
            [S(1), S(1, split_factor=2)], [S(0), S(1, split_factor=3)],
            [P(), S(1, split_factor=2)], [S(1, split_factor=3), P()],
            [S(1, shard_order=1, split_factor=2), S(1, shard_order=0)], [S(0), S(1)]]


def _make(G: np.ndarray, mesh, placements) -> dt.Tensor:
    """G laid out as ``placements`` (a Partial mesh dim holds G on coordinate 0, zeros
    elsewhere), a leaf that needs grad."""
    return dt.shard_tensor(G, mesh, list(placements), stop_gradient=False)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(4, 12), (3, 7)], ids=["even", "uneven"])
def test_reshard_to_and_from_every_placement(shape):
    """Every pair of layouts (strided ones among them, Partial too): the target's pieces are
    numpy's, and the gradient of sum(y * W) arrives at the leaf in its own layout equal W."""
    G, W = data(shape, 1), data(shape, 2)
    for mesh in _meshes():
        layouts = _layouts(mesh.ndim)
        for src, dst in itertools.product(layouts, layouts):
            x = _make(G, mesh, src)
            y = dt.reshard(x, mesh, dst)
            assert y.placements == dst, (src, dst, y.placements)
            if all(not isinstance(p, Partial) for p in dst):
                holds(y, G)
            np.testing.assert_allclose(y.numpy(), G, rtol=1e-12, err_msg=f"{src} -> {dst}")
            (y * dt.to_tensor(W)).sum().backward()
            assert x.grad.placements == src
            np.testing.assert_allclose(x.grad.numpy(), W, rtol=1e-12,
                                       err_msg=f"grad {src} -> {dst}")


@pytest.mark.mpi
def test_reshard_to_strided_on_another_mesh():
    """Across meshes: the strided target gets its pieces from the gathered source."""
    n = dt.get_world_size()
    G = data((2, 10), 3)
    src = dt.ProcessMesh(list(range(n)))
    dst = dt.ProcessMesh(list(reversed(range(n))))
    x = dt.shard_tensor(G, src, [S(1, split_factor=2)])
    y = dt.reshard(x, dst, [S(1, split_factor=5)])
    holds(y, G)
    np.testing.assert_allclose(y.numpy(), G)


# -- split / chunk / flatten: no communication ------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("seq", [12, 7], ids=["even", "uneven"])
def test_split_of_a_strided_dim_gives_plain_sections_without_communication(seq):
    mesh = _meshes()[0]
    G, Wq, Wk, Wv = data((2, 3 * seq, 5), 4), *(data((2, seq, 5), s) for s in (5, 6, 7))
    x = dt.shard_tensor(G, mesh, [S(1, split_factor=3)], stop_gradient=False)
    before = collectives.collective_counts()
    q, k, v = dt.split(x, 3, axis=1)
    c1, c2, c3 = x.chunk(3, axis=1)
    assert moved(before) == {}
    for t, part in zip((q, k, v), np.split(G, 3, axis=1)):
        assert t.placements == [S(1)]
        holds(t, part)
    for t in (c1, c2, c3):
        assert t.placements == [S(1)]
    loss = (q * dt.to_tensor(Wq)).sum() + (k * dt.to_tensor(Wk)).sum() + \
        (v * dt.to_tensor(Wv)).sum()
    before = collectives.collective_counts()
    loss.backward()
    grads = moved(before)
    assert "all_gather" not in grads and "all_to_all" not in grads, grads
    assert x.grad.placements == [S(1, split_factor=3)]
    want = np.concatenate([Wq, Wk, Wv], axis=1)
    holds(x.grad, want)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-12)


@pytest.mark.mpi
def test_split_into_other_sections_reshards_first():
    """Sections that are not the k strided sections: the plain rule (values still right)."""
    mesh = _meshes()[0]
    G = data((12, 3), 8)
    x = dt.shard_tensor(G, mesh, [S(0, split_factor=3)], stop_gradient=False)
    a, b = dt.split(x, [5, 7], axis=0)
    np.testing.assert_allclose(a.numpy(), G[:5])
    np.testing.assert_allclose(b.numpy(), G[5:])
    (a.sum() + 2 * b.sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), np.r_[np.ones((5, 3)), 2 * np.ones((7, 3))])


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(3, 8, 4), (2, 5, 3)], ids=["even", "uneven"])
def test_flatten_of_a_sequence_shard_is_strided_without_communication(shape):
    """[b, s, h] as S(1) -> [b*s, h]: Shard(0, split_factor=b), no collective; reshaped back
    it is S(1) again; values and gradients against numpy."""
    mesh = _meshes()[0]
    b, s, h = shape
    G, W = data(shape, 9), data((b * s, h), 10)
    x = dt.shard_tensor(G, mesh, [S(1)], stop_gradient=False)
    before = collectives.collective_counts()
    f = x.flatten(0, 1)
    back = f.reshape([b, s, h])
    assert moved(before) == {}
    assert f.placements == [S(0, split_factor=b)] and back.placements == [S(1)]
    holds(f, G.reshape(b * s, h))
    holds(back, G)
    loss = (dt.tanh(f) * dt.to_tensor(W)).sum()
    np.testing.assert_allclose(loss.numpy(), (np.tanh(G.reshape(b * s, h)) * W).sum())
    loss.backward()
    want = (W * (1 - np.tanh(G.reshape(b * s, h)) ** 2)).reshape(shape)
    assert x.grad.placements == [S(1)]
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-12)


@pytest.mark.mpi
def test_concat_of_plain_sections_is_strided():
    """concat of k pieces sharded along the axis (split's backward): strided, no collective."""
    mesh = _meshes()[0]
    parts = [data((2, 6), s) for s in (11, 12, 13)]
    ts = [dt.shard_tensor(p, mesh, [S(1)]) for p in parts]
    before = collectives.collective_counts()
    y = dt.concat(ts, axis=1)
    assert moved(before) == {} and y.placements == [S(1, split_factor=3)]
    holds(y, np.concatenate(parts, axis=1))


# -- ops that cannot use it see a plain shard ---------------------------------------------------

_OPS = {
    "matmul": (lambda x, y: dt.matmul(x, y), lambda x, y: x @ y, [(6, 9), (9, 4)]),
    "softmax": (lambda x: dt.nn.functional.softmax(x, axis=0), None, [(7, 3)]),
    "sum": (lambda x: x.sum(axis=0), lambda x: x.sum(axis=0), [(9, 4)]),
    "argmax": (lambda x: dt.argmax(x, axis=0), lambda x: np.argmax(x, axis=0), [(9, 4)]),
    "cumsum": (lambda x: dt.cumsum(x, axis=0), lambda x: np.cumsum(x, axis=0), [(9, 4)]),
    "add": (lambda x, y: x + y, lambda x, y: x + y, [(6, 4), (6, 4)]),
    "embedding": (lambda ids, w: dt.nn.functional.embedding(ids, w), lambda ids, w: w[ids],
                  [(5,), (9, 3)]),
}


def _softmax0(x):
    e = np.exp(x - x.max(axis=0))
    return e / e.sum(axis=0)


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(_OPS))
def test_ops_on_strided_inputs_equal_numpy(name):
    """Every input strided on each of its dims (factors 2 and 3; the others Replicate): the
    op's value and the inputs' gradients equal numpy's."""
    fn, ref, shapes = _OPS[name]
    ref = ref or _softmax0
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 9, s) if name == "embedding" and i == 0
              else rng.standard_normal(s) for i, s in enumerate(shapes)]
    want = ref(*arrays)
    Wout = rng.standard_normal(np.shape(want))
    for mesh in _meshes():
        for i, a in enumerate(arrays):
            for d, k in itertools.product(range(a.ndim), (2, 3)):
                pl = [[R()] * mesh.ndim for _ in arrays]
                pl[i] = [S(d, split_factor=k)] + [R()] * (mesh.ndim - 1)
                diff = [j for j, b in enumerate(arrays) if b.dtype.kind == "f"]
                ts = [dt.shard_tensor(b, mesh, p, stop_gradient=j not in diff)
                      for j, (b, p) in enumerate(zip(arrays, pl))]
                out = fn(*ts)
                np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-12,
                                           err_msg=f"{name} with input {i} as {pl[i]}")
                if out.dtype in (dt.float32, dt.float64) and not out.stop_gradient:
                    (out * dt.to_tensor(Wout)).sum().backward()
                    for j in diff:
                        assert ts[j].grad.placements == pl[j]
                    _check_grads(name, arrays, Wout, [ts[j].grad.numpy() for j in diff])


def _check_grads(name, arrays, W, grads):
    """Gradients of sum(op(*arrays) * W) by hand in numpy."""
    if name == "matmul":
        x, y = arrays
        want = [W @ y.T, x.T @ W]
    elif name == "sum":
        want = [np.broadcast_to(W, arrays[0].shape)]
    elif name == "add":
        want = [W, W]
    elif name == "embedding":
        g = np.zeros(arrays[1].shape)
        np.add.at(g, arrays[0], W)
        want = [g]
    elif name == "softmax":
        s = _softmax0(arrays[0])
        want = [s * (W - (W * s).sum(axis=0))]
    else:  # cumsum: the reversed cumulative sum
        want = [np.cumsum(W[::-1], axis=0)[::-1]]
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{name} gradient")


@pytest.mark.mpi
@pytest.mark.parametrize("plan_memory", ["kernels", "all"])
def test_captured_step_with_strided_reshards(plan_memory):
    """A captured step whose op gathers a strided input (the all-gather then the local
    reorder) and whose reshard cuts another factor replays to numpy's values and gradients,
    with and without every temporary in the arena."""
    mesh = _meshes()[0]
    G, W = data((9, 4), 14), data((9, 4), 15)
    x = dt.shard_tensor(G, mesh, [S(0, split_factor=3)], stop_gradient=False)

    def step(x):
        z = dt.reshard(dt.cumsum(x, axis=0), mesh, [S(0, split_factor=2)])
        loss = (z * dt.to_tensor(W)).sum()
        loss.backward()
        return loss
    f = dt.jit.to_static(step, plan_memory=plan_memory)
    for _ in range(3):
        x.clear_gradient()
        loss = f(x)
        np.testing.assert_allclose(loss.numpy(), (np.cumsum(G, 0) * W).sum(), rtol=1e-12)
        assert x.grad.placements == [S(0, split_factor=3)]
        np.testing.assert_allclose(x.grad.numpy(), np.cumsum(W[::-1], 0)[::-1], rtol=1e-12)
