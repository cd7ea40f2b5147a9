"""train.py's GPT training step: disttensor (eager) against the same step written by hand in
numpy + mpi4py, against PyTorch on CPU and against PyTorch's DTensor tensor parallelism (plus
DDP) where torch is installed, all in one run.

    python benchmarks/gpt.py [--sizes tiny,medium,large] [--configs 1,2x1,1x2,2x2]
                             [--steps 6] [--warmup 2] [--bucket-mb 25]

Sizes: ``tiny`` is train.py's default GPT (vocab 64, seq 16, d 32, 4 heads, 2 layers, batch 16);
``medium`` d = 512 and ``large`` d = 1024 (vocab 64, seq 32, 2 layers, d/64 heads, batch 8).
Configs: ``1`` one process (disttensor dense, and on a 1 x 1 mesh); ``DPxMP`` a [dp, mp] mesh
under ``mpiexec -n dp*mp`` with train.py's Megatron-style placements (vocab-parallel embedding
and head, column q/k/v/fc1, row proj/fc2, batch on dp). Each config runs in its own process(es);
rank 0 prints one JSON line that this driver collects.

Per size and config: the median time of a step (forward, cross entropy, backward, AdamW; every
rank in step, BLAS single-threaded) after ``warmup`` steps, on two clocks (``wall``; ``cpu``:
rank 0's process CPU time, which other load on a shared machine disturbs less), for

* ``disttensor``: ``train.train_step`` on the sharded model (``mesh``: gradient buckets of
  ``--bucket-mb`` whose all-reduces overlap the backward); with dp > 1 also
  ``mesh_blocking`` (the same buckets, all started after the backward) and
  ``mesh_per_parameter`` (no buckets: one blocking all-reduce per gradient), the three taking
  turns step by step on one model (they compute the same values);
* ``numpy``: the same model, step and sharding written by hand: numpy kernels, mpi4py
  all-reduces for the Megatron partial sums, the vocab-parallel softmax and the dp gradients;
* ``torch`` (one process): the same model written with torch ops (autograd, AdamW);
* ``dtensor`` (meshes): the same model as a torch module on a [dp, mp] ``DeviceMesh`` (gloo,
  initialised from the MPI launcher's PMI_RANK / PMI_SIZE, MASTER_ADDR 127.0.0.1), made
  tensor-parallel over mp by DTensor's ``parallelize_module`` with train.py's plan
  (``RowwiseParallel`` embedding, ``ColwiseParallel`` q/k/v/fc1 and head, ``RowwiseParallel``
  proj/fc2, vocab-parallel cross entropy under ``loss_parallel``) when mp > 1, and
  data-parallel over dp by DDP (PyTorch's TP + DDP composition; 25 MB buckets, overlapped)
  when dp > 1;

torch columns are absent, with a note, when torch is not installed (an optional ``bench``
extra). ``ratio_<run>_vs_<baseline>`` = disttensor / baseline; ``overlap_vs_blocking`` and
``overlap_vs_per_parameter`` compare disttensor's gradient syncs. All runs start from the same
weights and see the same batches; ``loss_max_rel_diff`` compares their losses step by step.
On a 2-core machine the 4-rank configs oversubscribe the cores: compare ratios, not times.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository first (benchmarks/collectives.py must not shadow the collectives package)
sys.path[0:0] = [_ROOT, os.path.join(_ROOT, "examples")]

SIZES = {  # vocab, seq, d, heads, layers, batch
    "tiny": (64, 16, 32, 4, 2, 16),
    "medium": (64, 32, 512, 8, 2, 8),
    "large": (64, 32, 1024, 16, 2, 8),
}
LR, WD, BETA1, BETA2, EPS = 3e-3, 0.01, 0.9, 0.999, 1e-8
LN_EPS = 1e-5
GELU_C, GELU_A = math.sqrt(2.0 / math.pi), 0.044715


# -- the step by hand: numpy + mpi4py --------------------------------------------------------------

class HandGPT:
    """train.py's GPT on this rank's pieces of a [dp, mp] mesh, forward/backward/AdamW by hand.

    ``params``: the global weights by train.py's parameter names; this rank keeps its Megatron
    piece of each (column weights split on dim 1 with their biases, row weights on dim 0, the
    embedding and head on the vocabulary)."""

    def __init__(self, params: dict, cfg: tuple, dp: int, mp: int, comm):
        self.vocab, self.seq, self.d, self.heads, self.layers, _ = cfg
        self.dp, self.mp = dp, mp
        rank = comm.Get_rank() if comm is not None else 0
        self.dpi, self.mpi = divmod(rank, mp)
        self.mp_comm = comm.Split(self.dpi, self.mpi) if comm is not None and mp > 1 else None
        self.dp_comm = comm.Split(self.mpi, self.dpi) if comm is not None and dp > 1 else None
        self.p = {name: self._piece(name, a) for name, a in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.t = 0
        self.mask = np.triu(np.full((self.seq, self.seq), -1e9, np.float32), k=1)
        self.v0 = self.mpi * (self.vocab // mp)

    def _piece(self, name: str, a: np.ndarray) -> np.ndarray:
        leaf, kind = name.split(".")[-2:]
        j, n = self.mpi, self.mp
        if leaf in ("q", "k", "v", "fc1") or leaf == "head":
            cut = 1 if kind == "weight" else 0  # column weight, its bias on dim 0
        elif leaf in ("wte", "proj", "fc2") and kind == "weight":
            cut = 0
        else:
            return a.copy()
        size = a.shape[cut] // n
        return np.ascontiguousarray(np.take(a, np.arange(j * size, (j + 1) * size), axis=cut))

    def _allreduce(self, comm, a: np.ndarray, op=None) -> np.ndarray:
        if comm is not None:
            from mpi4py import MPI
            comm.Allreduce(MPI.IN_PLACE, a, op=op or MPI.SUM)
        return a

    # layer pieces ----------------------------------------------------------------------------
    @staticmethod
    def _ln(x, w, b):
        mean = x.mean(-1, keepdims=True)
        xc = x - mean
        rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + LN_EPS)
        xhat = xc * rstd
        return xhat * w + b, (xhat, rstd)

    @staticmethod
    def _ln_bwd(dy, w, cache):
        xhat, rstd = cache
        dxhat = dy * w
        dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True)
                     - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        rows = dy.reshape(-1, dy.shape[-1])
        return dx, (xhat.reshape(rows.shape) * rows).sum(0), rows.sum(0)

    @staticmethod
    def _lin(x, w, b=None):
        y = (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],))
        return y + b if b is not None else y

    @staticmethod
    def _lin_bwd(dy, x, w):
        """(dx, dw, db) of y = x @ w + b: the weight gradient as one GEMM over all rows."""
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ w.T).reshape(x.shape)
        return dx, x2.T @ dy2, dy2.sum(0)

    def step(self, tokens: np.ndarray, labels: np.ndarray) -> float:
        """One training step on this rank's batch rows; returns the global mean loss."""
        p, mp = self.p, self.mp_comm
        b, s = tokens.shape
        d, hl = self.d, self.heads // self.mp
        hd = d // self.heads
        # embeddings: vocab-parallel lookup, summed over mp
        local = tokens - self.v0
        hit = (local >= 0) & (local < p["wte.weight"].shape[0])
        safe = np.where(hit, local, 0)
        h = p["wte.weight"][safe] * hit[..., None]
        h = self._allreduce(mp, h) + p["wpe.weight"][:s]
        caches = []
        for i in range(self.layers):
            pre = f"blocks.{i}."
            a, ln1 = self._ln(h, p[pre + "ln1.weight"], p[pre + "ln1.bias"])
            qkv = [self._lin(a, p[pre + f"attn.{n}.weight"], p[pre + f"attn.{n}.bias"])
                   .reshape(b, s, hl, hd).transpose(0, 2, 1, 3) for n in "qkv"]
            q, k, v = qkv
            att = q @ k.transpose(0, 1, 3, 2) * (1.0 / math.sqrt(hd)) + self.mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            y = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, hl * hd)
            o = self._allreduce(mp, self._lin(y, p[pre + "attn.proj.weight"]))
            h = h + o + p[pre + "attn.proj.bias"]
            a2, ln2 = self._ln(h, p[pre + "ln2.weight"], p[pre + "ln2.bias"])
            f = self._lin(a2, p[pre + "fc1.weight"], p[pre + "fc1.bias"])
            t = np.tanh(GELU_C * (f + GELU_A * f * f * f))
            g = 0.5 * f * (1.0 + t)
            o2 = self._allreduce(mp, self._lin(g, p[pre + "fc2.weight"]))
            h = h + o2 + p[pre + "fc2.bias"]
            caches.append((a, ln1, q, k, v, att, y, a2, ln2, f, t, g))
        af, lnf = self._ln(h, p["ln.weight"], p["ln.bias"])
        logits = self._lin(af, p["head.weight"])
        # vocab-parallel cross entropy, mean over every token of the global batch
        from mpi4py import MPI
        m = self._allreduce(mp, logits.max(-1, keepdims=True), MPI.MAX if mp else None)
        e = np.exp(logits - m)
        ssum = self._allreduce(mp, e.sum(-1, keepdims=True))
        llocal = labels - self.v0
        lhit = (llocal >= 0) & (llocal < logits.shape[-1])
        picked = np.take_along_axis(logits, np.where(lhit, llocal, 0)[..., None], -1)[..., 0]
        picked = self._allreduce(mp, picked * lhit)
        n_tok = b * s * self.dp
        loss = np.array([(np.log(ssum[..., 0]) + m[..., 0] - picked).sum() / n_tok])
        loss = float(self._allreduce(self.dp_comm, loss)[0])
        # backward
        grads = {}
        dlogits = e / ssum
        rows = np.nonzero(lhit.reshape(-1))[0]
        dl2 = dlogits.reshape(-1, dlogits.shape[-1])
        dl2[rows, llocal.reshape(-1)[rows]] -= 1.0
        dlogits *= 1.0 / n_tok
        daf, grads["head.weight"], _ = self._lin_bwd(dlogits, af, p["head.weight"])
        daf = self._allreduce(mp, daf)
        dh, grads["ln.weight"], grads["ln.bias"] = self._ln_bwd(daf, p["ln.weight"], lnf)
        for i in reversed(range(self.layers)):
            pre = f"blocks.{i}."
            a, ln1, q, k, v, att, y, a2, ln2, f, t, g = caches[i]
            grads[pre + "fc2.bias"] = dh.reshape(-1, d).sum(0)
            dg, grads[pre + "fc2.weight"], _ = self._lin_bwd(dh, g, p[pre + "fc2.weight"])
            dt_ = 0.5 * (1.0 + t) + 0.5 * f * (1.0 - t * t) * GELU_C * (1.0 + 3 * GELU_A * f * f)
            df = dg * dt_
            da2, grads[pre + "fc1.weight"], grads[pre + "fc1.bias"] = self._lin_bwd(
                df, a2, p[pre + "fc1.weight"])
            da2 = self._allreduce(mp, da2)
            dx, grads[pre + "ln2.weight"], grads[pre + "ln2.bias"] = self._ln_bwd(
                da2, p[pre + "ln2.weight"], ln2)
            dh = dh + dx
            grads[pre + "attn.proj.bias"] = dh.reshape(-1, d).sum(0)
            dy, grads[pre + "attn.proj.weight"], _ = self._lin_bwd(dh, y,
                                                                   p[pre + "attn.proj.weight"])
            dy = dy.reshape(b, s, hl, hd).transpose(0, 2, 1, 3)
            datt = dy @ v.transpose(0, 1, 3, 2)
            dv = att.transpose(0, 1, 3, 2) @ dy
            datt = att * (datt - (datt * att).sum(-1, keepdims=True)) * (1.0 / math.sqrt(hd))
            dq = datt @ k
            dk = datt.transpose(0, 1, 3, 2) @ q
            da = None
            for n, dz in (("q", dq), ("k", dk), ("v", dv)):
                dz = dz.transpose(0, 2, 1, 3).reshape(b, s, hl * hd)
                dpart, grads[pre + f"attn.{n}.weight"], grads[pre + f"attn.{n}.bias"] = \
                    self._lin_bwd(dz, a, p[pre + f"attn.{n}.weight"])
                da = dpart if da is None else da + dpart
            da = self._allreduce(mp, da)
            dx, grads[pre + "ln1.weight"], grads[pre + "ln1.bias"] = self._ln_bwd(
                da, p[pre + "ln1.weight"], ln1)
            dh = dh + dx
        grads["wpe.weight"] = np.zeros_like(p["wpe.weight"])
        grads["wpe.weight"][:s] = dh.sum(0)
        onehot = (safe.reshape(-1)[:, None] == np.arange(p["wte.weight"].shape[0])) \
            & hit.reshape(-1)[:, None]
        grads["wte.weight"] = onehot.astype(np.float32).T @ dh.reshape(-1, d)
        for name in grads:  # data parallel: sum the gradients over dp
            self._allreduce(self.dp_comm, grads[name])
        self._adamw(grads)
        return loss

    def _adamw(self, grads: dict) -> None:
        self.t += 1
        lr_t = LR / (1.0 - BETA1 ** self.t)
        c2 = math.sqrt(1.0 - BETA2 ** self.t)
        for name, g in grads.items():
            p, m, v = self.p[name], self.m[name], self.v[name]
            p *= 1.0 - LR * WD
            m *= BETA1
            m += (1.0 - BETA1) * g
            v *= BETA2
            v += (1.0 - BETA2) * g * g
            p -= lr_t * m / (np.sqrt(v) / c2 + EPS)


# -- the step in torch ------------------------------------------------------------------------

def torch_step_fn(params: dict, cfg: tuple, device: str = "cpu"):
    """(step(tokens, labels) -> loss) for the same model in torch (one CPU thread, or on
    ``device`` "cuda")."""
    import torch
    torch.set_num_threads(1)
    vocab, seq, d, heads, layers, _ = cfg
    hd = d // heads
    p = {k: torch.tensor(v, requires_grad=True, device=device) for k, v in params.items()}
    opt = torch.optim.AdamW(list(p.values()), lr=LR, betas=(BETA1, BETA2), eps=EPS,
                            weight_decay=WD)
    mask = torch.triu(torch.full((seq, seq), -1e9, device=device), diagonal=1)
    fn = torch.nn.functional

    def forward(tokens):
        b, s = tokens.shape
        h = p["wte.weight"][tokens] + p["wpe.weight"][:s]
        for i in range(layers):
            pre = f"blocks.{i}."
            a = fn.layer_norm(h, (d,), p[pre + "ln1.weight"], p[pre + "ln1.bias"], LN_EPS)
            q, k, v = (
                (a @ p[pre + f"attn.{n}.weight"] + p[pre + f"attn.{n}.bias"])
                .reshape(b, s, heads, hd).transpose(1, 2) for n in "qkv")
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask[:s, :s], -1)
            y = (att @ v).transpose(1, 2).reshape(b, s, d)
            h = h + y @ p[pre + "attn.proj.weight"] + p[pre + "attn.proj.bias"]
            a2 = fn.layer_norm(h, (d,), p[pre + "ln2.weight"], p[pre + "ln2.bias"], LN_EPS)
            f = fn.gelu(a2 @ p[pre + "fc1.weight"] + p[pre + "fc1.bias"], approximate="tanh")
            h = h + f @ p[pre + "fc2.weight"] + p[pre + "fc2.bias"]
        a = fn.layer_norm(h, (d,), p["ln.weight"], p["ln.bias"], LN_EPS)
        return a @ p["head.weight"]

    def step(tokens, labels):
        logits = forward(torch.from_numpy(tokens).to(device))
        loss = fn.cross_entropy(logits.reshape(-1, vocab),
                                torch.from_numpy(labels).to(device).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)
    return step


def dtensor_step_fn(params: dict, cfg: tuple, dp: int, mp: int):
    """(step(tokens, labels) -> loss) for the same model as a torch module on this rank: DTensor
    tensor parallelism over mp (train.py's plan), DDP over dp (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )
    torch.set_num_threads(1)
    if not dist.is_initialized():
        from mpi4py import MPI
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # rank 0 picks a free port
            os.environ["MASTER_PORT"] = str(MPI.COMM_WORLD.bcast(
                _free_port() if MPI.COMM_WORLD.Get_rank() == 0 else None))
        dist.init_process_group("gloo", rank=int(os.environ["PMI_RANK"]),
                                world_size=int(os.environ["PMI_SIZE"]))
    mesh = init_device_mesh("cpu", (dp, mp), mesh_dim_names=("dp", "mp"))
    vocab, seq, d, heads, layers, _ = cfg
    hd = d // heads
    fn = torch.nn.functional

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=LN_EPS), nn.LayerNorm(d, eps=LN_EPS)
            self.attn = Attn()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h, mask):
            b, s, _ = h.shape
            a = self.ln1(h)
            q, k, v = (getattr(self.attn, n)(a).view(b, s, -1, hd).transpose(1, 2)
                       for n in "qkv")  # this rank's heads
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
            h = h + self.attn.proj((att @ v).transpose(1, 2).reshape(b, s, -1))
            return h + self.fc2(fn.gelu(self.fc1(self.ln2(h)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d, eps=LN_EPS)
            self.head = nn.Linear(d, vocab, bias=False)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), -1e9), diagonal=1))

        def forward(self, tokens):
            h = self.wte(tokens) + self.wpe.weight[:tokens.shape[1]]
            for blk in self.blocks:
                h = blk(h, self.mask)
            return self.head(self.ln(h))

    model = GPT()
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():  # train.py's linear weights are [in, out], torch's [out, in]
        for name, t in model.named_parameters():
            t.copy_(torch.from_numpy(params[name].T.copy() if name in linear else params[name]))
    if mp > 1:
        plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(layers):
            plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in "qkv"})
            plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(),
                         f"blocks.{i}.fc1": ColwiseParallel(),
                         f"blocks.{i}.fc2": RowwiseParallel()})
        parallelize_module(model, mesh["mp"], plan)
    if dp > 1:
        if mp > 1:
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            _pre_dp_module_transform(model)
        model = nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS,
                            weight_decay=WD)
    rows = cfg[5] // dp
    lo = mesh.get_local_rank("dp") * rows

    def step(tokens, labels):
        x = torch.from_numpy(tokens[lo:lo + rows])
        y = torch.from_numpy(labels[lo:lo + rows]).reshape(-1)
        with loss_parallel():
            loss = fn.cross_entropy(model(x).reshape(-1, vocab), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        if dp > 1:  # the global mean, as the other columns report
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= dp
        return float(loss)
    return step


# -- one config (this process is one rank) ---------------------------------------------------

def _median_steps(named: dict, batches, warmup: int, steps: int, barrier) -> dict:
    """Per name of ``named`` (name -> step function): median wall and CPU (this process)
    milliseconds per step and the losses. Several functions run in turn, step by step, so a
    machine's drift (other load, clock) is shared alike: step i is function i mod n's."""
    runs = {k: {"losses": [], "wall": [], "cpu": []} for k in named}
    order = list(named.items())
    for i in range(len(order) * (warmup + steps)):
        name, step = order[i % len(order)]
        r = runs[name]
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(*batches[i % len(batches)])
        barrier()
        if len(r["losses"]) >= warmup:
            r["wall"].append(time.perf_counter() - t0)
            r["cpu"].append(time.process_time() - c0)
        r["losses"].append(loss)
    return {k: {"step_ms": statistics.median(r["wall"]) * 1e3,
                "cpu_ms": statistics.median(r["cpu"]) * 1e3, "losses": r["losses"]}
            for k, r in runs.items()}


def _median_step(step, batches, warmup: int, steps: int, barrier) -> dict:
    return _median_steps({"": step}, batches, warmup, steps, barrier)[""]


def worker(size: str, dp: int, mp: int, warmup: int, steps: int, bucket_mb: float) -> dict:
    import train

    import disttensor as dt
    from disttensor import grad_sync
    cfg = SIZES[size]
    vocab, seq, d, heads, layers, batch = cfg
    dt.init_parallel_env()
    world = dt.get_world_size()
    comm = None
    if world > 1:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    barrier = comm.Barrier if comm is not None else (lambda: None)
    rng = np.random.default_rng(2026)
    x_all, y_all = train.gpt_data(rng, batch * 4, seq, vocab)
    batches = [(x_all[k * batch:(k + 1) * batch], y_all[k * batch:(k + 1) * batch])
               for k in range(4)]
    result: dict = {}
    params = None
    for mode in ["dense", "mesh"] if world == 1 else ["mesh"]:
        dt.seed(2026)
        model = train.GPT(vocab, seq, d, heads, layers)
        if params is None:
            params = {name: t.numpy().copy() for name, t in model.named_parameters()}
        mesh = None
        if mode != "dense":
            mesh = dt.ProcessMesh(np.arange(world).reshape(dp, mp).tolist(),
                                  dim_names=["dp", "mp"])
            dt.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": train.GPT_PLAN}})
        opt = dt.optimizer.AdamW(learning_rate=LR, parameters=model.parameters(),
                                 weight_decay=WD)

        def dt_step(xb, yb, model=model, opt=opt, mesh=mesh):
            x, y = train.to_tensors(xb, yb, mesh)
            return float(train.train_step(model, opt, x, y).numpy())
        if mode == "dense" or dp == 1:
            grad_sync.set_bucket_bytes(int(bucket_mb * 2 ** 20))
            result[f"disttensor_{mode}"] = _median_step(dt_step, batches, warmup, steps, barrier)
            continue

        def synced(overlap: bool, nbytes: int):
            """The step with one gradient sync (they compute the same values, so the three
            take turns on one model)."""
            def step(xb, yb):
                grad_sync.set_overlap(overlap)
                grad_sync.set_bucket_bytes(nbytes)
                return dt_step(xb, yb)
            return step
        nbytes = int(bucket_mb * 2 ** 20)
        runs = _median_steps({"mesh": synced(True, nbytes), "mesh_blocking": synced(False, nbytes),
                              "mesh_per_parameter": synced(True, 0)},
                             batches, warmup, steps, barrier)
        # one trajectory, its steps 0, 1, 2, ... taken in turn: compared with numpy's
        losses = [x for turn in zip(*(r["losses"] for r in runs.values())) for x in turn]
        losses = losses[:warmup + steps]
        for k, r in runs.items():
            result[f"disttensor_{k}"] = {**r, "losses": losses}
    hand = HandGPT(params, cfg, dp, mp, comm)
    rows = batch // dp

    def np_step(xb, yb):
        return hand.step(xb[hand.dpi * rows:(hand.dpi + 1) * rows],
                         yb[hand.dpi * rows:(hand.dpi + 1) * rows])
    result["numpy"] = _median_step(np_step, batches, warmup, steps, barrier)
    try:
        step = torch_step_fn(params, cfg) if world == 1 else \
            dtensor_step_fn(params, cfg, dp, mp)
    except ImportError:
        result["torch_note"] = "torch not installed: no torch column"
    else:
        result["torch" if world == 1 else "dtensor"] = _median_step(step, batches, warmup,
                                                                    steps, barrier)
    return result


def _summary(res: dict) -> dict:
    """Step times, the ratios of disttensor to each baseline and the loss agreement."""
    runs = {k: v for k, v in res.items() if isinstance(v, dict)}
    out: dict = {}
    for clock in ("step_ms", "cpu_ms"):
        tag = "wall" if clock == "step_ms" else "cpu"
        out[tag] = {f"{k}_ms": round(v[clock], 3) for k, v in runs.items()}
        for base in ("numpy", "torch", "dtensor"):
            for k in (k for k in runs if k.startswith("disttensor") and base in runs):
                out[tag][f"ratio_{k[len('disttensor_'):]}_vs_{base}"] = round(
                    runs[k][clock] / runs[base][clock], 3)
        for other in ("blocking", "per_parameter"):
            if f"disttensor_mesh_{other}" in runs:
                out[tag][f"overlap_vs_{other}"] = round(
                    runs["disttensor_mesh"][clock] / runs[f"disttensor_mesh_{other}"][clock], 3)
    ref = np.array(res["numpy"]["losses"])
    out["loss_max_rel_diff"] = max(
        float(np.max(np.abs(np.array(v["losses"]) - ref) / np.abs(ref)))
        for v in runs.values())
    if "torch_note" in res:
        out["note"] = res["torch_note"]
    return out


def _free_port() -> int:
    """A TCP port nothing listens on now (torch.distributed's rendezvous of one job)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,medium,large")
    ap.add_argument("--configs", default="1,2x1,1x2,2x2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="disttensor's gradient bucket size (grad_sync.set_bucket_bytes)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "size:dp:mp"
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    if args.worker:
        size, dp, mp = args.worker.split(":")
        res = worker(size, int(dp), int(mp), args.warmup, args.steps, args.bucket_mb)
        import disttensor as dt
        if dt.get_rank() == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return
    from launch import find_mpiexec
    results: dict = {}
    for size in args.sizes.split(","):
        for conf in args.configs.split(","):
            dp, mp = (1, 1) if conf == "1" else (int(v) for v in conf.split("x"))
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"{size}:{dp}:{mp}",
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--bucket-mb", str(args.bucket_mb)]
            if conf != "1":
                cmd = [find_mpiexec() or "mpiexec", "-n", str(dp * mp), *cmd]
            key = "1proc" if conf == "1" else f"mesh_{dp}x{mp}"
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                      env={**os.environ, "PYTHONPATH": _ROOT})
            except subprocess.TimeoutExpired:
                results.setdefault(size, {})[key] = {"error": f"timed out ({args.timeout} s)"}
                continue
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                results.setdefault(size, {})[key] = {
                    "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
                continue
            results.setdefault(size, {})[key] = _summary(json.loads(line[-1][7:]))
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    print(json.dumps({"benchmark": "gpt_train_step", "sizes": {k: dict(zip(
        ("vocab", "seq", "d", "heads", "layers", "batch"), SIZES[k])) for k in
        args.sizes.split(",")}, "steps": args.steps, "warmup": args.warmup,
        "numpy": np.__version__, "torch": torch_version, "bucket_mb": args.bucket_mb,
        "results": results}, indent=1))


if __name__ == "__main__":
    main()
