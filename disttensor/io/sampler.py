"""Batch samplers: lists of dataset indices, one list per batch.

* :class:`BatchSampler` — consecutive indices, or a seeded permutation per epoch (every rank
  with the same seed draws the same permutation, so ranks agree without communicating).
* :class:`DistributedBatchSampler` — Paddle's per-rank sampler: rank ``r`` of ``n`` gets the
  ``r``-th block of ``batch_size`` indices out of every ``n * batch_size``.
* :class:`DistributedSampler` — PyTorch's per-rank index sampler (``DataLoader(sampler=)``):
  rank ``r`` of ``n`` gets every ``n``-th index starting at ``r``.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator

import numpy as np

from ..layout.mesh_groups import get_rank, get_world_size

__all__ = ["BatchSampler", "DistributedBatchSampler", "DistributedSampler"]


def _positive_int(cls: str, arg: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{cls}: {arg} must be a positive int, got {v!r}")
    return int(v)


def _dataset_len(cls: str, dataset) -> int:
    try:
        return len(dataset)
    except TypeError:
        raise TypeError(f"{cls}: dataset must define __len__ (a map-style Dataset), got "
                        f"{type(dataset).__name__}") from None


class BatchSampler:
    """Index lists of ``batch_size`` (Paddle's ``paddle.io.BatchSampler``).

    Give exactly one of ``dataset`` (indices ``0..len-1``, permuted per epoch when ``shuffle``)
    and ``sampler`` (any iterable of indices, used in its order). The permutation of epoch ``e``
    is ``numpy.random.default_rng([seed, e]).permutation(len(dataset))``; the epoch advances at
    each new iteration and can be set with :meth:`set_epoch`. ``drop_last`` drops a final
    short batch. No communication.

    Example::

        list(dt.io.BatchSampler(range(5), batch_size=2))   # [[0, 1], [2, 3], [4]]
    """

    def __init__(self, dataset=None, sampler: Iterable[int] | None = None, shuffle: bool = False,
                 batch_size: int = 1, drop_last: bool = False, seed: int = 0):
        if (dataset is None) == (sampler is None):
            raise ValueError("BatchSampler: give exactly one of dataset and sampler")
        if sampler is not None and shuffle:
            raise ValueError("BatchSampler: shuffle=True needs dataset=, not sampler= (the "
                             "sampler already fixes the order)")
        self.dataset, self.sampler = dataset, sampler
        self._n = None if dataset is None else _dataset_len("BatchSampler", dataset)
        self.shuffle = bool(shuffle)
        self.batch_size = _positive_int("BatchSampler", "batch_size", batch_size)
        self.drop_last = bool(drop_last)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` for the next iteration."""
        self.epoch = int(epoch)

    def _indices(self) -> Iterable[int]:
        if self.sampler is not None:
            return self.sampler
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self._n)
            self.epoch += 1
            return order.tolist()
        return range(self._n)

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for i in self._indices():
            batch.append(int(i))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = self._n if self._n is not None else len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


def _replica(cls: str, num_replicas, rank) -> tuple[int, int]:
    """(num_replicas, rank), defaulting to the world size and this process's rank."""
    n = _positive_int(cls, "num_replicas", get_world_size() if num_replicas is None
                      else num_replicas)
    r = get_rank() if rank is None else rank
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < n:
        raise ValueError(f"{cls}: rank must be in [0, {n}), got {r!r}")
    return n, int(r)


class DistributedBatchSampler:
    """This rank's batches of a dataset split over ``num_replicas`` ranks (Paddle's
    ``paddle.io.DistributedBatchSampler``).

    The indices ``0..len-1`` are padded (repeating from the start) to a multiple of
    ``num_replicas``, permuted with ``numpy.random.RandomState(epoch)`` when ``shuffle`` (the
    epoch advances after each iteration; :meth:`set_epoch` sets it), then rank ``r`` takes the
    ``r``-th block of ``batch_size`` out of every ``num_replicas * batch_size`` (the final
    remainder is split evenly). So global batch ``k`` read in rank order is indices
    ``[k*n*b, (k+1)*n*b)``. ``num_replicas``/``rank`` default to the world size and rank. No
    communication.

    Example::

        s = dt.io.DistributedBatchSampler(range(8), batch_size=2, num_replicas=2, rank=1)
        list(s)   # [[2, 3], [6, 7]]
    """

    def __init__(self, dataset, batch_size: int, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = False, drop_last: bool = False):
        self.dataset = dataset
        self._n = _dataset_len("DistributedBatchSampler", dataset)
        self.batch_size = _positive_int("DistributedBatchSampler", "batch_size", batch_size)
        self.nranks, self.local_rank = _replica("DistributedBatchSampler", num_replicas, rank)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.epoch = 0
        self.num_samples = math.ceil(self._n / self.nranks)
        self.total_size = self.num_samples * self.nranks

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` for the next iteration."""
        self.epoch = int(epoch)

    def _local_indices(self) -> list[int]:
        idx = np.arange(self.total_size) % max(self._n, 1)
        if self.shuffle:
            np.random.RandomState(self.epoch).shuffle(idx)
            self.epoch += 1
        b, n, r = self.batch_size, self.nranks, self.local_rank
        tail = self.total_size % (b * n)
        body = idx[:self.total_size - tail].reshape(-1, n, b)[:, r, :].reshape(-1)
        per = tail // n
        last = idx[self.total_size - tail:][r * per:(r + 1) * per]
        return np.concatenate([body, last]).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        if self._n == 0:
            return
        local = self._local_indices()
        for k in range(0, len(local), self.batch_size):
            batch = local[k:k + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)


class DistributedSampler:
    """This rank's indices of a dataset split over ``num_replicas`` ranks, with PyTorch's
    ``DistributedSampler`` semantics; pass it as ``DataLoader(sampler=...)``.

    The order is ``0..len-1``, or when ``shuffle`` (the default) the permutation
    ``numpy.random.default_rng(seed + epoch).permutation(len)`` — the same on every rank, but
    not the numbers PyTorch's generator draws. Without ``drop_last`` the order is padded by
    repeating it from the start to a multiple of ``num_replicas``; with it, cut to one. Rank
    ``r`` takes positions ``r, r + num_replicas, ...``. As in PyTorch the epoch does not advance
    by itself: call :meth:`set_epoch` before each epoch to reshuffle. ``num_replicas``/``rank``
    default to the world size and rank. No communication.

    Example::

        s = dt.io.DistributedSampler(range(5), num_replicas=2, rank=1, shuffle=False)
        list(s)   # [1, 3, 0]
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self.dataset = dataset
        self._n = _dataset_len("DistributedSampler", dataset)
        self.num_replicas, self.rank = _replica("DistributedSampler", num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        n, k = self._n, self.num_replicas
        self.num_samples = n // k if drop_last else math.ceil(n / k)
        self.total_size = self.num_samples * k

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from now on."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if self._n == 0:
            return iter(())
        order = (np.random.default_rng(self.seed + self.epoch).permutation(self._n)
                 if self.shuffle else np.arange(self._n))
        order = np.resize(order, self.total_size)  # repeats from the start, or cuts
        return iter(order[self.rank::self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples
