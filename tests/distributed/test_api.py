"""Public distributed API: cross-mesh reshard, gradients, bad input, visualize_sharding and plan
printing. Multi-rank tests adapt to the world size; ranks outside a mesh take part (empty
pieces)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor.distributed.api import reshard_to
from spmd_rules import DistAttr, Partial, ProcessMesh, Replicate, Shard, local_slices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def world():
    return collectives.init()


def need(n: int) -> None:
    if world().size < n:
        pytest.skip(f"needs {n} ranks")


def G_(shape, seed=0):
    rng = np.random.default_rng(seed + 17 * int(np.prod(shape)))
    return rng.integers(-9, 10, size=shape).astype(np.float64)


def local_ok(x: dt.Tensor, G: np.ndarray) -> None:
    v = x._value
    coord = v.mesh.get_coord(world().rank)
    arr = x._local_array()
    if coord is None:
        assert arr.size == 0, f"non-member holds {arr.shape}"
        return
    want = G[local_slices(G.shape, v.dist_attr, coord)]
    assert arr.shape == want.shape, (arr.shape, want.shape)
    np.testing.assert_array_equal(arr, want)


def delta(before):
    after = collectives.collective_counts()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def pieces_from_local(G, mesh, placements, red="sum"):
    """dtensor_from_local with addends (k = 0 holds the piece, others zero / copies)."""
    attr = DistAttr.from_placements(placements, G.ndim, mesh.shape)
    coord = mesh.get_coord(world().rank)
    if coord is None:
        return dt.dtensor_from_local(np.zeros((0,) * G.ndim), mesh, placements, shape=G.shape)
    piece = G[local_slices(G.shape, attr, coord)]
    first = all(coord[m] == 0 for m, _ in attr.partial) or red != "sum"
    return dt.dtensor_from_local(piece if first else np.zeros_like(piece), mesh, placements,
                                 shape=G.shape)


# ------------------------------------------------------------------------------ cross mesh
@pytest.mark.mpi
def test_cross_mesh_same_layout_is_point_to_point():
    need(4)
    a, b = ProcessMesh([0, 1]), ProcessMesh([2, 3])
    G = G_((7, 5))
    x = dt.shard_tensor(G, a, [Shard(0)])
    plan = dt.reshard_plan(x, b, [Shard(0)])
    assert [s.kind for s in plan.steps] == ["send_recv"] and plan.num_collectives == 0
    assert "point-to-point" in str(plan)
    before = collectives.collective_counts()
    y = dt.reshard(x, b, [Shard(0)])
    d = delta(before)
    assert not any(d.get(k) for k in ("all_gather", "all_reduce", "all_to_all",
                                      "reduce_scatter")), d
    assert d == ({"send": 1} if world().rank < 2 else {"recv": 1})
    local_ok(y, G)
    local_ok(x, G)  # source unchanged
    if world().rank >= 2:
        np.testing.assert_array_equal(y.numpy(), G)


@pytest.mark.mpi
@pytest.mark.parametrize("src_pl,dst_pl", [
    ([Shard(0)], [Shard(1)]), ([Shard(1)], [Replicate()]), ([Partial()], [Shard(0)]),
    ([Replicate()], [Shard(1)]), ([Partial()], [Partial()]), ([Partial("max")], [Replicate()]),
], ids=str)
def test_cross_mesh_disjoint_other_layout(src_pl, dst_pl):
    need(4)
    a, b = ProcessMesh([0, 1]), ProcessMesh([2, 3])
    G = G_((7, 5), 1)
    x = pieces_from_local(G, a, src_pl, getattr(src_pl[0], "reduce_type", "sum"))
    attr = DistAttr.from_placements(dst_pl, 2, b.shape)
    y = reshard_to(x, b, attr)
    if attr.partial:  # reduce the addends back to check
        y = reshard_to(y, b, DistAttr.replicated(2, b.shape))
    local_ok(y, G)


@pytest.mark.mpi
@pytest.mark.parametrize("src_pl,dst_pl", [
    ([Shard(0)], [Shard(1), Shard(0)]), ([Shard(1)], [Replicate(), Shard(0)]),
    ([Partial()], [Shard(0), Shard(0)]), ([Replicate()], [Shard(1), Replicate()]),
], ids=str)
def test_cross_mesh_1d_to_2d(src_pl, dst_pl):
    need(4)
    a, b = ProcessMesh([0, 1, 2, 3]), ProcessMesh([[0, 1], [2, 3]])
    G = G_((13, 6), 2)
    x = pieces_from_local(G, a, src_pl)
    y = dt.reshard(x, b, dst_pl)
    assert y.process_mesh == b and y.placements == dst_pl
    local_ok(y, G)
    z = dt.reshard(y, a, [Shard(1)])  # and back
    local_ok(z, G)


@pytest.mark.mpi
@pytest.mark.parametrize("pl_sub,pl_full", [
    ([Shard(0)], [Shard(0)]), ([Replicate()], [Shard(1)]), ([Shard(1)], [Replicate()]),
], ids=str)
def test_sub_mesh_to_full_mesh_and_back(pl_sub, pl_full):
    need(2)
    n = world().size
    sub, full = ProcessMesh(list(range(n - 1)) if n > 2 else [0]), ProcessMesh(list(range(n)))
    G = G_((9, 4), 3)
    x = dt.shard_tensor(G, sub, pl_sub)
    y = dt.reshard(x, full, pl_full)
    local_ok(y, G)
    np.testing.assert_array_equal(y.numpy(), G)
    z = dt.reshard(y, sub, pl_sub)
    local_ok(z, G)  # the last rank is outside the sub-mesh: empty piece


# ------------------------------------------------------------------------------ gradients
def _mesh():
    n = world().size
    return ProcessMesh([[0, 1], [2, 3]]) if n == 4 else ProcessMesh(list(range(n)))


@pytest.mark.mpi
def test_grad_through_reshard_and_shard_tensor_leaf():
    mesh = _mesh()
    G, W = G_((7, 5), 4), G_((7, 5), 5)
    src = [Shard(0)] * mesh.ndim if mesh.ndim == 1 else [Shard(0), Shard(1)]
    x = dt.shard_tensor(G, mesh, src, stop_gradient=False)
    assert x.is_leaf and not x.stop_gradient
    for dst in ([Replicate()] * mesh.ndim, [Shard(1)] + [Replicate()] * (mesh.ndim - 1)):
        x.clear_grad()
        y = dt.reshard(x, mesh, dst)
        loss = (y * dt.to_tensor(W)).sum()
        loss.backward()
        assert x.grad is not None and x.grad.placements == src, (x.grad.placements, src)
        np.testing.assert_allclose(x.grad.numpy(), W)


@pytest.mark.mpi
def test_grad_shard_tensor_of_non_leaf_and_matmul():
    mesh = _mesh()
    A, B = G_((6, 4), 6), G_((4, 3), 7)
    a = dt.to_tensor(A, stop_gradient=False)
    x = dt.shard_tensor(a * 2.0, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    y = dt.reshard(x, mesh, [Shard(1)] + [Replicate()] * (mesh.ndim - 1))
    z = dt.matmul(y, dt.to_tensor(B))
    z.sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), 2.0 * np.ones((6, 3)) @ B.T)


@pytest.mark.mpi
@pytest.mark.parametrize("h_pl,w_pl", [("S0", "S1"), ("S1", "R"), ("R", "S0")])
def test_grad_inplace_product_and_quotient_of_dist_tensors(h_pl, w_pl):
    """h.multiply_(w) then h.divide_(w*w) with both needing grad, uneven shapes: the saved copy
    of h's old value is a dist tensor too; values and gradients against numpy."""
    mesh = _mesh()
    rest = [Replicate()] * (mesh.ndim - 1)
    pl = {"S0": [Shard(0)] + rest, "S1": [Shard(1)] + rest, "R": [Replicate()] * mesh.ndim}
    A, Wv, Gr = G_((5, 7), 8), -np.abs(G_((5, 7), 9)) - 1.0, G_((5, 7), 10)
    a = dt.shard_tensor(A, mesh, pl[h_pl], stop_gradient=False)
    w = dt.shard_tensor(Wv, mesh, pl[w_pl], stop_gradient=False)
    h = a * 1.0
    h.multiply_(w)
    h.divide_(w * w)
    (h * dt.to_tensor(Gr)).sum().backward()
    np.testing.assert_allclose(h.numpy(), A / Wv, rtol=1e-12)
    np.testing.assert_allclose(a.grad.numpy(), Gr / Wv, rtol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), -Gr * A / Wv ** 2, rtol=1e-12)


@pytest.mark.mpi
def test_grad_dtensor_from_local_and_to_local():
    mesh = ProcessMesh(list(range(world().size)))
    G, W = G_((9, 4), 8), G_((9, 4), 9)
    attr = DistAttr.from_placements([Shard(0)], 2, mesh.shape)
    sl = local_slices(G.shape, attr, mesh.get_coord(world().rank))
    local = dt.to_tensor(G[sl], stop_gradient=False)
    x = dt.dtensor_from_local(local, mesh, [Shard(0)])
    assert x.shape == [9, 4]
    y = dt.reshard(x, mesh, [Replicate()])
    (y * dt.to_tensor(W)).sum().backward()
    np.testing.assert_allclose(local.grad.numpy(), W[sl])
    # to_local: a dense per-rank computation; the gradient comes back in x's layout
    x2 = dt.shard_tensor(G, mesh, [Shard(0)], stop_gradient=False)
    loc = dt.dtensor_to_local(x2)
    (loc * dt.to_tensor(W[sl])).sum().backward()
    assert x2.grad.placements == [Shard(0)]
    np.testing.assert_allclose(x2.grad._local_array(), W[sl])


@pytest.mark.mpi
def test_grad_unshard_dtensor():
    mesh = _mesh()
    G, W = G_((5, 7), 10), G_((5, 7), 11)
    pl = [Shard(1)] + [Shard(0)] * (mesh.ndim - 1)
    x = dt.shard_tensor(G, mesh, pl, stop_gradient=False)
    u = dt.unshard_dtensor(x)
    assert not u.is_dist()
    np.testing.assert_array_equal(u.numpy(), G)
    (u * dt.to_tensor(W)).sum().backward()
    assert x.grad.placements == pl
    np.testing.assert_allclose(x.grad.numpy(), W)


@pytest.mark.mpi
def test_grad_partial_avg_source():
    need(2)
    mesh = ProcessMesh(list(range(world().size)))
    n = world().size
    W = G_((3, 4), 12)
    local = dt.to_tensor(G_((3, 4), 13 + world().rank), stop_gradient=False)
    x = dt.dtensor_from_local(local, mesh, [Partial("avg")])
    y = dt.reshard(x, mesh, [Replicate()])
    (y * dt.to_tensor(W)).sum().backward()
    np.testing.assert_allclose(local.grad.numpy(), W / n)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.mpi
def test_bad_placements_and_meshes_raise_everywhere():
    mesh = ProcessMesh(list(range(world().size)))
    G = G_((6, 4), 14)
    x = dt.shard_tensor(G, mesh, [Shard(0)])
    before = collectives.collective_counts()
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        dt.reshard(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        dt.shard_tensor(G, mesh, [])
    with pytest.raises(ValueError, match="Shard dim 2 out of range"):
        dt.reshard(x, mesh, [Shard(2)])
    with pytest.raises(ValueError, match="out of range"):
        dt.shard_tensor(G, mesh, [Shard(-3)])
    with pytest.raises(TypeError, match="not a Shard"):
        dt.reshard(x, mesh, ["S0"])
    with pytest.raises(ValueError, match="duplicate ranks"):
        ProcessMesh([0, 0])
    big = ProcessMesh(list(range(world().size + 1)))
    with pytest.raises(ValueError, match="world has only"):
        dt.reshard(x, big, [Replicate()])
    with pytest.raises(ValueError, match="world has only"):
        dt.shard_tensor(G, big, [Replicate()])
    with pytest.raises(ValueError, match="needs a bool tensor"):
        dt.reshard(x, mesh, [Partial("all")])
    with pytest.raises(TypeError, match="distributed"):
        dt.reshard(dt.to_tensor(G), mesh, [Replicate()])
    assert delta(before) == {}
    assert x.placements == [Shard(0)]
    local_ok(x, G)


@pytest.mark.mpi
def test_dtensor_from_local_shares_a_tensor_and_copies_an_array():
    """A dense Tensor's buffer becomes the piece (an inplace op on it shows in the piece); an
    array is copied (writing the array later leaves the piece alone)."""
    mesh = ProcessMesh(list(range(world().size)))
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    dense = dt.to_tensor(arr)
    shared = dt.dtensor_from_local(dense, mesh, [Shard(0)])
    copied = dt.dtensor_from_local(arr, mesh, [Shard(0)])
    dense.add_(dt.to_tensor(np.ones((2, 3), np.float32)))
    arr[...] = -1
    np.testing.assert_array_equal(shared._local_array(), np.arange(6).reshape(2, 3) + 1)
    np.testing.assert_array_equal(copied._local_array(), np.arange(6).reshape(2, 3))


@pytest.mark.mpi
def test_dtensor_from_local_collective_checks():
    need(2)
    mesh = ProcessMesh(list(range(world().size)))
    r = world().rank
    bad_dtype = np.zeros((2, 3), dtype=np.float32 if r == 0 else np.float64)
    with pytest.raises(ValueError, match="different dtypes"):
        dt.dtensor_from_local(bad_dtype, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="needs"):  # the pieces cannot form (5, 3)
        dt.dtensor_from_local(np.zeros((2, 3)), mesh, [Shard(0)], shape=(5, 3))
    uneven = np.zeros((1 + (r == 0), 3))  # rank 0 holds 2 rows: only fits when it is first
    x = dt.dtensor_from_local(uneven, mesh, [Shard(0)])
    assert x.shape == [world().size + 1, 3]
    with pytest.raises(ValueError, match="needs"):
        dt.dtensor_from_local(np.zeros((1 + (r == 1), 3)), mesh, [Shard(0)])


CHECK_SCRIPT = textwrap.dedent("""
    import numpy as np, disttensor as dt, collectives
    from disttensor import ProcessMesh, Shard
    dt.init_parallel_env()
    mesh = ProcessMesh(list(range(dt.get_world_size())))
    x = dt.shard_tensor(np.arange(12.).reshape(4, 3), mesh, [Shard(0)])
    try:
        if dt.get_rank() == 0:
            x.numpy()                      # only rank 0 asks for the global value ...
        else:
            dt.reshard(x, mesh, [Shard(1)])  # ... the others run a different collective
        print("NO ERROR", flush=True)
    except collectives.CollectiveMismatchError as e:
        print("MISMATCH", dt.get_rank(), str(e).splitlines()[0], flush=True)
""")


def test_numpy_on_some_ranks_is_caught_in_debug_mode(tmp_path):
    """DISTTENSOR_CHECK_COLLECTIVES=1: mismatched collectives raise on every rank (no hang)."""
    import shutil

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    script = tmp_path / "check.py"
    script.write_text(CHECK_SCRIPT)
    env = dict(os.environ, DISTTENSOR_CHECK_COLLECTIVES="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "HYDRA_CONTROL_FD", "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS", "DISTTENSOR_TEST_STATUS_DIR"):
        env.pop(var, None)
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], env=env,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert out.count("MISMATCH") == 2 and "NO ERROR" not in out, out


# --------------------------------------------------------------------- visualize and plans
@pytest.mark.mpi
def test_visualize_sharding_2d_mesh(capsys):
    need(4)
    mesh = ProcessMesh([[0, 1], [2, 3]])
    x = dt.shard_tensor(np.zeros((7, 5), np.float32), mesh, [Shard(0), Shard(1)])
    before = collectives.collective_counts()
    text = dt.visualize_sharding(x)
    assert delta(before) == {}  # metadata only
    printed = capsys.readouterr().out
    assert (text in printed) == (world().rank == 0)
    for piece in ("placements [S(0), S(1)]", "rows 0:4", "rows 4:7", "cols 0:3", "cols 3:5",
                  "ranks 3", "[4:7, 3:5]", "[3, 2]", "| 24 "):
        assert piece in text, (piece, text)
    y = dt.shard_tensor(np.zeros((7,), np.float64), mesh, [Shard(0), Replicate()])
    t = dt.visualize_sharding(y, print_=False)
    assert "[0:4]" in t and "ranks 0,1" in t and "ranks 2,3" in t and "| 32 " in t


@pytest.mark.mpi
def test_visualize_sharding_partial_1d_mesh_and_high_rank():
    mesh = ProcessMesh(list(range(world().size)))
    n = world().size
    z = dt.dtensor_from_local(np.zeros((3, 4)), mesh, [Partial()])
    t = dt.visualize_sharding(z, print_=False)
    assert "P(sum)" in t and "ranks " + ",".join(map(str, range(n))) + " P(sum)" in t
    assert "Partial(sum) on mesh dim 0" in t
    w = dt.shard_tensor(np.zeros((2, 3, 5)), mesh, [Shard(2)])
    t3 = dt.visualize_sharding(w, print_=False)
    assert "per rank" in t3 and "[0:2, 0:3, " in t3
    assert t3.count("\n| ") == n + 1  # header + one row per rank
    with pytest.raises(TypeError):
        dt.visualize_sharding(dt.to_tensor(np.zeros(3)), print_=False)


@pytest.mark.mpi
def test_visualize_sharding_outside_mesh_and_uneven():
    need(2)
    sub = ProcessMesh([0])
    x = dt.shard_tensor(np.zeros((3, 2)), sub, [Shard(0)])
    t = dt.visualize_sharding(x, print_=False)
    assert "ranks 0" in t and "[0:3, 0:2]" in t  # the same text on every rank
    m = ProcessMesh(list(range(world().size)))
    y = dt.shard_tensor(np.zeros((1, 3)), m, [Shard(0)])
    t = dt.visualize_sharding(y, print_=False)
    assert "rows 1:1" in t and "[0, 3]" in t  # empty pieces are shown


@pytest.mark.mpi
def test_plan_printing():
    need(2)
    mesh = ProcessMesh(list(range(world().size)))
    n = world().size
    x = dt.shard_tensor(np.zeros((8 * n, 4), np.float32), mesh, [Shard(0)])
    plan = dt.reshard_plan(x, mesh, [Replicate()])
    s = str(plan)
    assert plan.num_collectives == 1 and "1 collective(s)" in s
    assert "all-gather tensor dim 0 on mesh dim 0" in s and f"{8 * 4 * 4} bytes per rank" in s
    s2 = str(dt.reshard_plan(x, mesh, [Shard(1)]))
    assert "all-to-all split dim 1 -> concat dim 0" in s2
    p = dt.dtensor_from_local(np.zeros((2, 3)), mesh, [Partial()])
    s3 = str(dt.reshard_plan(p, mesh, [Shard(1)]))
    assert "reduce-scatter (sum) tensor dim 1" in s3 and "48 bytes per rank" in s3
    assert "nothing to do" in str(dt.reshard_plan(x, mesh, [Shard(0)]))
    s4 = str(dt.reshard_plan(x, mesh, [Partial("max")]))
    assert "0 collective(s)" in s4 and "Partial(max)" in s4
