"""The fault matrix (issue 11): a fault on rank 1 of a 4-rank training job, under plain
``mpiexec -n 4`` and under ``python -m launch --nproc 4``. Every case must end the job with a
non-zero status within 10 s of the fault (within the watchdog timeout plus 10 s where only the
timeout can tell), with a report naming rank 1 and what it did; the clean run, and a run whose
step 1 has a bad label in rank 1's rows (the error is raised on every rank, which all skip the
batch), must end with status 0 and the loss numpy gives."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from launch import find_mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = find_mpiexec()
UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))
TIMEOUT = 4  # DISTTENSOR_TIMEOUT for these jobs

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found"),
    pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec jobs; run outside MPI"),
]

# fault -> (a regex the report must match, whether only the watchdog timeout can detect it)
FAULTS = {
    "raise_before_init": ("RuntimeError: fault raise_before_init", False),
    "raise_forward": ("RuntimeError: fault raise_forward", False),
    "raise_backward": ("RuntimeError: fault raise_backward", False),
    "raise_optimizer": ("RuntimeError: fault raise_optimizer", False),
    "exit3": ("rank 1 exited with status 3", False),
    "exit0": (r"rank 1 exited \(status 0\)", False),
    # its last loss.numpy() meets the others' next step: reported as a mismatch
    "one_step_fewer": ("rank 1 called a different collective", False),
    "sigkill": ("signal 9", False),
    "segfault": ("Segmentation fault(.|\\n)*fault_job.py", False),
    "blocked": ("rank 1 did not arrive", True),
    "numpy_one_rank": (r"rank 1 called a different collective(.|\n)*Tensor.numpy\(\), "
                       "which is a collective", False),
    "dtype_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: shape \[8, 16\] dtype float32", False),
    "shape_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: shape \[6, 16\]", False),
    "placement_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: .*\[Replicate\(\), Replicate\(\)\]",
                           False),
    "swapped_collectives": ("rank 1 called a different collective(.|\n)*rank 1: all_reduce.*op=max", False),
}


def numpy_loss(skipped: tuple[int, ...] = ()) -> float:
    """The clean run's final loss, from numpy alone (SGD, lr 0.1, mean cross entropy), with
    the steps ``skipped`` making no update."""
    rng = np.random.default_rng(0)
    X, W, y = rng.random((8, 16)), rng.random((16, 6)), rng.integers(0, 6, (8,))
    for step in range(3):
        if step in skipped:
            continue
        z = X @ W
        a = np.maximum(z, 0)
        e = np.exp(a - a.max(1, keepdims=True))
        p = e / e.sum(1, keepdims=True)
        loss = -np.log(p[np.arange(8), y]).mean()
        d = p.copy()
        d[np.arange(8), y] -= 1
        W = W - 0.1 * X.T @ ((d / 8) * (z > 0))
    return float(loss)


def run(tmp_path, fault: str, how: str, **extra_env):
    env = dict(os.environ, **extra_env, FAULT=fault, FAULT_RANK="1", DISTTENSOR_TIMEOUT=str(TIMEOUT),
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = os.path.join(HERE, "fault_job.py")
    if how == "mpiexec":
        cmd = [MPIEXEC, "-n", "4", sys.executable, job]
    else:
        cmd = [sys.executable, "-m", "launch", "--nproc", "4", "--log-dir", str(tmp_path / "logs"), job]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120, env=env, cwd=str(tmp_path))
    end = time.time()
    marker = tmp_path / "fault_time"
    since = end - float(marker.read_text()) if marker.exists() else None
    return r, since


@pytest.mark.parametrize("how", ["mpiexec", "launch"])
@pytest.mark.parametrize("fault", ["none", "caught_label_error"])
def test_clean_run(tmp_path, fault, how):
    """A clean run, and one whose step 1 has a label out of range in rows held by ranks 0 and 1
    only: the label check raises on every rank, every rank skips that step, and the job ends
    with status 0 and numpy's loss without that step's update."""
    r, _ = run(tmp_path, fault, how)
    assert r.returncode == 0, r.stdout
    # ranks' lines may interleave
    losses = [float(v) for v in re.findall(r"final loss (-?[0-9.]+)", r.stdout)]
    expect = numpy_loss((1,) if fault == "caught_label_error" else ())
    assert len(losses) == 4 and all(abs(v - expect) < 1e-5 for v in losses), r.stdout
    if fault == "caught_label_error":
        skips = re.findall(r"rank \d skips a bad batch: cross_entropy: label value 99 is out of "
                           r"range \[0, 6\) \(ignore_index=-100\)", r.stdout)
        assert len(skips) == 4, r.stdout


@pytest.mark.parametrize("how", ["mpiexec", "launch"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_ends_job(tmp_path, fault, how):
    text, timeout_case = FAULTS[fault]
    r, since = run(tmp_path, fault, how)
    out = r.stdout
    assert r.returncode != 0, out
    assert "final loss" not in out, out
    assert since is not None, "the fault was never injected:\n" + out
    assert since < (TIMEOUT + 10 if timeout_case else 10), f"ended {since:.1f} s after the fault\n{out}"
    assert re.search(text, out), out
    if how == "launch":
        assert "launch: rank 1 failed" in out, out


def test_debug_mode_finds_ranks_holding_different_replicated_data(tmp_path):
    """DISTTENSOR_CHECK_COLLECTIVES=1 compares a checksum of shard_tensor's data."""
    r, since = run(tmp_path, "unseeded_data", "mpiexec", DISTTENSOR_CHECK_COLLECTIVES="1")
    assert r.returncode != 0 and since < 10, r.stdout
    assert re.search(r"shard_tensor: ranks disagree(.|\n)*data crc32", r.stdout), r.stdout
