"""dtensor_from_fn (pieces only, random pieces equal the dense call's slices), local_map and
LocalLayer (values and gradients through per-rank code)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from disttensor.parallel.creation import _PieceGenerator
from spmd_rules import DistAttr, local_slices


def world():
    return collectives.init()


def meshes():
    n = world().size
    out = [dt.ProcessMesh(list(range(n)), dim_names=["x"])]
    if n == 4:
        out.append(dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]))
    if n >= 3:
        out.append(dt.ProcessMesh([0, 1, 2], dim_names=["x"]))  # rank 3 outside when n == 4
    return out


def layouts(ndim, mesh_ndim):
    opts = [Replicate()] + [Shard(d) for d in range(ndim)]
    return [list(p) for p in itertools.product(opts, repeat=mesh_ndim)]


def my_piece(g, mesh, pl):
    coord = mesh.get_coord(world().rank)
    if coord is None:
        return None
    return g[local_slices(g.shape, DistAttr.from_placements(pl, g.ndim, mesh.shape), coord)]


# -- the piece generator on its own (every region of a few shapes; one process) --------------

@pytest.mark.parametrize("method,args", [("random", ()), ("uniform", (-2.0, 3.0)),
                                         ("standard_normal", ()), ("normal", (1.0, 0.5))])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 6), (11,), ()])
def test_piece_draws_equal_the_dense_slice_and_leave_the_generator_in_step(method, args, shape):
    dense_rng = np.random.default_rng(5)
    dense = getattr(dense_rng, method)(*args, size=shape)
    after = dense_rng.random(4)
    boxes = [[(0, n), (1, max(1, n - 1)), (n // 2, n), (0, 0)] for n in shape]
    for box in itertools.product(*boxes):
        region = tuple(slice(a, b) for a, b in box)
        rng = np.random.default_rng(5)
        piece = getattr(_PieceGenerator(rng, shape, region), method)(
            *args, size=tuple(b - a for a, b in box))
        np.testing.assert_array_equal(piece, dense[region], err_msg=f"{method} {region}")
        np.testing.assert_array_equal(rng.random(4), after, err_msg=f"state after {region}")


def test_many_runs_and_small_chunks_take_the_replay_path(monkeypatch):
    import disttensor.parallel.creation as creation

    monkeypatch.setattr(creation, "_MAX_RUNS", 2)
    monkeypatch.setattr(creation, "_CHUNK", 7)
    dense_rng = np.random.default_rng(9)
    dense, after = dense_rng.random((9, 8)), dense_rng.random(2)
    rng = np.random.default_rng(9)
    piece = _PieceGenerator(rng, (9, 8), (slice(2, 7), slice(3, 5))).random((5, 2))
    np.testing.assert_array_equal(piece, dense[2:7, 3:5])
    np.testing.assert_array_equal(rng.random(2), after)


# -- dtensor_from_fn ---------------------------------------------------------------------------

FNS = {
    "ones": (dt.ones, (), lambda shape: np.ones(shape, np.float32)),
    "full": (dt.full, (2.5,), lambda shape: np.full(shape, 2.5, np.float32)),
    "rand": (dt.rand, (), lambda shape: dt.rand(shape).numpy()),
    "randn": (dt.randn, (), lambda shape: dt.randn(shape).numpy()),
    "uniform": (dt.uniform, ("float64", -1.0, 4.0),
                lambda shape: dt.uniform(shape, "float64", -1.0, 4.0).numpy()),
    "scaled randn": (lambda s: dt.randn(s) * 0.02 + 1.0, (),
                     lambda shape: dt.randn(shape).numpy() * np.float32(0.02) + 1),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(FNS))
@pytest.mark.parametrize("shape", [(7, 5), (2, 9)])
def test_dtensor_from_fn_builds_each_piece_equal_to_the_dense_call(name, shape):
    fn, extra, dense_fn = FNS[name]
    for mesh in meshes():
        for pl in layouts(len(shape), mesh.ndim):
            dt.seed(11)
            want = dense_fn(list(shape))
            want_next = dt.rand([3]).numpy()
            seen = []

            def spy(s, *a, **k):
                seen.append(list(s))
                return fn(s, *a, **k)

            dt.seed(11)
            x = dt.dtensor_from_fn(spy, mesh, pl, list(shape), *extra)
            label = f"{name} {shape} on {mesh.shape} as {pl}"
            assert x.shape == list(shape) and x.placements == pl, label
            np.testing.assert_array_equal(dt.rand([3]).numpy(), want_next,
                                          err_msg=f"{label}: generator out of step")
            mine = my_piece(want, mesh, pl)
            if mine is None:
                assert seen == [[0] * len(shape)], "outside the mesh: an empty piece"
                continue
            assert seen == [list(mine.shape)], f"{label}: fn must get the piece's shape"
            np.testing.assert_allclose(x.to_local().numpy(), mine, rtol=1e-6, err_msg=label)
            np.testing.assert_allclose(x.numpy(), want, rtol=1e-6, err_msg=label)


@pytest.mark.mpi
def test_dtensor_from_fn_bad_input():
    mesh = meshes()[0]
    with pytest.raises(ValueError, match="contain Partial"):
        dt.dtensor_from_fn(dt.ones, mesh, [Partial()], [4])
    with pytest.raises(ValueError, match="Shard dim 2 out of range"):
        dt.dtensor_from_fn(dt.ones, mesh, [Shard(2)], [4, 4])
    with pytest.raises(ValueError, match="only draws of the whole piece"):
        dt.dtensor_from_fn(lambda s: dt.randn([1]) + dt.zeros(s), mesh, [Shard(0)], [8, 2])
    with pytest.raises(TypeError, match="pass the global shape"):
        dt.dtensor_from_fn(dt.ones, mesh, [Shard(0)])


# -- local_map and LocalLayer -----------------------------------------------------------------

X = np.random.default_rng(3).standard_normal((7, 4))


@pytest.mark.mpi
def test_local_map_runs_on_pieces_and_gradients_reach_the_inputs():
    for mesh in meshes():
        pl = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        x = dt.shard_tensor(X, mesh, pl, stop_gradient=False)
        shapes = []

        def local_sq_sum(a):
            shapes.append(a.shape)
            return (a * a).sum(), a * 2.0

        # the row sums are addends along mesh dim 0 and copies along the others
        total_pl = [Partial()] + [Replicate()] * (mesh.ndim - 1)
        f = dt.local_map(local_sq_sum, out_placements=[total_pl, pl])
        total, doubled = f(x)
        if mesh.get_coord(world().rank) is None:
            continue
        assert shapes == [x.to_local().shape]
        np.testing.assert_allclose(total.numpy(), (X * X).sum(), rtol=1e-12)
        np.testing.assert_allclose(doubled.numpy(), 2 * X, rtol=1e-12)
        (total + doubled.sum()).backward()
        np.testing.assert_allclose(x.grad.numpy(), 2 * X + 2, rtol=1e-12)
        assert x.grad.placements == pl


@pytest.mark.mpi
def test_local_map_in_placements_are_checked_or_resharded():
    mesh = meshes()[0]
    x = dt.shard_tensor(X, mesh, [Shard(1)])
    f = dt.local_map(lambda a: a.sum(axis=0), out_placements=[[Shard(0)]],
                     in_placements=[[Shard(1)]])
    np.testing.assert_allclose(f(x).numpy(), X.sum(axis=0), rtol=1e-12)
    g = dt.local_map(lambda a: a.sum(axis=0), out_placements=[[Shard(0)]],
                     in_placements=[[Shard(1)]])
    y = dt.shard_tensor(X, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="in_placements\\[0\\] asks for"):
        g(y)
    h = dt.local_map(lambda a: a.sum(axis=0), out_placements=[[Shard(0)]],
                     in_placements=[[Shard(1)]], reshard_inputs=True)
    np.testing.assert_allclose(h(y).numpy(), X.sum(axis=0), rtol=1e-12)
    with pytest.raises(ValueError, match="returned 1 output"):
        dt.local_map(lambda a: a, out_placements=[[Shard(0)], None])(x)


def test_local_map_without_distributed_inputs_is_the_plain_function():
    f = dt.local_map(lambda a: a * 3.0, out_placements=[[Shard(0)]])
    np.testing.assert_allclose(f(dt.to_tensor(X)).numpy(), 3 * X)


@pytest.mark.mpi
def test_local_layer_forward_on_pieces_with_declared_outputs():
    mesh = meshes()[0]

    class MaskedMean(dt.LocalLayer):
        def __init__(self):
            super().__init__([(mesh, [Partial()]), None])

        def forward(self, a):
            return (a * (a > 0).astype(a.dtype)).sum(), a.shape[0]

    x = dt.shard_tensor(X, mesh, [Shard(0)], stop_gradient=False)
    total, rows = MaskedMean()(x)
    assert rows == x.to_local().shape[0]
    np.testing.assert_allclose(total.numpy(), X[X > 0].sum(), rtol=1e-12)
    total.backward()
    np.testing.assert_allclose(x.grad.numpy(), (X > 0).astype(float), rtol=1e-12)
