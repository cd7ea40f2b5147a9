"""save_state_dict / load_state_dict within one world: layout changes, the files (opened with
the safetensors library), optimizer state and a resumed run, Partial tensors, bad input."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from spmd_rules import DistAttr, local_slices

pytestmark = pytest.mark.mpi


def world():
    return collectives.init()


def grid():
    """2 x 2 on 4 ranks, else every rank in a row ([1, n])."""
    n = world().size
    return dt.ProcessMesh([[0, 1], [2, 3]] if n == 4 else [list(range(n))], dim_names=["a", "b"])



W = np.random.default_rng(0).standard_normal((7, 5))
B = np.arange(6, dtype=np.float32) * 0.5
IDS = np.arange(12, dtype=np.int64).reshape(3, 4)

LAYOUTS = [([Shard(0), Replicate()], [Replicate(), Shard(1)]),
           ([Shard(0), Shard(1)], [Shard(1), Shard(0)]),
           ([Replicate(), Replicate()], [Shard(0), Shard(0)]),
           ([Shard(1), Shard(0)], [Replicate(), Replicate()]),
           # co-shard split orders (Shard(d, shard_order=k)): saved in one, loaded in another
           ([Shard(0, shard_order=1), Shard(0, shard_order=0)], [Shard(0), Shard(0)]),
           ([Shard(1), Shard(1)], [Shard(1, shard_order=1), Shard(1, shard_order=0)])]


def _state(mesh, pw, pb):
    return {"model": {"w": dt.shard_tensor(W, mesh, pw), "b": dt.shard_tensor(B, mesh, pb)},
            "ids": dt.to_tensor(IDS), "arr": np.array([1.5, 2.5]), "step": 7, "name": "run-1",
            "lr": 0.25, "flag": None}


def _zeros_like(state, mesh, pw, pb):
    return {"model": {"w": dt.shard_tensor(np.zeros_like(W), mesh, pw),
                      "b": dt.shard_tensor(np.zeros_like(B), mesh, pb)},
            "ids": dt.to_tensor(np.zeros_like(IDS)), "arr": np.zeros(2), "step": 0,
            "name": "", "lr": 0.0, "flag": 1}


@pytest.mark.parametrize("src,dst", LAYOUTS)
def test_round_trip_into_other_placements(ckdir, src, dst):
    mesh = grid()
    dt.save_state_dict(_state(mesh, src, [Shard(0), Replicate()]), ckdir)
    target = _zeros_like(None, mesh, dst, [Replicate(), Shard(0)])
    w_obj = target["model"]["w"]
    dt.load_state_dict(target, ckdir)
    w = target["model"]["w"]
    assert w is w_obj and w.placements == dst, "the target keeps its identity and layout"
    coord = mesh.get_coord(world().rank)
    attr = DistAttr.from_placements(dst, 2, mesh.shape)
    np.testing.assert_array_equal(w.to_local().numpy(), W[local_slices(W.shape, attr, coord)])
    np.testing.assert_array_equal(w.numpy(), W)
    np.testing.assert_array_equal(target["model"]["b"].numpy(), B)
    assert target["model"]["b"].dtype == np.float32
    np.testing.assert_array_equal(target["ids"].numpy(), IDS)
    np.testing.assert_array_equal(target["arr"], [1.5, 2.5])
    assert (target["step"], target["name"], target["lr"], target["flag"]) == (7, "run-1", 0.25,
                                                                             None)


def test_files_open_with_safetensors_each_piece_written_once_by_its_holder(ckdir, comm):
    from safetensors.numpy import load_file

    mesh = grid()
    pw = [Replicate(), Shard(1)]
    dt.save_state_dict(_state(mesh, pw, [Shard(0), Replicate()]), ckdir)
    comm.barrier()
    with open(os.path.join(ckdir, "metadata.json")) as f:
        md = json.load(f)
    files = {name: load_file(os.path.join(ckdir, name)) for name in os.listdir(ckdir)
             if name.endswith(".safetensors")}
    want = {"model.w": W, "model.b": B, "ids": IDS, "arr": np.array([1.5, 2.5])}
    for name, g in want.items():
        entry = md["tensors"][name]
        assert entry["shape"] == list(g.shape) and entry["dtype"] == g.dtype.name
        out = np.full(g.shape, np.nan) if g.dtype.kind == "f" else np.zeros_like(g)
        count = 0
        for ch in entry["chunks"]:
            idx = tuple(slice(a, b) for a, b in ch["index"])
            piece = files[ch["file"]][name]
            np.testing.assert_array_equal(piece, g[idx])
            out[idx] = piece
            count += piece.size
        assert count == g.size, f"{name}: every element written exactly once"
        np.testing.assert_array_equal(out, g)
    # the writer of each piece of w is the lowest rank holding it: coordinate 0 on mesh dim 0
    writers = {ch["file"] for ch in md["tensors"]["model.w"]["chunks"]}
    expect = {f"rank_{mesh.rank_at((0, j)):05d}.safetensors" for j in range(mesh.shape[1])}
    assert writers == expect
    assert md["values"]["step"]["value"] == 7 and md["values"]["name"]["value"] == "run-1"
    # rank r's file holds its own local piece of w, if it writes one
    mine = f"rank_{world().rank:05d}.safetensors"
    if mine in writers:
        w = dt.shard_tensor(W, mesh, pw)
        np.testing.assert_array_equal(files[mine]["model.w"], w.to_local().numpy())


def test_partial_tensor_is_saved_as_its_value(ckdir):
    mesh = grid()
    x = np.random.default_rng(1).standard_normal((4, 6))
    w = np.random.default_rng(2).standard_normal((6, 3))
    y = dt.matmul(dt.shard_tensor(x, mesh, [Replicate(), Shard(1)]),
                  dt.shard_tensor(w, mesh, [Replicate(), Shard(0)]))
    if mesh.shape[1] > 1:
        assert isinstance(y.placements[1], Partial)
    dt.save_state_dict({"y": y}, ckdir)
    target = {"y": dt.shard_tensor(np.zeros((4, 3)), mesh, [Shard(0), Replicate()])}
    dt.load_state_dict(target, ckdir)
    np.testing.assert_allclose(target["y"].numpy(), x @ w, rtol=1e-12)


def _model(mesh, seed):
    dt.seed(seed)
    # optimizer state is keyed by parameter names: fix them, as a fresh process would make them
    m = dt.nn.Sequential(
        dt.nn.Linear(5, 8, weight_attr=dt.ParamAttr(name="fc1.w"),
                     bias_attr=dt.ParamAttr(name="fc1.b")),
        dt.nn.ReLU(),
        dt.nn.Linear(8, 2, weight_attr=dt.ParamAttr(name="fc2.w"),
                     bias_attr=dt.ParamAttr(name="fc2.b")))

    def shard_fn(name, layer, pm):
        if name == "0":
            layer.weight = dt.shard_tensor(layer.weight, pm, [Replicate(), Shard(1)])
            layer.bias = dt.shard_tensor(layer.bias, pm, [Replicate(), Shard(0)])
        if name == "2":
            layer.weight = dt.shard_tensor(layer.weight, pm, [Replicate(), Shard(0)])
    dt.shard_layer(m, mesh, shard_fn)
    return m, dt.optimizer.AdamW(learning_rate=0.05, parameters=m.parameters())


def _steps(m, opt, k, mesh, first=0):
    rng = np.random.default_rng(5)
    xs, ys = rng.standard_normal((10, 6, 5)), rng.standard_normal((10, 6, 2))
    losses = []
    for i in range(first, first + k):
        x = dt.shard_tensor(xs[i].astype("float32"), mesh, [Shard(0), Replicate()])
        y = dt.shard_tensor(ys[i].astype("float32"), mesh, [Shard(0), Replicate()])
        loss = dt.nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    return losses


def test_resumed_run_equals_the_uninterrupted_one(ckdir):
    mesh = grid()
    m, opt = _model(mesh, 0)
    _steps(m, opt, 2, mesh)
    dt.save_state_dict({"model": m.state_dict(), "opt": opt.state_dict(), "step": 2}, ckdir)
    straight = _steps(m, opt, 3, mesh, first=2)

    m2, opt2 = _model(mesh, 1)                   # other weights; a step creates the states
    _steps(m2, opt2, 1, mesh, first=9)
    state = {"model": m2.state_dict(), "opt": opt2.state_dict(), "step": 0}
    dt.load_state_dict(state, ckdir)
    opt2.set_state_dict(state["opt"])
    assert state["step"] == 2
    resumed = _steps(m2, opt2, 3, mesh, first=2)
    np.testing.assert_allclose(resumed, straight, rtol=1e-6)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, err_msg=k)


def test_bad_input_raises_on_every_rank_and_changes_nothing(ckdir):
    mesh = grid()
    dt.save_state_dict(_state(mesh, [Shard(0), Replicate()], [Shard(0), Replicate()]), ckdir)
    target = _zeros_like(None, mesh, [Replicate(), Shard(1)], [Replicate(), Shard(0)])
    target["model"]["w"].fill_(3.0)
    cases = [
        ({"extra": dt.zeros([2])}, ValueError, "'extra': missing in the checkpoint"),
        ({"model": {"w": dt.shard_tensor(np.zeros((7, 4)), mesh, [Shard(0), Replicate()])}},
         ValueError, r"global shape \[7, 5\] in the checkpoint but \[7, 4\]"),
        ({"step": dt.zeros([1])}, ValueError, "'step': a plain value in the checkpoint"),
    ]
    for extra, exc, msg in cases:
        bad = dict(target)
        bad.update(extra)
        with pytest.raises(exc, match=msg):
            dt.load_state_dict(bad, ckdir)
    np.testing.assert_array_equal(target["model"]["w"].numpy(), np.full(W.shape, 3.0))
    assert target["step"] == 0 and target["arr"].sum() == 0
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        dt.load_state_dict(target, ckdir + "-missing")
    with pytest.raises(TypeError, match="'bad' is a object"):
        dt.save_state_dict({"bad": object()}, ckdir + "-new")
    assert not os.path.exists(ckdir + "-new") and not os.path.exists(ckdir + "-new.tmp")


def _whole(shape) -> list:
    return [[0, n] for n in shape]


# metadata.json edits of the one chunk of a dense 7 x 5 tensor ("file", "index" as saved)
BROKEN_CHUNKS = {
    "no chunks": (lambda f: [], ValueError, r"cover 0 of the \d+ elements.*incomplete"),
    "a row short": (lambda f: [{"file": f, "index": [[0, 6], [0, 5]]}], ValueError,
                    r"cover \d+ of the \d+ elements.*incomplete"),
    # the same file twice: rows [0, 4) and [3, 6); the element counts add up to 35
    "overlap and a gap": (lambda f: [{"file": f, "index": [[0, 4], [0, 5]]},
                                     {"file": f, "index": [[3, 6], [0, 5]]}], ValueError,
                          r"chunks \[\(0, 4\), \(0, 5\)\] and \[\(3, 6\), \(0, 5\)\] of 'w' "
                          r"overlap"),
    "the chunk twice": (lambda f: [{"file": f, "index": _whole(W.shape)}] * 2, ValueError,
                        "of 'w' overlap"),
    "a missing file": (lambda f: [{"file": "rank_99.safetensors", "index": _whole(W.shape)}],
                       FileNotFoundError, r"rank_99.safetensors is missing; metadata.json "
                                          r"places the chunk \[\(0, 7\), \(0, 5\)\] of 'w'"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_CHUNKS))
def test_incomplete_or_inconsistent_chunks_fail_on_every_rank(ckdir, comm, broken):
    """A checkpoint whose metadata lists no chunks, chunks that do not cover the tensor,
    overlapping chunks or a chunk in a missing file: loading raises on every rank (into a dense
    target, where every rank reads every chunk, the same clear error; into a sharded one the
    ranks whose piece is affected name it and the others name those ranks) and leaves the
    target unchanged, never loading memory no chunk wrote."""
    edit, exc, msg = BROKEN_CHUNKS[broken]
    dt.save_state_dict({"w": dt.to_tensor(W)}, ckdir)
    if comm.rank == 0:
        meta = os.path.join(ckdir, "metadata.json")
        with open(meta) as f:
            md = json.load(f)
        (chunk,) = md["tensors"]["w"]["chunks"]
        md["tensors"]["w"]["chunks"] = edit(chunk["file"])
        with open(meta, "w") as f:
            json.dump(md, f)
    comm.barrier()
    dense = {"w": dt.full(list(W.shape), 3.0, dtype="float64")}
    with pytest.raises(exc, match=msg):
        dt.load_state_dict(dense, ckdir)
    np.testing.assert_array_equal(dense["w"].numpy(), np.full(W.shape, 3.0))
    mesh = grid()
    sharded = {"w": dt.shard_tensor(np.full(W.shape, 3.0), mesh, [Shard(0), Replicate()])}
    with pytest.raises((exc, RuntimeError)) as info:
        dt.load_state_dict(sharded, ckdir)
    if info.type is RuntimeError:
        assert "load_state_dict: failed on rank(s)" in str(info.value)
    else:
        assert re.search(msg, str(info.value)) or "of 'w' overlap" in str(info.value) or \
            "incomplete" in str(info.value) or "holds 'w' as" in str(info.value), \
            str(info.value)  # (last: a rank whose rows are covered finds the file disagree)
    np.testing.assert_array_equal(sharded["w"].numpy(), np.full(W.shape, 3.0))


def test_saving_again_replaces_the_checkpoint_atomically(ckdir, comm):
    mesh = grid()
    dt.save_state_dict({"w": dt.shard_tensor(W, mesh, [Shard(0), Replicate()])}, ckdir)
    dt.save_state_dict({"w": dt.shard_tensor(2 * W, mesh, [Replicate(), Shard(1)])}, ckdir)
    comm.barrier()
    assert not os.path.exists(ckdir + ".tmp") and not os.path.exists(ckdir + ".old")
    t = {"w": dt.to_tensor(np.zeros_like(W))}
    dt.load_state_dict(t, ckdir)
    np.testing.assert_array_equal(t["w"].numpy(), 2 * W)
