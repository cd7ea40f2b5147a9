"""The op-by-placement oracle: EVERY registered op, on meshes [4] and [2,2] (4 ranks), [3] (3 or
more ranks; at 4 ranks rank 3 sits outside it), [2] (2 ranks) and [1] (1 rank), under input
placements drawn from Shard(each dim)/Replicate per mesh dim (all combinations up to a cap, then a
deterministic sample that keeps the all-replicated, single-shard, co-sharded and aligned cases)
and Partial inputs built with ``dtensor_from_local``: forward values, input gradients (after
backward of ``sum_i (out_i * W_i).sum()`` with fixed random W) and inputs written by the kernel
(batch_norm's running statistics) equal the dense run of the same op on the global arrays (whose
forward values are first checked against numpy alone: numpy_reference.py), and
gradients arrive in their leaves' own mesh and placements. Ops with an inplace variant also run
it on the distributed path (the target keeps its placements).

Targeted checks follow: the dropout mask under any placement, vocab-parallel embedding, parallel
cross entropy and batch_norm without gathering, matmul S(k) x S(k) -> Partial, and clear errors
raised on every rank before any communication for bad distributed inputs.

``ORACLE_CAP=0`` tries every placement combination (slow; for bug hunting).
"""
from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
from numpy_reference import REFERENCES
from oracle_util import (
    _rng,
    fmt_placements,
    grad_indices,
    make_inputs,
    op_cases,
    partial_combos,
    placement_combos,
    run_case,
)

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from disttensor.dispatch import apply, apply_inplace
from disttensor.layout.mesh_groups import coord_of
from disttensor.ops import OPS
from disttensor.ops.data_checks import pending_data_checks

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
MESHES = {1: ["1"], 2: ["2"], 3: ["3"]}.get(WORLD, ["4", "2x2", "3"])
MAX_FAILURES = 6
_DEBUG = bool(os.environ.get("ORACLE_DEBUG"))
# Ops that are linear in their floating inputs (a Partial input may stay Partial): more
# Partial combinations are tried for them.
_LINEAR_RULES = {"matmul", "reshape", "transpose", "slice", "concat", "stack", "split", "expand",
                 "tile", "slice_grad", "gather", "gather_grad", "embedding_grad"}


def make_mesh(name: str) -> dt.ProcessMesh:
    if name == "2x2":
        return dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    return dt.ProcessMesh(list(range(int(name))), dim_names=["x"])


def _is_linear(op, attrs) -> bool:
    extra = op.rule_attrs(attrs) if callable(op.rule_attrs) else op.rule_attrs
    return bool(extra.get("linear")) or op.rule in _LINEAR_RULES or \
        (op.rule == "reduction" and extra.get("reduce_type") == "sum")


def _close(got, want, what: str, tol: float = 1e-9) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got shape {list(got.shape)} {got.dtype}, dense "
                             f"{list(want.shape)} {want.dtype}")
    if want.dtype.kind == "f":
        tol = max(tol, 2e-5 if want.dtype.itemsize < 8 else 0.0)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)
    elif not np.array_equal(got, want):
        raise AssertionError(f"{what}: values differ\n got {got}\nwant {want}")


def _dense_reference(op, arrays, attrs, wrng):
    copies = [None if a is None else np.array(a, copy=True) for a in arrays]
    tensors, outs, weights = run_case(op, arrays, attrs, None, None, wrng)
    ref = {"out": [o.numpy() for o in outs], "weights": weights, "grads": {}, "mutated": {}}
    # the dense run itself against numpy alone (numpy_reference.py)
    for k, want in enumerate(REFERENCES[op.name](copies, attrs, ref["out"])):
        np.testing.assert_allclose(ref["out"][k], want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{op.name} output {k}: dense run vs numpy reference")
    # float32 anywhere (cast): Partial addends summed in float32 round at that precision
    low = [a for a in list(arrays) + ref["out"] if a is not None and np.asarray(a).dtype.kind == "f"
           and np.asarray(a).dtype.itemsize < 8]
    ref["tol"] = 2e-5 if low else 1e-9
    for i in grad_indices(op, arrays):
        g = tensors[i].grad
        ref["grads"][i] = np.zeros(np.shape(arrays[i])) if g is None else g.numpy()
    for i, _ in op.mutates:
        ref["mutated"][i] = tensors[i].numpy()
    return ref


def _check_dist(op, arrays, attrs, mesh, combo, ref, member: bool, label: str) -> None:
    tensors, outs, _ = run_case(op, arrays, attrs, mesh, combo, None, weights=ref["weights"])
    if len(outs) != len(ref["out"]):
        raise AssertionError(f"{label}: {len(outs)} outputs, dense {len(ref['out'])}")
    for k, o in enumerate(outs):
        if not o.is_dist() or o.process_mesh != mesh:
            raise AssertionError(f"{label}: output {k} is not distributed on the mesh")
        if member:
            _close(o.numpy(), ref["out"][k], f"{label}: output {k}", ref["tol"])
    for i, want in ref["grads"].items():
        t = tensors[i]
        g = t.grad
        if g is not None and (not g.is_dist() or g.process_mesh != mesh
                              or list(g.placements) != list(t.placements)):
            raise AssertionError(f"{label}: grad of input {i} has placements "
                                 f"{g.placements if g.is_dist() else 'dense'}, the leaf "
                                 f"{t.placements}")
        if member:
            _close(np.zeros_like(want) if g is None else g.numpy(), want,
                   f"{label}: grad of input {i}", ref["tol"])
    for i, want in ref["mutated"].items():
        t = tensors[i]
        if list(t.placements) != list(combo[i]):
            raise AssertionError(f"{label}: mutated input {i} changed placements to "
                                 f"{t.placements}")
        if member:
            _close(t.numpy(), want, f"{label}: input {i} written by the kernel", ref["tol"])


def _check_inplace(op, arrays, attrs, mesh, combo, ref, member: bool, label: str) -> None:
    ti, to = op.inplace[0]
    tensors = make_inputs(op, arrays, mesh, combo)
    x = tensors[ti]
    want = ref["out"][to]
    before = list(x.placements)
    with dt.no_grad():
        if tuple(want.shape) != tuple(np.shape(arrays[ti])):
            with pytest.raises(ValueError, match=op.name):
                apply_inplace(op, tuple(tensors), attrs)
            return
        y = apply_inplace(op, tuple(tensors), attrs)
    if y is not x or list(x.placements) != before:
        raise AssertionError(f"{label} (inplace): target placements {before} became "
                             f"{x.placements}")
    if member:
        _close(x.numpy(), want, f"{label} (inplace): target", ref["tol"])


# creation ops and the entry points that plan themselves (rule None) have their own tests
ALL_OPS = sorted(n for n, op in OPS.items() if op.rule is not None)


def test_every_op_has_oracle_cases():
    cases = op_cases()
    missing = [n for n in ALL_OPS if not cases.get(n)]
    assert not missing, f"registered ops without an oracle case: {missing}"


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", ALL_OPS)
def test_op_oracle(name, mesh_name):
    mesh = make_mesh(mesh_name)
    member = coord_of(mesh) is not None
    op = OPS[name]
    failures: list[str] = []
    n = 0
    for k, (arrays, attrs) in enumerate(op_cases()[name]):
        ref = _dense_reference(op, arrays, attrs, _rng(name, k, "w"))
        shapes = [None if a is None else list(np.shape(a)) for a in arrays]
        combos = placement_combos(arrays, mesh.ndim, seed=k)
        combos += partial_combos(op, arrays, mesh.ndim, _is_linear(op, attrs))
        n_inplace = 0
        for combo in combos:
            label = (f"{name} on mesh {list(mesh.shape)}, input placements "
                     f"{fmt_placements(combo)}, shapes {shapes}, attrs {attrs}")
            n += 1
            try:
                _check_dist(op, arrays, attrs, mesh, combo, ref, member, label)
                if op.inplace and n_inplace < 3:
                    n_inplace += 1
                    _check_inplace(op, arrays, attrs, mesh, combo, ref, member, label)
            except Exception as e:  # noqa: BLE001 - collected, reported together
                if _DEBUG:  # a rank-local error desynchronises the ranks: say where at once
                    traceback.print_exc()
                failures.append(f"{label}:\n    {type(e).__name__}: {e}")
            if len(failures) >= MAX_FAILURES:
                break
        if len(failures) >= MAX_FAILURES:
            break
    assert not failures, f"{len(failures)} failing case(s) of {n} tried for {name}:\n" + \
        "\n".join(failures)


# -- targeted checks --------------------------------------------------------------------------

def _meshes():
    return [make_mesh(m) for m in MESHES]


def _moved(before: dict, names=("all_gather", "all_to_all")) -> dict:
    after = collectives.collective_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in names}


def _layouts(mesh, ndim: int):
    """Every Shard(d)/Replicate layout of an ``ndim``-d tensor on ``mesh``."""
    from oracle_util import _tensor_options

    return [list(p) for p in _tensor_options(ndim, mesh.ndim)]


def test_dropout_mask_same_under_every_placement():
    op = OPS["dropout"]
    x = np.random.default_rng(3).standard_normal((5, 7, 3))
    for attrs in ({"p": 0.4, "mode": "upscale_in_train", "seed": 99, "axis": None},
                  {"p": 0.5, "mode": "upscale_in_train", "seed": 5, "axis": (0, 2)}):
        with dt.no_grad():
            want_out, want_mask = (t.numpy() for t in apply(op, (dt.to_tensor(x),), attrs))
        assert 0 < want_mask.mean() < 1
        for mesh in _meshes():
            member = coord_of(mesh) is not None
            for pl in _layouts(mesh, 3):
                with dt.no_grad():
                    out, mask = apply(op, (dt.shard_tensor(x, mesh, pl),), attrs)
                assert list(mask.placements) == pl, (pl, mask.placements)
                if member:
                    np.testing.assert_array_equal(mask.numpy(), want_mask, err_msg=f"mask {pl}")
                    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-12,
                                               err_msg=f"out {pl}")


def test_embedding_vocab_parallel_gives_partial_without_gather():
    op = OPS["embedding"]
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 7, (5, 2)).astype(np.int64)
    w = rng.standard_normal((7, 3))
    gout = rng.standard_normal((5, 2, 3))
    want = w[ids]
    want_gw = np.zeros_like(w)
    np.add.at(want_gw, ids.reshape(-1), gout.reshape(-1, 3))
    for mesh in _meshes():
        member = coord_of(mesh) is not None
        last = mesh.ndim - 1
        # vocab-sharded weight (last mesh dim); ids batch-sharded on mesh dim 0 of a 2-d mesh
        w_pl = [Replicate()] * mesh.ndim
        w_pl[last] = Shard(0)
        ids_pl = [Replicate()] * mesh.ndim
        if mesh.ndim > 1:
            ids_pl[0] = Shard(0)
        wt = dt.shard_tensor(w, mesh, w_pl, stop_gradient=False)
        it = dt.shard_tensor(ids, mesh, ids_pl)
        # batch-sharded ids: no collective; the id check's verdict waits for the next one (so
        # a bad id raises on every rank, tests/faults/test_data_checks.py)
        checks = int(member and mesh.ndim > 1 and mesh.shape[0] > 1)
        before = collectives.collective_counts()
        out = apply(op, (it, wt), {"padding_idx": None})
        assert _moved(before, ("all_gather", "all_to_all", "all_reduce")) == \
            {"all_gather": 0, "all_to_all": 0, "all_reduce": 0}, \
            "embedding forward communicated"
        assert pending_data_checks() == checks
        want_pl = [Shard(0) if isinstance(p, Shard) else Replicate() for p in ids_pl]
        want_pl[last] = Partial()
        assert list(out.placements) == want_pl, out.placements
        dt.sum(dt.multiply(out, dt.to_tensor(gout))).backward()
        assert list(wt.grad.placements) == w_pl
        if member:
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)
            np.testing.assert_allclose(wt.grad.numpy(), want_gw, rtol=1e-12)
        # batch-sharded ids with a replicated weight: a batch-sharded output, no communication
        # (the id check's verdict waits for the next collective)
        it = dt.shard_tensor(ids, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
        wt = dt.shard_tensor(w, mesh, [Replicate()] * mesh.ndim)
        before = collectives.collective_counts()
        with dt.no_grad():
            out = apply(op, (it, wt), {"padding_idx": None})
        assert _moved(before, ("all_gather", "all_to_all", "all_reduce")) == \
            {"all_gather": 0, "all_to_all": 0, "all_reduce": 0}
        assert pending_data_checks() == int(member and mesh.shape[0] > 1)
        assert list(out.placements) == list(it.placements)
        if member:
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)


def test_parallel_cross_entropy_never_gathers_logits():
    op = OPS["cross_entropy"]
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((5, 7))
    label = rng.integers(0, 7, (5, 1)).astype(np.int64)
    attrs = {"axis": 1, "ignore_index": -100}
    ref_x = dt.to_tensor(logits, stop_gradient=False)
    sm, loss = apply(op, (ref_x, dt.to_tensor(label)), attrs)
    w = rng.standard_normal((5, 1))
    dt.sum(dt.multiply(loss, dt.to_tensor(w))).backward()
    want_sm, want_loss, want_g = sm.numpy(), loss.numpy(), ref_x.grad.numpy()
    for mesh in _meshes():
        member = coord_of(mesh) is not None
        for x_pl, l_pl in (([Replicate()] * (mesh.ndim - 1) + [Shard(1)],
                            [Replicate()] * mesh.ndim),
                           ([Shard(0)] + [Shard(1)] * (mesh.ndim - 1),
                            [Shard(0)] + [Replicate()] * (mesh.ndim - 1))):
            x = dt.shard_tensor(logits, mesh, x_pl, stop_gradient=False)
            lab = dt.shard_tensor(label, mesh, l_pl)
            before = collectives.collective_counts()
            sm, loss = apply(op, (x, lab), attrs)
            dt.sum(dt.multiply(loss, dt.to_tensor(w))).backward()
            moved = _moved(before)
            assert moved == {"all_gather": 0, "all_to_all": 0}, \
                f"cross_entropy with logits {x_pl} gathered: {moved}"
            assert list(x.grad.placements) == x_pl
            if member:
                np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-10)
                np.testing.assert_allclose(sm.numpy(), want_sm, rtol=1e-10)
                np.testing.assert_allclose(x.grad.numpy(), want_g, rtol=1e-9, atol=1e-12)


def test_batch_norm_batch_sharded_only_small_all_reduces():
    op = OPS["batch_norm"]
    rng = np.random.default_rng(6)
    X = rng.standard_normal((7, 3, 2))
    RM, RV, W, B = rng.standard_normal(3), rng.random(3) + 0.5, rng.standard_normal(3), \
        rng.standard_normal(3)
    attrs = {"training": True, "momentum": 0.9, "epsilon": 1e-5, "data_format": "NCL"}
    G = rng.standard_normal((7, 3, 2))

    def run(x_pl, mesh):
        mk = (lambda a, pl, sg=True: dt.to_tensor(a, stop_gradient=sg)) if mesh is None else \
            (lambda a, pl, sg=True: dt.shard_tensor(a, mesh, pl, stop_gradient=sg))
        rep = None if mesh is None else [Replicate()] * mesh.ndim
        x, rm, rv = mk(X, x_pl, False), mk(RM, rep), mk(RV, rep)
        w, b = mk(W, rep, False), mk(B, rep, False)
        before = collectives.collective_counts()
        out = apply(op, (x, rm, rv, w, b), attrs)[0]
        dt.sum(dt.multiply(out, dt.to_tensor(G))).backward()
        return _moved(before), [out, x.grad, w.grad, b.grad, rm, rv]

    _, ref = run(None, None)
    ref = [t.numpy() for t in ref]
    for mesh in _meshes():
        member = coord_of(mesh) is not None
        x_pl = [Shard(0)] * mesh.ndim  # the batch dim split over every mesh dim
        moved, got = run(x_pl, mesh)
        assert moved == {"all_gather": 0, "all_to_all": 0}, f"batch_norm {x_pl}: {moved}"
        if member:
            for k, (g, want) in enumerate(zip(got, ref)):
                np.testing.assert_allclose(g.numpy(), want, rtol=1e-9, atol=1e-12,
                                           err_msg=f"batch_norm {x_pl} result {k}")


def test_matmul_contracted_shards_give_partial():
    op = OPS["matmul"]
    rng = np.random.default_rng(8)
    X, Y = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    attrs = {"transpose_x": False, "transpose_y": False}
    for mesh in _meshes():
        member = coord_of(mesh) is not None
        k_pl = [Shard(1)] + [Replicate()] * (mesh.ndim - 1)
        y_pl = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
        x = dt.shard_tensor(X, mesh, k_pl, stop_gradient=False)
        y = dt.shard_tensor(Y, mesh, y_pl, stop_gradient=False)
        before = collectives.collective_counts()
        out = apply(op, (x, y), attrs)
        assert sum(_moved(before, ("all_gather", "all_to_all", "all_reduce")).values()) == 0
        assert list(out.placements) == [Partial()] + [Replicate()] * (mesh.ndim - 1)
        dt.sum(out).backward()
        assert list(x.grad.placements) == k_pl and list(y.grad.placements) == y_pl
        if member:
            np.testing.assert_allclose(out.numpy(), X @ Y, rtol=1e-10)
            np.testing.assert_allclose(x.grad.numpy(), np.ones((5, 3)) @ Y.T, rtol=1e-10)
            np.testing.assert_allclose(y.grad.numpy(), X.T @ np.ones((5, 3)), rtol=1e-10)


def _partial_input(G, mesh, red="sum", seed=0, stop_gradient=False):
    """A leaf Partial(red) on mesh dim 0 (Replicate elsewhere) whose global value is G: rank
    pieces are known addends (sum: random parts; max: G on coordinate 0, smaller elsewhere)."""
    coord = coord_of(mesh)
    pl = [Partial(red)] + [Replicate()] * (mesh.ndim - 1)
    if coord is None:
        local = np.zeros((0,) * G.ndim)
    else:
        rng = np.random.default_rng(seed)
        parts = [rng.standard_normal(G.shape) for _ in range(mesh.shape[0])]
        if red == "sum":
            parts[0] = G - sum(parts[1:], np.zeros(G.shape))
        else:
            sign = 1 if red == "max" else -1
            parts = [G] + [G - sign * np.abs(p) for p in parts[1:]]
        local = parts[coord[0]]
    t = dt.dtensor_from_local(dt.to_tensor(local), mesh, pl, shape=G.shape)
    t.stop_gradient = stop_gradient
    return t


def test_partial_stays_partial_where_cheaper():
    """P + R, P - R (broadcast): no collective, output Partial; P * P: one all-reduce;
    maximum/minimum of Partial(max)/(min) with Partial or Replicate: no collective, output
    Partial(max)/(min); values and gradients against numpy."""
    rng = np.random.default_rng(11)
    X, Y, V = rng.standard_normal((5, 6)), rng.standard_normal((5, 6)), rng.standard_normal(6)
    W = rng.standard_normal((5, 6))
    for mesh in _meshes():
        if mesh.shape[0] == 1:
            continue
        member = coord_of(mesh) is not None
        rest = [Replicate()] * (mesh.ndim - 1)
        cases = [("add", lambda a, b: a + b, np.add, V, [Replicate()] + rest),
                 ("subtract", lambda a, b: a - b, np.subtract, Y, [Shard(1)] + rest)]
        for name, f, ref, B, b_pl in cases:
            x = _partial_input(X, mesh, seed=1)
            y = dt.shard_tensor(B, mesh, [Replicate() if isinstance(p, Shard) and B.ndim == 1
                                          else p for p in b_pl], stop_gradient=False)
            before = collectives.collective_counts()
            out = f(x, y)
            assert collectives.collective_counts() == before, f"{name}: P op R communicated"
            assert list(out.placements) == [Partial()] + rest
            (out * dt.to_tensor(W)).sum().backward()
            if member:
                np.testing.assert_allclose(out.numpy(), ref(X, B), rtol=1e-10, atol=1e-12)
                gy = W.sum(0) if B.ndim == 1 else W
                np.testing.assert_allclose(y.grad.numpy(), gy if name == "add" else -gy,
                                           rtol=1e-10, atol=1e-12)
        # P * P: at most one collective
        x, y = _partial_input(X, mesh, seed=2), _partial_input(Y, mesh, seed=3)
        before = collectives.collective_counts()
        out = x * y
        after = collectives.collective_counts()
        assert sum(after.values()) - sum(before.values()) == int(member), (before, after)
        if member:
            np.testing.assert_allclose(out.numpy(), X * Y, rtol=1e-10)
        # maximum / minimum of Partial(max) / Partial(min)
        for fn, red, ref in ((dt.maximum, "max", np.maximum), (dt.minimum, "min", np.minimum)):
            a = _partial_input(X, mesh, red, seed=4)
            b = _partial_input(Y, mesh, red, seed=5)
            c = dt.shard_tensor(V, mesh, [Replicate()] * mesh.ndim)
            before = collectives.collective_counts()
            o1, o2 = fn(a, b), fn(a, c)
            assert collectives.collective_counts() == before, f"{red} of Partial({red}) moved"
            assert list(o1.placements) == list(o2.placements) == [Partial(red)] + rest
            if member:
                np.testing.assert_array_equal(o1.numpy(), ref(X, Y))
                np.testing.assert_array_equal(o2.numpy(), ref(X, V))


def _raises_before_communication(fn, *needles):
    before = collectives.collective_counts()
    with pytest.raises(ValueError) as info:
        fn()
    after = collectives.collective_counts()
    assert after == before, f"communicated before raising: {before} -> {after}"
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"error message lacks {n!r}: {msg}"
    return msg


def test_bad_distributed_inputs_raise_everywhere_before_communication():
    for mesh in _meshes():
        n = mesh.ndim
        x = dt.shard_tensor(np.ones((3, 4)), mesh, [Shard(0)] + [Replicate()] * (n - 1))
        # inputs on different meshes
        other = dt.ProcessMesh(np.array(mesh.process_ids)[::-1].reshape(mesh.shape).tolist())
        y = dt.shard_tensor(np.ones((3, 4)), other, [Replicate()] * n)
        _raises_before_communication(lambda: dt.add(x, y), "add", "mesh", "Shard(dim=0)")
        # shapes the dense op rejects
        z = dt.shard_tensor(np.ones((5, 4)), mesh, [Shard(1)] + [Replicate()] * (n - 1))
        _raises_before_communication(lambda: dt.add(x, z), "add", "[3, 4]", "[5, 4]",
                                     "Shard(dim=1)")
        w = dt.shard_tensor(np.ones((5, 2)), mesh, [Shard(0)] + [Replicate()] * (n - 1))
        _raises_before_communication(lambda: dt.matmul(x, w), "matmul", "[3, 4]", "[5, 2]")
        mm = {"transpose_x": False, "transpose_y": False}  # past the public function's check
        _raises_before_communication(lambda: apply(OPS["matmul"], (x, w), mm), "matmul",
                                     "[3, 4]", "[5, 2]", "Shard(dim=0)")
        # an inplace op whose result cannot keep the target's shape
        row = dt.shard_tensor(np.ones((1, 4)), mesh, [Shard(1)] + [Replicate()] * (n - 1))
        with dt.no_grad():
            _raises_before_communication(lambda: apply_inplace(OPS["add"], (row, x), {}),
                                         "add_", "[1, 4]", "[3, 4]", "Shard(dim=1)")
        assert list(row.placements)[0] == Shard(1)


def test_uneven_size_one_views_need_no_communication():
    """[1, 2, 2, 2] as Shard(0) on 4 ranks (rank 0 holds it, the others hold empty pieces)
    reshaped to (1, 2, 4), (1, 4, 2), (1, 8) and flattened: no collective, the output stays
    Shard(0) and views the input's buffer; values and gradients against numpy."""
    if WORLD != 4:
        pytest.skip("needs 4 ranks")
    mesh = make_mesh("4")
    G = np.arange(8.0).reshape(1, 2, 2, 2)
    for target in [(1, 2, 4), (1, 4, 2), (1, 8)]:
        x = dt.shard_tensor(G, mesh, [Shard(0)], stop_gradient=False)
        before = collectives.collective_counts()
        y = dt.reshape(x, list(target))
        assert collectives.collective_counts() == before
        assert y.placements == [Shard(0)] and y._value.local.holder is x._value.local.holder
        if x._local_array().size:
            assert np.shares_memory(y._local_array(), x._local_array())
        np.testing.assert_array_equal(y.numpy(), G.reshape(target))
        W = np.arange(8.0).reshape(target) + 1
        (y * dt.to_tensor(W)).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), W.reshape(G.shape))
    f = dt.flatten(dt.shard_tensor(G, mesh, [Shard(0)]), 1, 3)
    assert f.placements == [Shard(0)] and f.shape == [1, 8]
