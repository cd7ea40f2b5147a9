"""The main job: train an MLP with BatchNorm1D and a small GPT on synthetic tasks, written as for
one process and distributed on a [dp, mp] mesh (Megatron-style column/row weights, batch on dp):
the GPT by a ``parallelize`` plan, the MLP by a ``shard_layer`` function (its batch norm is
channel-parallel, which no plan names).

    mpirun -n 4 python examples/train.py              # 2 x 2 mesh, both models
    mpirun -n 4 python examples/train.py --to-static  # the same, each step a captured program
    mpirun -n 4 python examples/train.py --sharding 2 # ZeRO stage 2 on dp
    mpirun -n 4 python examples/train.py --steps 20 --save ckpt    # checkpoint at the end
    mpirun -n 2 python examples/train.py --steps 50 --resume ckpt  # go on (any world size)
    python examples/train.py                          # one process (1 x 1 mesh)
    python examples/train.py --dense                  # plain dense tensors, no mesh at all
    mpirun -n 4 python examples/train.py --amp O1 --amp-dtype bfloat16  # mixed precision
    mpirun -n 4 python examples/train.py --accumulate 4 --to-static  # 4 micro-batches a step
    mpirun -n 4 python examples/train.py --model gpt --pp 2 --micro-batches 4 --schedule 1F1B
    mpirun -n 4 python examples/train.py --model gpt --pp 2 --micro-batches 4 --to-static \
        --dropout 0.1                                # captured pipeline steps, with dropout

The loss curve does not depend on the mesh: ``--dense`` on one process and the 2 x 2 run agree
to floating-point tolerance (tests/examples check it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Replicate, Shard, nn

# -- models -----------------------------------------------------------------------------------

class MLP(nn.Layer):
    def __init__(self, din: int, hidden: int, classes: int, dropout: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(din, hidden)
        self.bn = nn.BatchNorm1D(hidden)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


class Attention(nn.Layer):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        hd = d // self.heads

        def heads(y):
            return y.reshape([b, t, self.heads, hd]).transpose([0, 2, 1, 3])
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = dt.matmul(q, k, transpose_y=True).scale(1.0 / math.sqrt(hd)) + mask
        y = dt.matmul(F.softmax(att, axis=-1), v)
        return self.proj(y.transpose([0, 2, 1, 3]).reshape([b, t, d]))


class Block(nn.Layer):
    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()  # residual dropout

    def forward(self, x, mask):
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=True)))


class GPT(nn.Layer):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int,
                 dropout: float = 0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.blocks = nn.LayerList([Block(d, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias_attr=False)
        causal = np.triu(np.full((seq, seq), -1e9, dtype=np.float32), k=1)
        self.register_buffer("mask", dt.to_tensor(causal), persistable=False)
        self.register_buffer("pos", dt.arange(seq), persistable=False)

    def forward(self, tokens):
        x = self.drop(self.wte(tokens) + self.wpe(self.pos))
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.ln(x))


# -- Megatron-style placements on a [dp, mp] mesh ------------------------------------------

R, COL, ROW = [Replicate(), Replicate()], [Replicate(), Shard(1)], [Replicate(), Shard(0)]


def shard_mlp(name: str, layer: nn.Layer, mesh: dt.ProcessMesh) -> None:
    """fc1 column-parallel, batch norm channel-parallel, fc2 row-parallel."""
    plan = {"fc1": {"weight": COL, "bias": ROW}, "fc2": {"weight": ROW, "bias": R},
            "bn": {"weight": ROW, "bias": ROW, "_mean": ROW, "_variance": ROW}}
    _apply_plan(plan.get(name, {}), layer, mesh)


# Vocab-parallel embedding and head, column q/k/v/fc1, row proj/fc2; the rest replicated.
GPT_PLAN = {
    "wte": dt.RowWiseParallel(),
    r"blocks\.\d+\.attn\.(q|k|v)": dt.ColWiseParallel(),
    r"blocks\.\d+\.attn\.proj": dt.RowWiseParallel(),
    r"blocks\.\d+\.fc1": dt.ColWiseParallel(),
    r"blocks\.\d+\.fc2": dt.RowWiseParallel(),
    "head": dt.ColWiseParallel(),
}


def _apply_plan(plan: dict, layer: nn.Layer, mesh: dt.ProcessMesh) -> None:
    for pname, placements in plan.items():
        setattr(layer, pname, dt.shard_tensor(getattr(layer, pname), mesh, placements))


# -- synthetic tasks --------------------------------------------------------------------------

def mlp_data(rng, n: int, din: int, classes: int):
    teacher = rng.standard_normal((din, classes))
    x = rng.standard_normal((n, din)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int64)


def gpt_data(rng, n: int, seq: int, vocab: int):
    """Sequences that follow a fixed random permutation of the vocabulary."""
    perm = rng.permutation(vocab)
    toks = np.empty((n, seq + 1), dtype=np.int64)
    toks[:, 0] = rng.integers(0, vocab, n)
    for i in range(seq):
        toks[:, i + 1] = perm[toks[:, i]]
    return toks[:, :-1], toks[:, 1:]


# -- training ---------------------------------------------------------------------------------

#: model sizes: MLP (din, hidden, classes), GPT (vocab, seq, d, heads, layers)
SIZES = {"default": {"mlp": (16, 32, 8), "gpt": (64, 16, 32, 4, 2)},
         "large": {"mlp": (256, 1024, 64), "gpt": (256, 32, 128, 4, 2)}}


def build(model_name: str, seed: int, mesh: dt.ProcessMesh | None, batch: int = 16,
          dtype: str = "float32", size: str = "default", sharding: int = 0,
          device: str = "cpu", clip: float | None = None, lr_schedule: str = "constant",
          steps: int = 50, pp_config: dict | None = None, layers: int | None = None,
          dropout: float = 0.0):
    """(model, optimizer, batches): the model of ``SIZES[size]`` placed on ``mesh`` (dense
    without one) and moved to ``device``, AdamW (ZeRO stage ``sharding`` on the dp mesh dim
    when > 0; gradients clipped to global norm ``clip``; ``lr_schedule`` "warmup-cosine": a
    linear warmup over the first tenth of ``steps``, then cosine decay), and the four global
    (x, y) batches the steps cycle through. ``pp_config``: the GPT's blocks cut into pipeline
    stages on the "pp" dim of a [pp, dp, mp] mesh; ``layers``: the GPT's block count (default:
    the size's); ``dropout``: the GPT's dropout probability (embeddings, residuals)."""
    dt.seed(seed)
    rng = np.random.default_rng(seed)
    dims = SIZES[size][model_name]
    if model_name == "mlp":
        model, lr = MLP(*dims), 1e-2
        x_all, y_all = mlp_data(rng, batch * 4, dims[0], dims[2])
    else:
        dims = dims if layers is None else (*dims[:4], layers)
        model, lr = GPT(*dims, dropout=dropout), 3e-3
        x_all, y_all = gpt_data(rng, batch * 4, dims[1], dims[0])
    if dtype != "float32":
        model.to(dtype=dtype)
        if model_name == "mlp":
            x_all = x_all.astype(dtype)
    if mesh is not None and model_name == "mlp":
        dt.shard_layer(model, mesh, shard_mlp)
    elif mesh is not None and pp_config is not None:
        dt.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": GPT_PLAN},
                                           "dp_config": {}, "pp_config": pp_config})
    elif mesh is not None:
        dt.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": GPT_PLAN}})
    model.to(device=device)
    if lr_schedule == "warmup-cosine":
        warmup = max(1, steps // 10)
        lr = dt.optimizer.lr.LinearWarmup(dt.optimizer.lr.CosineAnnealingDecay(lr, T_max=steps),
                                          warmup, start_lr=0.0, end_lr=lr)
    opt = dt.optimizer.AdamW(learning_rate=lr, parameters=model.parameters(), weight_decay=0.01,
                             grad_clip=nn.ClipGradByGlobalNorm(clip) if clip else None)
    if sharding:
        if mesh is None:
            raise SystemExit("train.py: --sharding needs a mesh (drop --dense)")
        stage = (dt.ShardingStage1, dt.ShardingStage2, dt.ShardingStage3)[sharding - 1]
        opt = dt.shard_optimizer(opt, stage("dp", mesh))
    batches = [(x_all[k * batch:(k + 1) * batch], y_all[k * batch:(k + 1) * batch])
               for k in range(4)]
    return model, opt, batches


def to_tensors(xb: np.ndarray, yb: np.ndarray, mesh: dt.ProcessMesh | None,
               device: str = "cpu"):
    """A batch as tensors on ``device``: sharded on the dp mesh dim, or dense without a mesh."""
    x, y = dt.to_tensor(xb, place=device), dt.to_tensor(yb, place=device)
    if mesh is None:
        return x, y
    data_pl = [Shard(0), Replicate()]
    return dt.shard_tensor(x, mesh, data_pl), dt.shard_tensor(y, mesh, data_pl)


def train_step(model: nn.Layer, opt, x, y, amp: dict | None = None, accumulate: int = 1):
    """One step: forward, loss, backward, optimizer update; returns the loss tensor.
    ``amp``: ``{"level", "dtype", "scaler"}`` runs the forward under ``dt.amp.auto_cast`` and,
    with a scaler, scales the loss and skips steps whose gradients are not finite.
    ``accumulate`` N: the batch is N micro-batches, their gradients synced once
    (``dt.optimizer.merged_step``); the loss returned is their mean."""
    def forward(xm, ym):
        with dt.amp.auto_cast(enable=amp is not None, **({} if amp is None else {
                "level": amp["level"], "dtype": amp["dtype"]})):
            return F.cross_entropy(model(xm), ym)
    # clear_grad(set_to_zero=False) drops grads: the next backward assigns, not adds
    return dt.optimizer.merged_step(model, opt, forward, x, y, accumulate,
                                    scaler=None if amp is None else amp["scaler"])


def amp_setup(args, model: nn.Layer, opt):
    """(model, optimizer, amp config) for ``--amp``: O2 decorates (low-precision model, float32
    master weights); float16 gets a GradScaler (bfloat16 keeps float32's range: none needed)."""
    if args.amp is None:
        return model, opt, None
    if args.amp == "O2":
        model, opt = dt.amp.decorate(model, opt, level="O2", dtype=args.amp_dtype)
    scaler = dt.amp.GradScaler(init_loss_scaling=2.0 ** 15) \
        if args.amp_dtype == "float16" else None
    return model, opt, {"level": args.amp, "dtype": args.amp_dtype, "scaler": scaler}


def _checkpoint(model: nn.Layer, opt, step: int) -> dict:
    """Everything a resumed run needs: parameters and buffers, optimizer states (ZeRO-sharded
    ones as they are), the step count and the global generator (dropout's masks)."""
    gen = dt.ops.creation.default_generator.rng.bit_generator
    states = opt.state_dict()  # keyed by parameters' unique names: key by structured names
    by_param = {}
    for sname, p in model.named_parameters():
        prefix = p.name + "_"
        by_param.update({sname + "." + k[len(prefix):]: v for k, v in states.items()
                         if k.startswith(prefix)})
    return {"model": model.state_dict(), "opt": by_param, "step": step,
            "generator": json.dumps(gen.state)}


def resume(path: str, model: nn.Layer, opt) -> int:
    """Load a checkpoint written by ``--save`` into ``model`` and ``opt`` (resharding to their
    layouts) and restore the generator; returns the step it was saved at."""
    opt.create_states()
    state = _checkpoint(model, opt, 0)
    dt.load_state_dict(state, path)
    dt.ops.creation.default_generator.rng.bit_generator.state = json.loads(state["generator"])
    return int(state["step"])


def train(model_name: str, args, mesh: dt.ProcessMesh | None) -> list[float]:
    pp_config = None
    if args.pp > 1:
        v = args.vpp_degree if args.schedule == "VPP" else 1
        pp_config = {"split_spec": "blocks", "schedule": args.schedule, "vpp_degree": v,
                     "micro_batches": args.micro_batches}
    model, opt, batches = build(model_name, args.seed, mesh, args.batch, args.dtype,
                                sharding=args.sharding, device=args.device, clip=args.clip,
                                lr_schedule=args.lr_schedule, steps=args.steps,
                                pp_config=pp_config, layers=args.layers, dropout=args.dropout)
    model, opt, amp = amp_setup(args, model, opt)
    sched = opt._learning_rate if args.lr_schedule != "constant" else None
    if args.accumulate < 1 or args.batch % args.accumulate:
        raise SystemExit("train.py: --accumulate needs a positive N that divides --batch")
    first = 1
    if args.resume:
        first = resume(os.path.join(args.resume, model_name), model, opt) + 1
        if sched is not None:
            sched.step(first - 1)

    def step_fn(x, y):
        return train_step(model, opt, x, y, amp, args.accumulate)
    if args.to_static:  # captured once (twice: the first step creates the optimizer states)
        step_fn = dt.jit.to_static(step_fn)
    if pp_config is not None:
        step_fn = pipeline_step(model, opt, args)
    losses, t_start = [], time.perf_counter()
    rank0 = dt.get_rank() == 0
    for step in range(first, args.steps + 1):
        t0 = time.perf_counter()
        xb, yb = batches[(step - 1) % 4]
        if pp_config is not None:
            value = float(step_fn(xb, yb).numpy())
        else:
            value = float(step_fn(*to_tensors(xb, yb, mesh, args.device)).numpy())
        if sched is not None:
            sched.step()
        losses.append(value)
        dt_step = time.perf_counter() - t0
        if rank0 and (step % args.log_interval == 0 or step == 1):
            print(f"[{model_name}] step {step:4d}  loss {value:.6f}  "
                  f"step time {dt_step * 1e3:7.2f} ms  {args.batch / dt_step:9.1f} samples/s",
                  flush=True)
    total = time.perf_counter() - t_start
    if args.save:
        dt.save_state_dict(_checkpoint(model, opt, args.steps),
                           os.path.join(args.save, model_name))
    if rank0 and args.to_static and args.print_program:
        print(step_fn.program)
    if rank0 and losses:
        print(f"[{model_name}] done: steps {first}..{args.steps} in {total:.2f} s, loss "
              f"{losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{len(losses) * args.batch / total:.1f} samples/s", flush=True)
    return losses


def pipeline_step(model: nn.Layer, opt, args):
    """A step over the dense global batch through the ``--schedule`` pipeline schedule with
    ``--micro-batches`` micro-batches, then the optimizer update (with ``--to-static``: a
    ``DistModel`` of Paddle's pipeline strategy, every chunk's work a captured program)."""
    v = args.vpp_degree if args.schedule == "VPP" else 1
    if args.to_static:
        strategy = dt.Strategy()
        strategy.pipeline.enable = True
        strategy.pipeline.schedule_mode = args.schedule
        strategy.pipeline.accumulate_steps = args.micro_batches
        strategy.pipeline.vpp_degree = v
        return dt.to_static(model, None, lambda out, y: F.cross_entropy(out, y), opt,
                            strategy=strategy)
    cls = {"FThenB": dt.pipelining.ScheduleFThenB, "1F1B": dt.pipelining.Schedule1F1B,
           "VPP": dt.pipelining.ScheduleVPP}[args.schedule]
    kw = {"vpp_degree": v} if args.schedule == "VPP" else {}
    sched = cls(model, n_microbatches=args.micro_batches,
                loss_fn=lambda out, y: F.cross_entropy(out, y), **kw)

    def step(x, y):
        loss = sched.step(x, y)
        opt.step()
        opt.clear_grad(set_to_zero=False)
        return loss
    return step


def pipeline_mesh(world: int, pp: int, spec: str | None = None) -> dt.ProcessMesh:
    """The [pp, dp, mp] mesh: ``spec`` "dp,mp" per stage, else (world / pp) x 1."""
    dp, mp = (int(v) for v in spec.split(",")) if spec else (world // pp, 1)
    if pp * dp * mp != world:
        raise SystemExit(f"train.py: --pp {pp} with a {dp}x{mp} mesh per stage needs "
                         f"{pp * dp * mp} ranks, running on {world}")
    return dt.ProcessMesh(np.arange(world).reshape(pp, dp, mp).tolist(),
                          dim_names=["pp", "dp", "mp"])


def default_mesh(world: int, spec: str | None = None) -> dt.ProcessMesh:
    """The [dp, mp] mesh: ``spec`` "dp,mp", else 2 x 2 on 4 ranks and world x 1 otherwise."""
    dp, mp = (int(v) for v in spec.split(",")) if spec else \
        ((2, 2) if world == 4 else (world, 1))
    if dp * mp != world:
        raise SystemExit(f"train.py: mesh {dp}x{mp} needs {dp * mp} ranks, running on {world}")
    return dt.ProcessMesh(np.arange(world).reshape(dp, mp).tolist(), dim_names=["dp", "mp"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "gpt", "both"], default="both")
    p.add_argument("--mesh", default=None,
                   help="dp,mp mesh shape (default: 2,2 on 4 ranks, world,1 otherwise)")
    p.add_argument("--dense", action="store_true", help="no mesh: plain dense tensors")
    p.add_argument("--to-static", action="store_true",
                   help="capture each training step into a program and replay it")
    p.add_argument("--print-program", action="store_true",
                   help="with --to-static: print the captured program")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--sharding", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage on the dp mesh dim (shard_optimizer)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="after the last step, save a checkpoint per model under DIR")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="resume from the checkpoints in DIR (any mesh or world size)")
    p.add_argument("--clip", type=float, default=None, metavar="NORM",
                   help="clip gradients to this global norm (default: no clipping)")
    p.add_argument("--accumulate", type=int, default=1, metavar="N",
                   help="split each batch into N micro-batches, one optimizer step")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "warmup-cosine"])
    p.add_argument("--loss-out", default=None, help="write the loss curves as JSON here")
    p.add_argument("--amp", default=None, choices=["O1", "O2"],
                   help="mixed precision: O1 autocast, O2 low-precision model + fp32 masters")
    p.add_argument("--amp-dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (GPT only): its blocks cut over a [pp, dp, mp] mesh")
    p.add_argument("--micro-batches", type=int, default=1, help="with --pp: micro-batches")
    p.add_argument("--schedule", default="1F1B", choices=["FThenB", "1F1B", "VPP"],
                   help="with --pp: the pipeline schedule")
    p.add_argument("--vpp-degree", type=int, default=2, help="with --schedule VPP: chunks "
                   "per stage")
    p.add_argument("--layers", type=int, default=None, help="GPT blocks (default: 2)")
    p.add_argument("--dropout", type=float, default=0.0, help="GPT dropout probability")
    args = p.parse_args(argv)
    dt.init_parallel_env()
    world = dt.get_world_size()
    if args.pp > 1 and (args.model != "gpt" or args.dense or args.amp or args.sharding):
        raise SystemExit("train.py: --pp needs --model gpt, a mesh, no --amp and no "
                         "--sharding")
    mesh = None if args.dense else \
        pipeline_mesh(world, args.pp, args.mesh) if args.pp > 1 else default_mesh(world, args.mesh)
    models = ["mlp", "gpt"] if args.model == "both" else [args.model]
    curves = {m: train(m, args, mesh) for m in models}
    if args.loss_out and dt.get_rank() == 0:
        with open(args.loss_out, "w") as f:
            json.dump(curves, f)
    return curves


if __name__ == "__main__":
    main()
