"""Checkpoints across world sizes (saved on 4 ranks as 2 x 2, loaded on 3 ranks as [3] and on
one process; saved on one process, loaded on 4 ranks), and a save killed with SIGKILL, each as
separate jobs started from here (outside MPI)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import collectives
import disttensor as dt
from launch import find_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = find_mpiexec()

pytestmark = pytest.mark.skipif(collectives.is_mpi(),
                                reason="starts its own jobs; run outside MPI")

# The job: save or load {"w": W, "v": V, "opt": {"m": M}, "step": 11} with the layout asked for.
JOB = textwrap.dedent("""
    import sys
    import numpy as np
    import disttensor as dt
    from disttensor import Replicate, Shard

    mode, path, layout = sys.argv[1:4]
    dt.init_parallel_env()
    n = dt.get_world_size()
    W = np.random.default_rng(0).standard_normal((7, 5))
    V = np.arange(10, dtype=np.float32)
    M = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    if layout == "dense":
        place = lambda a, *_: dt.to_tensor(a)
        pw = pv = pm = None
    else:
        mesh = {"2x2": dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"]),
                "line": dt.ProcessMesh(list(range(n)), dim_names=["x"])}[layout]
        place = lambda a, pl: dt.shard_tensor(a, mesh, pl)
        pw, pv, pm = ({"2x2": ([Shard(0), Shard(1)], [Replicate(), Shard(0)],
                               [Shard(1), Replicate()]),
                       "line": ([Shard(1)], [Shard(0)], [Replicate()])}[layout])
    if mode == "save":
        dt.save_state_dict({"w": place(W, pw), "v": place(V, pv), "opt": {"m": place(M, pm)},
                            "step": 11}, path)
    else:
        state = {"w": place(np.zeros_like(W), pw), "v": place(np.zeros_like(V), pv),
                 "opt": {"m": place(np.zeros_like(M), pm)}, "step": 0}
        dt.load_state_dict(state, path)
        np.testing.assert_array_equal(state["w"].numpy(), W)
        np.testing.assert_array_equal(state["v"].numpy(), V)
        np.testing.assert_array_equal(state["opt"]["m"].numpy(), M)
        assert state["step"] == 11
        if layout != "dense":
            assert state["w"].placements == pw
        print(f"rank {dt.get_rank()} of {n}: loaded", flush=True)
""")


def _run(tmp_path, n, *args, timeout=90):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(script), *args]
    if n > 1:
        cmd = [MPIEXEC, "-n", str(n)] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_saved_on_4_ranks_as_2x2_loads_on_3_ranks_and_on_one_process(tmp_path):
    ck = str(tmp_path / "ck")
    _run(tmp_path, 4, "save", ck, "2x2")
    files = sorted(f for f in os.listdir(ck) if f.endswith(".safetensors"))
    assert files == [f"rank_{r:05d}.safetensors" for r in range(4)]
    assert _run(tmp_path, 3, "load", ck, "line").count("loaded") == 3
    assert _run(tmp_path, 1, "load", ck, "dense").count("loaded") == 1
    assert _run(tmp_path, 1, "load", ck, "line").count("loaded") == 1


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_saved_on_one_process_loads_on_4_ranks(tmp_path):
    ck = str(tmp_path / "ck")
    _run(tmp_path, 1, "save", ck, "dense")
    assert sorted(os.listdir(ck)) == ["metadata.json", "rank_00000.safetensors"]
    assert _run(tmp_path, 4, "load", ck, "2x2").count("loaded") == 4


KILLED = textwrap.dedent("""
    import sys, time
    import numpy as np
    import disttensor as dt
    from disttensor.checkpoint import state_dict as ckpt

    path = sys.argv[1]
    dt.save_state_dict({"w": dt.to_tensor(np.full((64, 64), 1.0)), "step": 1}, path)
    real = ckpt.write_file

    def write_then_hang(*args, **kwargs):      # the data file is written, the commit is not
        real(*args, **kwargs)
        print("PAUSED", flush=True)
        time.sleep(120)

    ckpt.write_file = write_then_hang
    dt.save_state_dict({"w": dt.to_tensor(np.full((64, 64), 2.0)), "step": 2}, path)
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    ck = str(tmp_path / "ck")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, str(script), ck], stdout=subprocess.PIPE, text=True,
                         env=env)
    try:
        assert p.stdout.readline().strip() == "PAUSED"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    assert os.path.isdir(ck + ".tmp"), "the kill came in the middle of the save"

    state = {"w": dt.to_tensor(np.zeros((64, 64))), "step": 0}
    dt.load_state_dict(state, ck)
    np.testing.assert_array_equal(state["w"].numpy(), 1.0)
    assert state["step"] == 1

    # the next save clears the leftovers and commits
    dt.save_state_dict({"w": dt.to_tensor(np.full((64, 64), 3.0)), "step": 3}, ck)
    assert not os.path.exists(ck + ".tmp")
    dt.load_state_dict(state, ck)
    assert state["step"] == 3 and float(state["w"].numpy()[0, 0]) == 3.0


def test_a_crash_between_the_two_renames_is_recovered(tmp_path):
    ck = str(tmp_path / "ck")
    dt.save_state_dict({"step": 1, "w": dt.to_tensor(np.ones(3))}, ck)
    os.rename(ck, ck + ".old")           # the state a crash between the renames leaves
    state = {"step": 0, "w": dt.to_tensor(np.zeros(3))}
    dt.load_state_dict(state, ck)
    assert state["step"] == 1
    dt.save_state_dict({"step": 2, "w": dt.to_tensor(np.ones(3))}, ck)
    assert not os.path.exists(ck + ".old")
    dt.load_state_dict(state, ck)
    assert state["step"] == 2


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a checkpoint"):
        dt.save_state_dict({"step": 1}, str(d))
    assert (d / "notes.txt").read_text() == "keep me"


def test_large_pieces_are_written_in_row_blocks(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from disttensor.checkpoint import state_dict as ckpt

    monkeypatch.setattr(ckpt, "_BLOCK_BYTES", 64)      # 1 or 2 rows per block
    mesh = dt.ProcessMesh([0], dim_names=["x"])
    a = np.random.default_rng(0).standard_normal((37, 5))
    b = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    ck = str(tmp_path / "ck")
    dt.save_state_dict({"a": dt.shard_tensor(a, mesh, [dt.Shard(1)]), "b": dt.to_tensor(b),
                        "s": dt.to_tensor(np.float32(3.5))}, ck)
    saved = load_file(os.path.join(ck, "rank_00000.safetensors"))
    np.testing.assert_array_equal(saved["a"], a)
    np.testing.assert_array_equal(saved["b"], b)
    assert saved["s"].shape == () and saved["s"] == np.float32(3.5)
