"""The fault matrix: a fault on rank 1 of a 4-rank training job, under plain
``mpiexec -n 4`` and under ``python -m launch --nproc 4``. Every case must end the job with a
non-zero status within 10 s of the fault (within the watchdog timeout plus 10 s where only the
timeout can tell), with a report naming rank 1 and what it did; the clean run, and a run whose
step 1 has a bad label in rank 1's rows (the error is raised on every rank, which all skip the
batch), must end with status 0 and the loss numpy gives.

Under plain mpiexec a rank that dies outside Python (SIGKILL, segfault, ``os._exit``) is named by
its watcher process (collectives/_watcher.py) in one line; no other case may print that line,
and no watcher may outlive its job. No job may leave MPI's shared-memory files in /dev/shm.

Each test looks only at its own job's processes and files (its watchers carry the job's id in
their environment; its ranks list the shared-memory files they map), so the matrix passes while
other MPI jobs run on the machine."""
import os
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from launch import find_mpiexec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MPIEXEC = find_mpiexec()
UNDER_MPI = any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                          "PMIX_RANK"))
TIMEOUT = 4  # DISTTENSOR_TIMEOUT for these jobs
STALL = 2  # DISTTENSOR_STALL_TIMEOUT for these jobs

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
    "os_exit3": ("rank 1 .*(exit status 3|exited with status 3)", False),
    "blocked": ("rank 1 did not arrive", True),
    "numpy_one_rank": (r"rank 1 called a different collective(.|\n)*Tensor.numpy\(\), "
                       "which is a collective", False),
    "dtype_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: shape \[8, 16\] dtype float32",
                       False),
    "shape_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: shape \[6, 16\]", False),
    "placement_disagree": (r"rank\(s\) \[1\] differ(.|\n)*rank 1: .*\[Replicate\(\), "
                           r"Replicate\(\)\]",
                           False),
    "swapped_collectives": ("rank 1 called a different collective(.|\n)*rank 1: all_reduce.*op=max",
                            False),
    # rank 1 prints loss.numpy(), the others logits.numpy(): every rank of the group raises
    # before data moves
    "stray_numpy": (r"rank 1 called a different collective than other ranks of group \[1, 3\] "
                    r"as call #\d+; no data was exchanged(.|\n)*"
                    r"rank 1: all_reduce\(shape=\(\), .*fault_job.py:\d+ in <module> \(through "
                    r"Tensor.numpy\(\)(.|\n)*rank 3: all_gather\(.*fault_job.py:\d+ in <module>",
                    False),
    # rank 1 gathers the logits, the others wait in barrier(): the stall probe finds a deadlock
    "stray_numpy_barrier": (r"rank 1 is in another collective than the ranks it waits for(.|\n)*"
                            r"rank 0: in barrier\(\) .*fault_job.py(.|\n)*rank 1: in all_gather"
                            r"\(.*\(through Tensor.numpy\(\)(.|\n)*rank 2: in barrier\(\)", False),
}
# faults whose report every rank of the mismatched group prints (traceback or one line)
RAISED_ON = {"stray_numpy": (1, 3)}


# what a rank's watcher prints under plain mpiexec for a rank that died outside Python
WATCHER_LINE = (r"\[disttensor\] job aborted: rank (\d+) \(pid \d+ on host \S+\) (.*); (.*) were "
                r"stopped because of it")
WATCHED = {  # fault -> how rank 1's death is described
    "sigkill": r"was killed by signal 9 \(SIGKILL\)",
    "segfault": r"was killed by signal 11 \(SIGSEGV\)",
    "os_exit3": r"exited with status 3 outside Python's exit path",
}
WATCHER_SCRIPT = os.path.join(ROOT, "collectives", "_watcher.py")


def live_watchers(job: str) -> set[int]:
    """Pids of running watcher processes of job ``job`` (its ``FAULT_JOB`` environment)."""
    pids, mark = set(), f"FAULT_JOB={job}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if WATCHER_SCRIPT.encode() not in f.read():
                        continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.add(int(name))
            except OSError:
                pass
    return pids


def job_segments(workdir) -> set[str]:
    """The MPI library's shared-memory files the job's ranks mapped (each lists its own once
    MPI is up; MPI_Finalize removes them, after an abort or a rank's death the runtime must)."""
    return {line for p in workdir.glob("segments.*") for line in p.read_text().split()}


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
    job_id = uuid.uuid4().hex
    env = dict(os.environ, **extra_env, FAULT=fault, FAULT_RANK="1",
               DISTTENSOR_TIMEOUT=str(TIMEOUT),
               DISTTENSOR_STALL_TIMEOUT=str(STALL), FAULT_JOB=job_id,
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = os.path.join(HERE, "fault_job.py")
    if how == "mpiexec":
        cmd = [MPIEXEC, "-n", "4", sys.executable, job]
    else:
        cmd = [sys.executable, "-m", "launch", "--nproc", "4", "--log-dir", str(tmp_path / "logs"),
               job]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120, env=env, cwd=str(tmp_path))
    end = time.time()
    # after an MPI_Abort mpiexec returns without waiting for the killed ranks and their watchers
    # (each exits within GRACE + 1 s of its rank; 10 s covers a loaded, oversubscribed machine)
    give_up = time.monotonic() + 10
    while live_watchers(job_id) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not live_watchers(job_id), "a watcher outlived its job:\n" + r.stdout
    left = {p for p in job_segments(tmp_path) if os.path.exists(p)}
    assert not left, f"the job left MPI shared-memory files {sorted(left)}:\n" + r.stdout
    marker = tmp_path / "fault_time"
    since = end - float(marker.read_text()) if marker.exists() else None
    return r, since


@pytest.mark.parametrize("fault,how", [
    (f, h) for f in ("none", "caught_label_error") for h in ("mpiexec", "launch")
] + [("os_exit_all", "mpiexec")])  # (launch's wrappers leave MPI one by one: hydra kills the rest)
def test_clean_run(tmp_path, fault, how):
    """A clean run; one whose step 1 has a label out of range in rows held by ranks 0 and 1
    only: the label check raises on every rank, every rank skips that step, and the job ends
    with status 0 and numpy's loss without that step's update; and one whose ranks all leave
    by ``os._exit(0)`` after the last step. None prints a failure report."""
    r, _ = run(tmp_path, fault, how)
    assert r.returncode == 0, r.stdout
    assert "[disttensor]" not in r.stdout, r.stdout
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
    assert not re.search(r"rank \d final loss -?[0-9]", out), out  # (a traceback may show the line)
    assert since is not None, "the fault was never injected:\n" + out
    assert since < (TIMEOUT + 10 if timeout_case else 10), \
        f"ended {since:.1f} s after the fault\n{out}"
    assert re.search(text, out), out
    if how == "launch":
        assert "launch: rank 1 failed" in out, out
    assert not re.search(r"rank [13] value", out), out  # no value from a stray collective
    for rank in RAISED_ON.get(fault, ()):
        assert re.search(rf"(unhandled exception on rank {rank} |\[disttensor\] rank {rank}: "
                         rf"aborted; rank \d failed with the same error)", out), out
    watched = re.findall(WATCHER_LINE, out)
    if how == "mpiexec" and fault in WATCHED:  # named by rank, once, the others as stopped
        assert len(watched) == 1 and watched[0][0] == "1", out
        assert re.match(WATCHED[fault], watched[0][1]), out
        assert watched[0][2] == "ranks [0, 2, 3]", out
        assert len(re.findall(r"\[disttensor\] job aborted", out)) == 1, out
    else:  # the runtime's own report, or launch's, and no watcher line
        assert not watched, out


def test_mpi_abort_is_not_blamed_on_a_rank_by_the_watchers(tmp_path):
    """``MPI_Abort`` called by the program itself (not through the runtime): MPI's own line
    names the rank; the watchers of the ranks MPI killed stay silent."""
    r, since = run(tmp_path, "mpi_abort", "mpiexec")
    assert r.returncode != 0 and since is not None and since < 10, r.stdout
    assert "MPI_Abort(MPI_COMM_WORLD, 7) - process 1" in r.stdout, r.stdout
    assert not re.findall(WATCHER_LINE, r.stdout), r.stdout


def test_debug_mode_finds_ranks_holding_different_replicated_data(tmp_path):
    """DISTTENSOR_CHECK_COLLECTIVES=1 compares a checksum of shard_tensor's data."""
    r, since = run(tmp_path, "unseeded_data", "mpiexec", DISTTENSOR_CHECK_COLLECTIVES="1")
    assert r.returncode != 0 and since < 10, r.stdout
    assert re.search(r"shard_tensor: ranks disagree(.|\n)*data crc32", r.stdout), r.stdout
