"""PyTorch's ``DistributedSampler`` and ``DataLoader(sampler=)``: each rank's indices against
the semantics written out with plain Python lists, batches, epochs and errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import disttensor as dt
from disttensor.io import DataLoader, DistributedSampler, TensorDataset


def reference(n, k, r, shuffle, seed, epoch, drop_last):
    """PyTorch's algorithm: order, pad by repeating (or cut), then every k-th from r."""
    order = [int(i) for i in np.random.default_rng(seed + epoch).permutation(n)] if shuffle \
        else list(range(n))
    if drop_last and n % k:
        total = math.ceil((n - k) / k) * k
        order = order[:total]
    else:
        total = math.ceil(n / k) * k
        while len(order) < total:
            order += order[:total - len(order)]
    return order[r:total:k]


@pytest.mark.parametrize("n", [1, 3, 5, 8, 10])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_gets_pytorchs_share(n, k, shuffle, drop_last):
    shares = []
    for r in range(k):
        s = DistributedSampler(range(n), num_replicas=k, rank=r, shuffle=shuffle, seed=4,
                               drop_last=drop_last)
        got = list(s)
        assert got == reference(n, k, r, shuffle, 4, 0, drop_last)
        assert len(s) == len(got)
        shares.append(got)
    assert len({len(x) for x in shares}) == 1  # every rank gets as many indices
    if not drop_last:
        assert set(sum(shares, [])) == set(range(n))  # padding covers the whole dataset


def test_epochs_reshuffle_only_through_set_epoch():
    s = DistributedSampler(range(12), num_replicas=3, rank=1, seed=7)
    first = list(s)
    assert list(s) == first  # as in PyTorch, the epoch does not advance by itself
    s.set_epoch(1)
    second = list(s)
    assert second == reference(12, 3, 1, True, 7, 1, False) and second != first
    s.set_epoch(0)
    assert list(s) == first


def test_dataloader_with_a_sampler_batches_its_indices():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    ds = TensorDataset([dt.to_tensor(x)])
    sampler = DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=2, sampler=sampler)
    idx = reference(10, 3, 2, True, 1, 0, False)
    batches = [b[0].numpy() for b in loader]
    assert [len(b) for b in batches] == [2, 2] and len(loader) == 2
    np.testing.assert_array_equal(np.concatenate(batches), x[idx])
    assert loader.splits_by_rank
    dropped = DataLoader(ds, batch_size=3, sampler=sampler, drop_last=True)
    assert [len(b[0].numpy()) for b in dropped] == [3]
    plain = DataLoader(ds, batch_size=4, sampler=[9, 0, 3])  # any iterable of indices
    np.testing.assert_array_equal(next(iter(plain))[0].numpy(), x[[9, 0, 3]])
    assert not plain.splits_by_rank


def test_bad_input_errors():
    ds = list(range(5))
    with pytest.raises(ValueError, match="DistributedSampler: rank must be in \\[0, 2\\), got 2"):
        DistributedSampler(ds, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be a positive int, got 0"):
        DistributedSampler(ds, num_replicas=0, rank=0)
    with pytest.raises(TypeError, match="DistributedSampler: dataset must define __len__"):
        DistributedSampler(iter(ds), num_replicas=1, rank=0)
    s = DistributedSampler(ds, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="DataLoader: sampler already fixes the order"):
        DataLoader(ds, sampler=s, shuffle=True)
    with pytest.raises(ValueError, match="batch_sampler already fixes"):
        DataLoader(ds, sampler=s, batch_sampler=[[0, 1]])


@pytest.mark.mpi
def test_defaults_to_the_world_and_splits_it(comm):
    s = DistributedSampler(range(7), seed=3)
    assert (s.num_replicas, s.rank) == (comm.size, comm.rank)
    shares = comm.allgather(list(s))
    assert shares == [reference(7, comm.size, r, True, 3, 0, False) for r in range(comm.size)]
