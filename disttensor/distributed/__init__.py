"""The distributed layer: DistTensor, process groups per mesh dim, reshard, op dispatch."""
from .api import (dtensor_from_local, dtensor_to_local, reshard, reshard_plan, shard_layer,
                  shard_tensor, unshard_dtensor)
from .dispatch import coverage_report
from .dist_tensor import DistTensor
from .mesh_groups import get_rank, get_world_size
from spmd_rules import ReshardPlan, Step
from .visualize import visualize_sharding

__all__ = ["DistTensor", "shard_tensor", "reshard", "reshard_plan", "dtensor_from_local",
           "dtensor_to_local", "unshard_dtensor", "shard_layer", "coverage_report", "get_rank",
           "get_world_size", "ReshardPlan", "Step", "visualize_sharding"]
