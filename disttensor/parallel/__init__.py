"""The parallel API users meet first (Paddle names, PyTorch names as aliases):

* data: :func:`shard_dataloader` (see also :mod:`disttensor.io`);
* creation and local code: :class:`LazyGuard` (``p.initialize()``), :func:`dtensor_from_fn`,
  :func:`local_map`, :class:`LocalLayer`;
* plans: :func:`parallelize` with ColWise/RowWise/SequenceParallel* plans, :func:`shard_layer`,
  :func:`set_mesh`/:func:`get_mesh`; PyTorch's :func:`parallelize_module` with
  ColwiseParallel/RowwiseParallel/SequenceParallel;
* ZeRO: :func:`shard_optimizer` with :class:`ShardingStage1`/``2``/``3`` on the dp mesh dim;
* PyTorch names: :func:`init_device_mesh`, :class:`DeviceMesh` (``mesh["tp"]``),
  :func:`distribute_tensor`, :class:`DTensor`, :func:`fully_shard` (FSDP: ZeRO-3), and the
  Tensor methods ``to_local``, ``full_tensor``, ``redistribute`` and the property
  ``device_mesh``;
* collectives on dense tensors: :func:`all_reduce`, :func:`all_gather`, :func:`broadcast`,
  :func:`reduce_scatter`, :func:`barrier`, :func:`new_group`.

Built on the public distributed API only (shard_tensor, reshard, dtensor_from_local,
dtensor_to_local, unshard_dtensor, Layer hooks).
"""
from ..tensor import Tensor
from .communication import (
    Group,
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    new_group,
    reduce_scatter,
)
from .creation import dtensor_from_fn
from .data import ShardDataloader, shard_dataloader
from .lazy import LazyGuard, initialize
from .local import LocalLayer, local_map
from .mesh import DeviceMesh, get_mesh, init_device_mesh, set_mesh
from .plans import (
    ColWiseParallel,
    PlanBase,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
    parallelize,
    shard_layer,
)
from .sharding import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer
from .torch_style import (
    TENSOR_METHODS,
    ColwiseParallel,
    DTensor,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    distribute_tensor,
    fully_shard,
    parallelize_module,
)

# The one place that attaches PyTorch-style methods (and Paddle's ``initialize`` of a lazy
# parameter) to Tensor (kept if the runtime has its own).
for _name, _method in {**TENSOR_METHODS, "initialize": initialize}.items():
    if not hasattr(Tensor, _name):
        setattr(Tensor, _name, _method)

__all__ = [
    "shard_dataloader", "ShardDataloader", "dtensor_from_fn", "local_map", "LocalLayer",
    "parallelize", "shard_layer", "set_mesh", "get_mesh", "PlanBase", "ColWiseParallel",
    "RowWiseParallel", "SequenceParallelBegin", "SequenceParallelEnd", "SequenceParallelEnable",
    "SequenceParallelDisable", "PrepareLayerInput", "PrepareLayerOutput", "parallelize_module",
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "init_device_mesh", "DeviceMesh", "distribute_tensor", "DTensor", "fully_shard", "all_reduce",
    "all_gather", "broadcast", "reduce_scatter", "barrier", "new_group", "Group", "ReduceOp",
    "LazyGuard", "shard_optimizer", "ShardingStage1", "ShardingStage2", "ShardingStage3",
]
