"""The parallel API users meet first (Paddle names, PyTorch names as aliases)."""
from .data import ShardDataloader, shard_dataloader
from .mesh import DeviceMesh, get_mesh, init_device_mesh, set_mesh

__all__ = ["shard_dataloader", "ShardDataloader", "set_mesh", "get_mesh", "init_device_mesh",
           "DeviceMesh"]
