"""Data loading, as Paddle's ``paddle.io``: datasets, batch samplers and an in-process
:class:`DataLoader`. Distributed loading (each rank reading only its own rows) is
:func:`disttensor.shard_dataloader`."""
from .dataloader import DataLoader, default_collate_fn
from .dataset import Dataset, TensorDataset
from .sampler import BatchSampler, DistributedBatchSampler, DistributedSampler

__all__ = ["Dataset", "TensorDataset", "BatchSampler", "DistributedBatchSampler", "DataLoader",
           "default_collate_fn", "DistributedSampler"]
