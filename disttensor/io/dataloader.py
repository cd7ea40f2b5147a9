"""``DataLoader``: batches of a map-style dataset, collated into numpy arrays and handed out as
dense Tensors (Paddle's ``paddle.io.DataLoader``). Loading runs in this process."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any, Callable, Iterator

import numpy as np

from ..ops import to_tensor
from ..tensor import Tensor
from .sampler import BatchSampler, DistributedBatchSampler, DistributedSampler

__all__ = ["DataLoader", "default_collate_fn"]


def default_collate_fn(batch: list) -> Any:
    """Stack a list of samples into one batch with numpy: arrays (and dense Tensors) are
    stacked along a new dim 0, numbers become a 1-d array, strings a list; tuples/lists and
    dicts are collated field by field (every sample must have the same fields).

    Example::

        default_collate_fn([(np.zeros(2), 1), (np.ones(2), 2)])
        # [array([[0., 0.], [1., 1.]]), array([1, 2])]
    """
    if not batch:
        raise ValueError("default_collate_fn: the batch is empty")
    first = batch[0]
    if isinstance(first, Tensor):
        if first.is_dist():
            raise TypeError("default_collate_fn: samples must be dense (got a distributed "
                            "tensor)")
        return np.stack([s.numpy() for s in batch])
    if isinstance(first, np.ndarray):
        return np.stack(batch)
    if isinstance(first, (Number, np.number, np.bool_)):
        return np.array(batch)
    if isinstance(first, (str, bytes)):
        return list(batch)
    if isinstance(first, Mapping):
        keys = list(first)
        for s in batch:
            if list(s) != keys:
                raise ValueError(f"default_collate_fn: samples have different keys {keys} and "
                                 f"{list(s)}")
        return {k: default_collate_fn([s[k] for s in batch]) for k in keys}
    if isinstance(first, Sequence):
        n = len(first)
        if any(len(s) != n for s in batch):
            raise ValueError(f"default_collate_fn: samples have different numbers of fields "
                             f"{sorted({len(s) for s in batch})}")
        return [default_collate_fn(list(fields)) for fields in zip(*batch)]
    raise TypeError(f"default_collate_fn: cannot batch samples of type {type(first).__name__} "
                    "(arrays, Tensors, numbers, strings, tuples/lists and dicts can be batched)")


def to_tensors(batch: Any) -> Any:
    """The collated batch with every numpy array replaced by a dense Tensor (same dtype)."""
    if isinstance(batch, np.ndarray):
        return to_tensor(batch)
    if isinstance(batch, Mapping):
        return {k: to_tensors(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not (batch and isinstance(batch[0], (str, bytes))):
        return [to_tensors(v) for v in batch]
    return batch


class DataLoader:
    """Iterate a map-style dataset in batches (Paddle's ``paddle.io.DataLoader``).

    Batches come from ``batch_sampler`` (index lists), or from a :class:`BatchSampler` built
    from ``batch_size``, ``shuffle`` (seeded by ``seed``, so every rank draws the same order)
    and ``drop_last``, or, with ``sampler`` (PyTorch's argument: any iterable of indices such
    as a :class:`DistributedSampler`), from that sampler's indices in batches of
    ``batch_size``. Each batch is ``collate_fn([dataset[i] for i in indices])`` (default
    :func:`default_collate_fn`) with numpy arrays turned into dense Tensors; a tuple batch is
    handed out as a list. ``feed_list``, ``places``, ``return_list`` and ``num_workers`` are
    accepted for compatibility and ignored: loading runs in this process on the host (batches
    are always lists). No communication.

    Example::

        loader = dt.io.DataLoader(dt.io.TensorDataset([x, y]), batch_size=4, shuffle=True)
        for xb, yb in loader:
            ...
    """

    def __init__(self, dataset, feed_list: Any = None, places: Any = None,
                 return_list: bool = True, batch_sampler: Any = None, batch_size: int = 1,
                 shuffle: bool = False, drop_last: bool = False,
                 collate_fn: Callable[[list], Any] | None = None, num_workers: int = 0,
                 seed: int = 0, sampler: Any = None):
        self.dataset = dataset
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or drop_last or sampler is not None:
                raise ValueError("DataLoader: batch_sampler already fixes batch_size, shuffle, "
                                 "drop_last and sampler; leave them at their defaults")
            self.batch_sampler = batch_sampler
        elif sampler is not None:
            if shuffle:
                raise ValueError("DataLoader: sampler already fixes the order; leave shuffle "
                                 "False (a DistributedSampler shuffles with shuffle=True)")
            self.batch_sampler = BatchSampler(sampler=sampler, batch_size=batch_size,
                                              drop_last=drop_last)
        else:
            self.batch_sampler = BatchSampler(dataset, shuffle=shuffle, batch_size=batch_size,
                                              drop_last=drop_last, seed=seed)
        self.collate_fn = default_collate_fn if collate_fn is None else collate_fn

    @property
    def batch_size(self) -> int | None:
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> bool:
        return bool(getattr(self.batch_sampler, "drop_last", False))

    @property
    def splits_by_rank(self) -> bool:
        """True when the batch sampler already gives each rank its own indices."""
        return isinstance(self.batch_sampler, DistributedBatchSampler) or \
            isinstance(getattr(self.batch_sampler, "sampler", None), DistributedSampler)

    def load(self, indices: Sequence[int]) -> Any:
        """``collate_fn`` of the samples at ``indices`` (numpy leaves, no Tensors yet)."""
        return self.collate_fn([self.dataset[i] for i in indices])

    def __iter__(self) -> Iterator[Any]:
        for indices in self.batch_sampler:
            yield to_tensors(self.load(indices))

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __len__(self) -> int:
        return len(self.batch_sampler)
