"""A small data- and tensor-parallel training loop on a 2 x 2 mesh with one fault injected on
rank ``FAULT_RANK`` (env ``FAULT``, see ``FAULTS`` in test_fault_matrix.py). Before the fault
it writes the time to ``fault_time`` in the working directory; a clean run prints the loss.
Once MPI is up, each rank writes the MPI library's shared-memory files it maps to
``segments.<rank>`` (the test checks that exactly those are gone when the job has ended)."""
import ctypes
import os
import signal
import sys
import time

import numpy as np

FAULT = os.environ.get("FAULT", "none")
BAD = int(os.environ.get("FAULT_RANK", "1"))
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
STEPS = 3


def hit(name: str, step: int | None = None, at: int = 1) -> bool:
    if FAULT != name or RANK != BAD or (step is not None and step != at):
        return False
    with open("fault_time", "w") as f:
        f.write(f"{time.time()}\n")
    return True


import disttensor as dt  # noqa: E402
from collectives._watcher import mpi_segments  # noqa: E402
from disttensor import ProcessMesh, Replicate, Shard  # noqa: E402

if hit("raise_before_init"):
    raise RuntimeError("fault raise_before_init")
dt.init_parallel_env()
with open(f"segments.{RANK}", "w") as f:
    f.write("".join(p + "\n" for p in mpi_segments()))
mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
rng = np.random.default_rng(0)
X = rng.random((8, 16))
W = rng.random((16, 6))
LABELS = rng.integers(0, 6, (8,))

x_data, x_pl = X, [Shard(0), Replicate()]
if FAULT == "unseeded_data":  # every rank draws its own "global" array (debug mode finds it)
    hit("unseeded_data", None)
    x_data = np.random.default_rng(RANK if RANK != BAD else 100).random((8, 16))
    x_pl = [Replicate(), Replicate()]
if hit("dtype_disagree"):
    x_data = X.astype(np.float32)
if hit("shape_disagree"):
    x_data = X[:6]
if hit("placement_disagree"):
    x_pl = [Replicate(), Replicate()]

w = dt.shard_tensor(W, mesh, [Replicate(), Shard(1)], stop_gradient=False)
opt = dt.optimizer.SGD(0.1, parameters=[w])
if FAULT == "raise_backward" and RANK == BAD:
    relu = dt.ops.OPS["relu"]

    def failing_backward(node, g):
        hit("raise_backward")
        raise RuntimeError("fault raise_backward")
    relu.backward = failing_backward
if FAULT == "raise_optimizer" and RANK == BAD:
    def failing_update(*args, **kwargs):
        hit("raise_optimizer")
        raise RuntimeError("fault raise_optimizer")
    opt._update = failing_update

steps = STEPS - 1 if FAULT == "one_step_fewer" and RANK == BAD else STEPS
for step in range(steps):
    x = dt.shard_tensor(x_data, mesh, x_pl)
    logits = dt.matmul(x, w).relu()
    if hit("raise_forward", step):
        raise RuntimeError("fault raise_forward")
    labels = LABELS.copy()
    if FAULT == "caught_label_error" and step == 1:  # a bad batch: row 0 is on ranks 0 and 1
        hit("caught_label_error", step)
        labels[0] = 99
    try:
        # the mean of per-row losses, a Partial(sum) over dp: loss.numpy() is a collective
        # (F.cross_entropy's own mean is replicated: its .numpy() would be local)
        loss = dt.nn.functional.cross_entropy(logits, dt.to_tensor(labels),
                                              reduction="none").mean()
    except ValueError as e:
        print(f"rank {RANK} skips a bad batch: {e}", flush=True)
        continue
    loss.backward()
    opt.step()
    opt.clear_grad()
    if hit("exit3", step):
        sys.exit(3)
    if hit("exit0", step):
        sys.exit(0)
    if hit("sigkill", step):
        os.kill(os.getpid(), signal.SIGKILL)
    if hit("segfault", step):
        ctypes.string_at(0)
    if hit("os_exit3", step):
        os._exit(3)
    if hit("mpi_abort", step):  # MPI's own abort, not the runtime's
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(7)
    if hit("blocked", step):
        time.sleep(3600)
    if hit("numpy_one_rank", step):
        print("loss", loss.numpy(), flush=True)
    if FAULT == "stray_numpy" and step == 1:  # one rank prints the loss, the others the logits
        hit("stray_numpy", step)
        print(f"rank {RANK} value", (loss if RANK == BAD else logits).numpy(), flush=True)
    if FAULT == "stray_numpy_barrier" and step == 1:  # one rank gathers, the others wait
        hit("stray_numpy_barrier", step)
        if RANK == BAD:
            print(f"rank {RANK} value", logits.numpy(), flush=True)
        else:
            dt.barrier()
    if FAULT == "swapped_collectives" and step == 1:
        hit("swapped_collectives", step)
        t = dt.to_tensor(np.ones(4))
        dt.all_reduce(t, op=dt.ReduceOp.MAX if RANK == BAD else dt.ReduceOp.SUM)
hit("one_step_fewer")  # rank 1's last loss.numpy() meets the others' next step
print(f"rank {RANK} final loss {float(loss.numpy()):.6f}", flush=True)
if FAULT == "os_exit_all":  # every rank leaves without Python's exit path, status 0
    dt.barrier()  # together: hydra SIGKILLs the ranks still running once one leaves unfinalized
    os._exit(0)
