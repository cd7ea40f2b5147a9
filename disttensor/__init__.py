"""disttensor: a semi-automatic distributed tensor runtime (see README.md and docs/)."""
from __future__ import annotations

import collectives
from spmd_rules import Partial, ProcessMesh, ReduceType, Replicate, Shard

# importing ops registers every op; tensor_methods binds the registered methods to Tensor
from . import (
    amp,
    autograd,
    checkpoint,
    dispatch,
    distributed,
    dtype,
    generator,
    grad_sync,
    incubate,
    io,
    jit,
    nn,
    ops,
    optimizer,
    parallel,
    pipelining,
    plan,
    schema,
    tape,
    tensor,
    tensor_methods,
)
from .autograd import enable_grad, grad, is_grad_enabled, no_grad, set_grad_enabled
from .checkpoint import load_state_dict, save_state_dict
from .distributed.api import (
    dtensor_from_local,
    dtensor_to_local,
    reshard,
    reshard_plan,
    shard_tensor,
    unshard_dtensor,
)
from .distributed.caches import cache_info
from .distributed.visualize import visualize_sharding
from .dtype import bfloat16, bool_, float16, float32, float64, int32, int64
from .grad_sync import no_sync
from .jit import DistModel, to_static
from .layout.mesh_groups import get_rank, get_world_size
from .nn.layer import ParamAttr, create_parameter
from .ops import *  # noqa: F403
from .ops import OPS  # noqa: F401  (in ops.__all__)
from .parallel import (
    ColWiseParallel,
    ColwiseParallel,
    DeviceMesh,
    DTensor,
    Group,
    LazyGuard,
    LocalLayer,
    ParallelStyle,
    PlanBase,
    PrepareLayerInput,
    PrepareLayerOutput,
    ReduceOp,
    RowWiseParallel,
    RowwiseParallel,
    SequenceParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    ShardDataloader,
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    distribute_tensor,
    dtensor_from_fn,
    fully_shard,
    get_mesh,
    init_device_mesh,
    local_map,
    new_group,
    parallelize,
    parallelize_module,
    reduce_scatter,
    set_mesh,
    shard_dataloader,
    shard_layer,
    shard_optimizer,
)
from .parallel.pipeline import SplitPoint
from .schema import coverage_report
from .tensor import Tensor, is_tensor

__version__ = "0.1.0"


def init_parallel_env(timeout: float | None = None) -> None:
    """Start the process group (MPI when launched by mpiexec, else a single process).

    ``timeout``: seconds a collective may stay blocked before the watchdog ends the job
    (default: ``DISTTENSOR_TIMEOUT``, else 600). The ranks agree on the disttensor version and
    the timeout (one small exchange), or raise the same error on every rank."""
    from .distributed.agreement import agree
    if timeout is not None:
        collectives.failure.set_timeout(timeout)
    world = collectives.init()
    t = collectives.failure.timeout()
    agree("init_parallel_env", range(world.size), ("init_parallel_env", __version__, t),
          lambda: f"disttensor {__version__}, timeout {t:g} s", "the runtime's version and timeout")


__version__ = "0.1.0"

# -- the user layer: data, checkpoints, plans, local code, PyTorch names, collectives --
# -- end of the user layer block --

# -- mixed precision --

# -- pipeline parallelism --

manual_seed = seed  # PyTorch's name for dt.seed  # noqa: E305,F405
from .strategy import Strategy  # noqa: E402

# the public names: the op functions (`ops.__all__`, from the registry) and these
__all__ = ops.__all__ + [
    # tensors, placements, meshes, dtypes, gradients
    "Tensor", "is_tensor", "Partial", "ProcessMesh", "ReduceType", "Replicate", "Shard",
    "bool_", "float16", "float32", "float64", "int32", "int64", "bfloat16",
    "enable_grad", "grad", "is_grad_enabled", "no_grad", "set_grad_enabled", "no_sync",
    "ParamAttr", "create_parameter", "manual_seed",
    # the distributed entry points
    "init_parallel_env", "get_rank", "get_world_size", "dtensor_from_local", "dtensor_to_local",
    "reshard", "reshard_plan", "shard_tensor", "unshard_dtensor", "cache_info",
    "visualize_sharding", "coverage_report", "DistModel", "to_static",
    # the user layer
    "load_state_dict", "save_state_dict", "ColWiseParallel", "ColwiseParallel", "DeviceMesh",
    "DTensor", "Group", "LazyGuard", "LocalLayer", "ParallelStyle", "PlanBase",
    "PrepareLayerInput", "PrepareLayerOutput", "ReduceOp", "RowWiseParallel", "RowwiseParallel",
    "ShardingStage1", "ShardingStage2", "ShardingStage3", "shard_optimizer", "SequenceParallel",
    "SequenceParallelBegin", "SequenceParallelDisable", "SequenceParallelEnable",
    "SequenceParallelEnd", "ShardDataloader", "all_gather", "all_reduce", "barrier", "broadcast",
    "distribute_tensor", "dtensor_from_fn", "fully_shard", "get_mesh", "init_device_mesh",
    "local_map", "new_group", "parallelize", "parallelize_module", "reduce_scatter", "set_mesh",
    "shard_dataloader", "shard_layer", "SplitPoint", "Strategy",
    # the subpackages and modules (the API reference documents those listed here)
    "nn", "optimizer", "jit", "io", "amp", "incubate", "pipelining", "parallel", "checkpoint",
    "autograd", "distributed", "dispatch", "dtype", "generator", "grad_sync", "ops", "plan",
    "schema", "tape", "tensor", "tensor_methods", "collectives",
]
