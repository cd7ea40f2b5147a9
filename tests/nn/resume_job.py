"""A training job for the resume test: ``python resume_job.py CKPT FIRST LAST [load]`` trains
steps FIRST..LAST-1 at this world size (after loading CKPT when asked), saves to CKPT and prints
the losses (``repr`` of each float, rank 0). The model and data are replicated, the AdamW states
sharded over the ranks (ZeRO-1), so the numbers do not depend on the world size."""
from __future__ import annotations

import sys

import numpy as np

import disttensor as dt
import disttensor.nn.functional as F
from disttensor import nn

path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
load = len(sys.argv) > 4
dt.init_parallel_env()
mesh = dt.ProcessMesh(list(range(dt.get_world_size())), dim_names=["dp"])
dt.seed(11)
model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
dt.shard_layer(model, mesh)
decay = [p for p in model.parameters() if p.ndim == 2]
rest = [p for p in model.parameters() if p.ndim != 2]
sched = dt.optimizer.lr.LinearWarmup(dt.optimizer.lr.CosineAnnealingDecay(0.05, T_max=20),
                                     warmup_steps=4, start_lr=0.0, end_lr=0.05)
opt = dt.optimizer.AdamW(sched, parameters=[{"params": decay, "weight_decay": 0.1},
                                            {"params": rest, "weight_decay": 0.0}],
                         grad_clip=nn.ClipGradByGlobalNorm(0.5))
opt = dt.shard_optimizer(opt, dt.ShardingStage1("dp", mesh))
if load:  # the README's way: load into the state dicts, then hand the optimizer's back
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    dt.load_state_dict(state, path)
    opt.set_state_dict(state["opt"])
rng = np.random.default_rng(5)
data = [(rng.standard_normal((8, 6)).astype(np.float32),
         rng.standard_normal((8, 3)).astype(np.float32)) for _ in range(last)]
losses = []
for x, y in data[first:last]:
    loss = F.mse_loss(model(dt.shard_tensor(x, mesh, [dt.Replicate()])),
                      dt.shard_tensor(y, mesh, [dt.Replicate()]))
    loss.backward()
    opt.step()
    opt.clear_grad()
    sched.step()
    losses.append(float(loss.numpy()))
dt.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict()}, path)
if dt.get_rank() == 0:
    print("LOSSES", " ".join(repr(v) for v in losses), flush=True)
