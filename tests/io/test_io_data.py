"""disttensor.io: datasets, batch samplers, the DataLoader and its collate (single process)."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor.io import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedBatchSampler,
    TensorDataset,
    default_collate_fn,
)


class Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __getitem__(self, i):
        return np.array([i, i * i], dtype=np.float32), i % 3

    def __len__(self):
        return self.n


def test_batches_cover_the_dataset_in_order_and_collate_with_numpy():
    batches = list(DataLoader(Squares(7), batch_size=3))
    assert [len(b[1]) for b in batches] == [3, 3, 1]
    x = np.concatenate([b[0].numpy() for b in batches])
    np.testing.assert_array_equal(x, np.array([[i, i * i] for i in range(7)], np.float32))
    assert batches[0][0].dtype == np.float32 and batches[0][1].dtype == np.int64
    assert len(DataLoader(Squares(7), batch_size=3)) == 3


def test_drop_last_drops_the_short_batch():
    loader = DataLoader(Squares(7), batch_size=3, drop_last=True)
    assert [len(b[1]) for b in loader] == [3, 3] and len(loader) == 2


def test_seeded_shuffle_is_a_permutation_reproducible_per_epoch():
    def orders(seed):
        loader = DataLoader(Squares(10), batch_size=4, shuffle=True, seed=seed)
        return [np.concatenate([b[0].numpy()[:, 0] for b in loader]).astype(int)
                for _ in range(2)]
    a, b = orders(3), orders(3)
    for e in range(2):
        np.testing.assert_array_equal(a[e], b[e])
        assert sorted(a[e]) == list(range(10))
    assert not np.array_equal(a[0], a[1]), "each epoch draws a new permutation"
    assert not np.array_equal(a[0], orders(4)[0])
    assert not np.array_equal(a[0], np.arange(10))


def test_batch_sampler_set_epoch_replays_an_epoch():
    s = BatchSampler(range(9), shuffle=True, batch_size=4, seed=1)
    first = list(s)
    list(s)
    s.set_epoch(0)
    assert list(s) == first


def test_batch_sampler_over_a_sampler_keeps_its_order():
    s = BatchSampler(sampler=[5, 3, 1, 0, 2], batch_size=2)
    assert list(s) == [[5, 3], [1, 0], [2]] and len(s) == 3


def test_collate_dicts_numbers_strings_and_tensors():
    batch = default_collate_fn([{"a": np.ones(2), "n": 1.5, "s": "x", "t": dt.to_tensor([1, 2])},
                                {"a": np.zeros(2), "n": 2.5, "s": "y", "t": dt.to_tensor([3, 4])}])
    np.testing.assert_array_equal(batch["a"], [[1, 1], [0, 0]])
    np.testing.assert_array_equal(batch["n"], [1.5, 2.5])
    assert batch["s"] == ["x", "y"]
    np.testing.assert_array_equal(batch["t"], [[1, 2], [3, 4]])


def test_tensor_dataset_rows():
    x, y = np.arange(12).reshape(4, 3), dt.to_tensor(np.arange(4) * 10)
    ds = TensorDataset([x, y])
    assert len(ds) == 4
    xi, yi = ds[2]
    np.testing.assert_array_equal(xi, [6, 7, 8])
    assert int(yi) == 20
    with pytest.raises(ValueError, match="different lengths"):
        TensorDataset([np.zeros(3), np.zeros(4)])


def test_bad_input_errors():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        DataLoader(Squares(3), batch_size=0)
    with pytest.raises(ValueError, match="already fixes"):
        DataLoader(Squares(3), batch_sampler=BatchSampler(range(3)), batch_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        BatchSampler()
    with pytest.raises(TypeError, match="cannot batch"):
        default_collate_fn([object(), object()])
    with pytest.raises(ValueError, match="rank must be in"):
        DistributedBatchSampler(range(4), 2, num_replicas=2, rank=2)


def _paddle_blocks(n, b, nranks, order):
    """Global batch k, read in rank order, is order[k*nranks*b : (k+1)*nranks*b] (the tail
    split evenly): each rank's list of batches, built from that definition."""
    total = -(-n // nranks) * nranks
    padded = list(order[:total])
    per_rank = [[] for _ in range(nranks)]
    body = total - total % (b * nranks)
    for k in range(0, body, b * nranks):
        for r in range(nranks):
            per_rank[r] += padded[k + r * b:k + (r + 1) * b]
    tail = padded[body:]
    per = len(tail) // nranks
    for r in range(nranks):
        per_rank[r] += tail[r * per:(r + 1) * per]
    return [[lst[i:i + b] for i in range(0, len(lst), b)] for lst in per_rank]


@pytest.mark.parametrize("n,b,nranks", [(10, 2, 3), (8, 2, 2), (7, 3, 4), (3, 2, 4), (12, 5, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_batch_sampler_splits_every_global_batch_by_rank(n, b, nranks, drop_last):
    order = [i % n for i in range(-(-n // nranks) * nranks)]   # padded from the start
    want = _paddle_blocks(n, b, nranks, order)
    for r in range(nranks):
        s = DistributedBatchSampler(range(n), b, num_replicas=nranks, rank=r, drop_last=drop_last)
        got = list(s)
        exp = [x for x in want[r] if len(x) == b or not drop_last]
        assert got == exp, (r, got, exp)
        assert len(s) == len(exp)
    seen = sorted(i for r in range(nranks)
                  for batch in DistributedBatchSampler(range(n), b, num_replicas=nranks, rank=r)
                  for i in batch)
    assert set(seen) == set(range(n))


def test_distributed_batch_sampler_shuffles_per_epoch_the_same_on_every_rank():
    n, b, nranks = 11, 2, 3
    samplers = [DistributedBatchSampler(range(n), b, num_replicas=nranks, rank=r, shuffle=True)
                for r in range(nranks)]
    epoch0 = [sum(list(s), []) for s in samplers]
    epoch1 = [sum(list(s), []) for s in samplers]
    assert epoch0 != epoch1
    for ep in (epoch0, epoch1):   # together the ranks cover the padded dataset
        assert sorted(set(i for lst in ep for i in lst)) == list(range(n))
        assert sum(len(lst) for lst in ep) == 12
    for s in samplers:
        s.set_epoch(0)
    assert [sum(list(s), []) for s in samplers] == epoch0
