"""The tensor ops on distributed tensors (1 to 4 ranks), beyond the op-by-placement oracle:
bad input raises the same error on every rank of the mesh before any communication (or, for
data checks, after one small agreeing all-reduce: nothing is written), what the index checks
cost, multinomial draws that do not depend on the placement, shards that tril and the
statistics keep, and list/tensor/bool indexing of sharded tensors — against numpy."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from disttensor.layout.mesh_groups import coord_of
from disttensor.ops.data_checks import pending_data_checks

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
MESHES = {1: ["1"], 2: ["2"], 3: ["3"]}.get(WORLD, ["4", "2x2", "3"])
RNG = np.random.default_rng(7)


def make_mesh(name: str) -> dt.ProcessMesh:
    if name == "2x2":
        return dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    return dt.ProcessMesh(list(range(int(name))), dim_names=["x"])


def meshes():
    return [make_mesh(m) for m in MESHES]


def first(mesh, p, rest=Replicate()):
    """Placement ``p`` on mesh dim 0, ``rest`` on the others."""
    return [p] + [rest] * (mesh.ndim - 1)


def moved(before, names=("all_gather", "all_to_all", "all_reduce")) -> dict:
    after = collectives.collective_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in names}


def raises_silently(exc, fn, *needles):
    """``fn`` raises ``exc`` naming ``needles`` without any collective."""
    before = collectives.collective_counts()
    with pytest.raises(exc) as info:
        fn()
    assert collectives.collective_counts() == before, "communicated before raising"
    for n in needles:
        assert n in str(info.value), f"{n!r} not in {info.value}"


def test_shape_errors_raise_before_communication():
    x = RNG.standard_normal((5, 4))
    for mesh in meshes():
        xs = dt.shard_tensor(x, mesh, first(mesh, Shard(0)))
        raises_silently(ValueError, lambda: dt.topk(xs, 5, axis=1), "topk", "k=5", "[5, 4]")
        raises_silently(ValueError, lambda: dt.multinomial(xs, 5), "multinomial",
                        "num_samples=5", "[5, 4]")
        raises_silently(IndexError, lambda: xs[:, [0, 4]], "__getitem__", "index 4",
                        "[5, 4]")
        raises_silently(ValueError, lambda: dt.take_along_axis(
            xs, dt.shard_tensor(np.zeros((3, 1), np.int64), mesh, first(mesh, Shard(0))), 1),
            "take_along_axis", "[3, 1]", "[5, 1]")
        mask = dt.shard_tensor(x > 0, mesh, first(mesh, Shard(0)))
        if mesh.shape[0] > 1:
            raises_silently(ValueError, lambda: xs[mask], "__getitem__", "bool mask",
                            "Shard(dim=0)")


def test_data_errors_raise_on_every_rank_and_write_nothing():
    """A bad value in one rank's piece only: the check's all-reduce (over the mesh dims that
    shard the checked input; none when it is replicated) makes every rank of the mesh raise."""
    x = RNG.random((5, 4))
    for mesh in meshes():
        member = coord_of(mesh) is not None
        bad = x.copy()
        bad[4, 1] = -0.5  # the last row: on the last rank of mesh dim 0
        p = dt.shard_tensor(bad, mesh, first(mesh, Shard(0)))
        if member:
            with pytest.raises(ValueError, match=r"multinomial: x of shape \[5, 4\] has a "
                                                 "negative"):
                dt.multinomial(p, 2)
        ids = np.zeros((5, 2), np.int64)
        ids[4, 0] = 9
        it = dt.shard_tensor(ids, mesh, first(mesh, Shard(0)))
        xs = dt.shard_tensor(x, mesh, first(mesh, Shard(1)))
        if member:
            with pytest.raises(ValueError, match=r"take_along_axis: index value 9 is out of "
                                                 r"range \[0, 4\) \(arr of shape \[5, 4\], "
                                                 r"indices of shape \[5, 2\], axis 1\)"):
                dt.take_along_axis(xs, it, 1).numpy()  # agreed at the next collective
            with pytest.raises(ValueError, match=r"index_select: index value 9 is out of range "
                                                 r"\[0, 5\) \(x of shape \[5, 4\]"):
                dt.index_select(xs, dt.shard_tensor(ids[:, 0], mesh, first(mesh, Shard(0))), 0)
        target = dt.shard_tensor(x, mesh, first(mesh, Shard(1)))
        before = collectives.collective_counts()
        if member:
            with pytest.raises(ValueError, match=r"scatter: index value 5 is out of range "
                                                 r"\[0, 5\) \(x of shape \[5, 4\]"):
                dt.scatter_(target, dt.to_tensor(np.array([1, 5])),
                            dt.shard_tensor(np.ones((2, 4)), mesh, first(mesh, Shard(1))))
            # the replicated index is checked where it lies: no collective at all
            assert moved(before) == {"all_gather": 0, "all_to_all": 0, "all_reduce": 0}
        assert list(target.placements) == first(mesh, Shard(1))
        if member:
            np.testing.assert_array_equal(target.numpy(), x)  # nothing modified
            with pytest.raises(IndexError, match="__setitem__: scatter: index value 5"):
                target[dt.to_tensor(np.array([1, 5]))] = 0.0
            np.testing.assert_array_equal(target.numpy(), x)


def test_index_checks_cost_at_most_one_small_all_reduce():
    x = RNG.standard_normal((6, 5))
    idx = RNG.integers(0, 5, (6, 3)).astype(np.int64)
    for mesh in meshes():
        member = coord_of(mesh) is not None
        # sharded indices: one small all-reduce agrees on their range (as embedding ids), later;
        # replicated ones with a replicated arr stay whole, each rank checks them alone
        for pl, checks in ((first(mesh, Shard(0)), int(member and mesh.shape[0] > 1)),
                           ([Replicate()] * mesh.ndim, 0)):
            xs, it = dt.shard_tensor(x, mesh, pl), dt.shard_tensor(idx, mesh, pl)
            before = collectives.collective_counts()
            with dt.no_grad():
                out = dt.take_along_axis(xs, it, 1)
            # the agreement is deferred to the next collective (here: out.numpy())
            assert moved(before) == {"all_gather": 0, "all_to_all": 0, "all_reduce": 0}
            assert pending_data_checks() == checks
            assert list(out.placements) == pl
            if member:
                np.testing.assert_array_equal(out.numpy(), np.take_along_axis(x, idx, 1))


def test_multinomial_same_samples_under_every_placement():
    p = RNG.random((7, 5))
    p[:, 2] = 0.0
    for replacement in (False, True):
        dt.seed(11)
        want = dt.multinomial(dt.to_tensor(p), 3, replacement).numpy()
        for mesh in meshes():
            for pl in (first(mesh, Shard(0)), first(mesh, Shard(1)), [Shard(0)] * mesh.ndim,
                       first(mesh, Partial())):
                src = dt.shard_tensor(p, mesh, [Replicate()] * mesh.ndim)
                ps = dt.reshard(src, mesh, pl)
                dt.seed(11)
                got = dt.multinomial(ps, 3, replacement)
                if coord_of(mesh) is not None:
                    np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{pl}")
                assert 2 not in want


def test_tril_and_statistics_keep_their_shards():
    x = RNG.standard_normal((5, 7))
    w = RNG.standard_normal((5,))
    for mesh in meshes():
        member = coord_of(mesh) is not None
        pl = [Shard(0), Shard(1)] if mesh.ndim == 2 else first(mesh, Shard(1))
        xs = dt.shard_tensor(x, mesh, pl, stop_gradient=False)
        before = collectives.collective_counts()
        lo = dt.tril(xs, -1)
        assert moved(before) == {"all_gather": 0, "all_to_all": 0, "all_reduce": 0}
        assert list(lo.placements) == pl
        m = x.max(1, keepdims=True)
        refs = {"logsumexp": (np.log(np.exp(x - m).sum(1)) + m[:, 0],
                              np.exp(x - (np.log(np.exp(x - m).sum(1)) + m[:, 0])[:, None])),
                "var": (x.var(1, ddof=1), 2 * (x - x.mean(1, keepdims=True)) / 6),
                "norm": (np.sqrt((x * x).sum(1)), x / np.sqrt((x * x).sum(1, keepdims=True)))}
        for name, (want, dwant) in refs.items():
            xs = dt.shard_tensor(x, mesh, pl, stop_gradient=False)
            before = collectives.collective_counts()
            out = getattr(dt, name)(xs, axis=1)
            assert moved(before, ("all_gather", "all_to_all")) == {"all_gather": 0,
                                                                  "all_to_all": 0}, name
            (out * dt.to_tensor(w)).sum().backward()
            if member:
                np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, err_msg=name)
                np.testing.assert_allclose(xs.grad.numpy(), dwant * w[:, None], rtol=1e-10,
                                           atol=1e-12, err_msg=name)
        if member:
            np.testing.assert_array_equal(lo.numpy(), np.tril(x, -1))


def test_indexing_sharded_tensors():
    a = RNG.standard_normal((4, 5, 6))
    w = RNG.standard_normal((4, 1, 6))
    for mesh in meshes():
        member = coord_of(mesh) is not None
        pl = [Shard(0), Shard(2)] if mesh.ndim == 2 else first(mesh, Shard(0))
        x = dt.shard_tensor(a, mesh, pl, stop_gradient=False)
        last = x[:, [-1], :]
        assert list(last.placements) == pl  # batch (and hidden) stay sharded
        (last * dt.to_tensor(w)).sum().backward()
        row = x[:, -1, :]
        if member:
            np.testing.assert_array_equal(last.numpy(), a[:, [-1], :])
            np.testing.assert_array_equal(row.numpy(), a[:, -1, :])
            g = np.zeros_like(a)
            g[:, [-1], :] = w
            np.testing.assert_array_equal(x.grad.numpy(), g)
            np.testing.assert_array_equal(x[:, dt.to_tensor(np.array([3, -5]))].numpy(),
                                          a[:, [3, -5]])
        y = dt.shard_tensor(a, mesh, pl)
        with dt.no_grad():
            y[:, [0, 2]] = dt.shard_tensor(np.ones((4, 2, 6)), mesh, pl)
            y[dt.shard_tensor(a > 1, mesh, pl)] = 0.0
        assert list(y.placements) == pl
        rep = dt.shard_tensor(a[:, 0, 0] > 0, mesh, [Replicate()] * mesh.ndim)
        if not member:  # the mask's values are the members' alone
            with pytest.raises(ValueError, match="outside the mesh of the bool mask"):
                x[rep]
            continue
        picked = x[rep]
        if member:
            want = a.copy()
            want[:, [0, 2]] = 1.0
            want[a > 1] = 0.0
            np.testing.assert_array_equal(y.numpy(), want)
            np.testing.assert_array_equal(picked.numpy(), a[a[:, 0, 0] > 0])


def test_sampling_step_equals_dense():
    """topk + multinomial on the last position of batch-sharded logits: the dense tokens."""
    logits = RNG.standard_normal((4, 3, 11))

    def step(lg):
        v, i = dt.topk(lg[:, -1, :], 5)
        probs = dt.softmax(v, axis=-1)
        pick = dt.multinomial(probs, 1)
        return dt.take_along_axis(i, pick, 1)

    dt.seed(3)
    with dt.no_grad():
        want = step(dt.to_tensor(logits)).numpy()
    for mesh in meshes():
        dt.seed(3)
        with dt.no_grad():
            got = step(dt.shard_tensor(logits, mesh, first(mesh, Shard(0))))
        if coord_of(mesh) is not None:
            np.testing.assert_array_equal(got.numpy(), want)
