"""shard_dataloader: each rank loads only its rows; the global batches equal the dense loader's
(values, order, uneven splits, empty pieces, several meshes); bad input raises everywhere."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard
from disttensor.io import DataLoader, Dataset, DistributedBatchSampler

pytestmark = pytest.mark.mpi

MESHES = {"4": ([0, 1, 2, 3], ["dp"], 4), "2x2": ([[0, 1], [2, 3]], ["dp", "mp"], 4),
          "3": ([0, 1, 2], ["dp"], 3), "2": ([0, 1], ["dp"], 2), "1": ([0], ["dp"], 1),
          "1xW": (None, ["dp", "mp"], 1)}


def world():
    return collectives.init()


def mesh(name):
    grid, names, need = MESHES[name]
    if world().size < need:
        pytest.skip(f"mesh {name} needs {need} ranks")
    if grid is None:  # [1, world]: dp of size 1, every rank along mp
        grid = [list(range(world().size))]
    return dt.ProcessMesh(grid, dim_names=names)


class Rows(Dataset):
    """Sample i: x = [i, -i, 2i] (float32), y = i (int64); records what was read."""

    def __init__(self, n):
        self.n, self.read = n, []

    def __getitem__(self, i):
        self.read.append(i)
        return np.array([i, -i, 2 * i], np.float32), np.int64(i)

    def __len__(self):
        return self.n


def _dense(n, batch, shuffle=False, drop_last=False):
    return [[t.numpy() for t in b] for b in
            DataLoader(Rows(n), batch_size=batch, shuffle=shuffle, drop_last=drop_last, seed=7)]


@pytest.mark.parametrize("name", ["4", "2x2", "3", "2", "1", "1xW"])
@pytest.mark.parametrize("n,batch,shuffle,drop_last", [(12, 4, False, False), (13, 5, True, False),
                                                      (11, 4, True, True), (9, 4, False, False)])
def test_batches_equal_the_dense_loader_and_each_rank_reads_its_rows(name, n, batch, shuffle,
                                                                      drop_last):
    m = mesh(name)
    dp = m.get_dim_size("dp")
    if batch < dp:
        pytest.skip("the global batch needs a row per data rank")
    ds = Rows(n)
    loader = dt.shard_dataloader(DataLoader(ds, batch_size=batch, shuffle=shuffle,
                                            drop_last=drop_last, seed=7), m, shard_dims="dp")
    dense = _dense(n, batch, shuffle, drop_last)
    assert len(loader) == len(dense)
    coord = m.get_coord(world().rank)
    read = []
    for (x, y), (dx, dy) in zip(loader, dense):
        want_pl = [Shard(0)] + [Replicate()] * (m.ndim - 1)
        assert x.placements == want_pl and y.placements == want_pl
        assert x.shape == list(dx.shape) and y.shape == list(dy.shape)
        if coord is None:   # outside the mesh: an empty piece
            assert x.to_local().numpy().size == 0
            continue
        np.testing.assert_array_equal(x.numpy(), dx)
        np.testing.assert_array_equal(y.numpy(), dy)
        piece = np.array_split(dy, dp)[coord[0]]   # this rank's rows of the global batch
        np.testing.assert_array_equal(x.to_local().numpy(), dx[np.isin(dy, piece)])
        read += piece.tolist()
    # only its own rows, except one peek at the first sample of a batch it has no rows of
    own = [i for i in ds.read if i in read]
    assert own == read, (ds.read, read)
    assert len(ds.read) - len(own) <= len(dense)


def test_dict_batches_on_two_meshes_with_input_keys():
    if world().size < 4:
        pytest.skip("needs 4 ranks")
    m0 = dt.ProcessMesh([0, 1], dim_names=["dp"])
    m1 = dt.ProcessMesh([2, 3], dim_names=["dp"])

    class D(Rows):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return {"x": x, "y": y}

    loader = dt.shard_dataloader(DataLoader(D(8), batch_size=4), [m0, m1], input_keys=["x", "y"])
    for b, (dx, dy) in zip(loader(), _dense(8, 4)):
        assert b["x"].process_mesh == m0 and b["y"].process_mesh == m1
        if world().rank < 2:
            np.testing.assert_array_equal(b["x"].numpy(), dx)
        else:
            np.testing.assert_array_equal(b["y"].numpy(), dy)
        assert b["x"].shape == [4, 3] and b["y"].shape == [4]


def test_shard_dims_none_replicates_the_whole_batch():
    m = mesh("1xW")
    loader = dt.shard_dataloader(DataLoader(Rows(6), batch_size=3), m, shard_dims=None)
    for (x, _), (dx, _) in zip(loader, _dense(6, 3)):
        assert x.placements == [Replicate(), Replicate()]
        np.testing.assert_array_equal(x.to_local().numpy(), dx)


def test_already_split_dataset_is_wrapped():
    m = dt.ProcessMesh(list(range(world().size)), dim_names=["dp"])
    sampler = DistributedBatchSampler(Rows(8), batch_size=2)
    loader = dt.shard_dataloader(DataLoader(Rows(8), batch_sampler=sampler), m,
                                 is_dataset_splitted=True)
    for (x, _), idx in zip(loader, DistributedBatchSampler(Rows(8), batch_size=2)):
        np.testing.assert_array_equal(x.to_local().numpy()[:, 0], idx)


def test_bad_input_raises_on_every_rank():
    m = mesh("1xW") if world().size < 2 else dt.ProcessMesh(list(range(world().size)),
                                                           dim_names=["dp"])
    dp = m.get_dim_size("dp")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        dt.shard_dataloader(DataLoader(Rows(3), batch_size=4 * dp), m)
    with pytest.raises(ValueError, match="has no dim named 'data'"):
        dt.shard_dataloader(DataLoader(Rows(8), batch_size=4), m, shard_dims="data")
    with pytest.raises(ValueError, match="already splits"):
        dt.shard_dataloader(DataLoader(Rows(8), batch_sampler=DistributedBatchSampler(
            Rows(8), batch_size=2)), m)
    if dp > 1:
        with pytest.raises(ValueError, match="smaller than the"):
            dt.shard_dataloader(DataLoader(Rows(8), batch_size=dp - 1), m)
