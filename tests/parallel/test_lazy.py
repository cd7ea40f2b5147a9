"""LazyGuard: parameters made under the guard hold no memory, and placing them (parallelize,
shard_layer, its shard_fn, p.initialize()) samples each rank's pieces with the values of the
model built without the guard; later draws of the generator agree too."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Replicate, Shard, nn
from disttensor.nn import initializer as I

pytestmark = pytest.mark.mpi


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, weight_attr=dt.ParamAttr(initializer=I.Normal(0, 0.5)))
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 5, weight_attr=dt.ParamAttr(initializer=I.KaimingNormal()),
                             bias_attr=dt.ParamAttr(initializer=I.Constant(0.25)))

    def forward(self, ids):
        return self.fc2(self.fc1(self.emb(ids)))


def dp_mp():
    n = collectives.init().size
    grid = [[0, 1], [2, 3]] if n == 4 else [list(range(n))]
    return dt.ProcessMesh(grid, dim_names=["dp", "mp"])


def _reference():
    dt.seed(11)
    net = Net()
    after = dt.rand([4]).numpy()
    return {k: v.numpy() for k, v in net.state_dict().items()}, after


def test_lazy_parameters_hold_no_memory_and_use_shows_nan():
    with dt.LazyGuard():
        net = Net()
    for p in net.parameters():
        assert dt.parallel.lazy.is_lazy(p)
        arr = p._value.array
        assert arr.strides == (0,) * arr.ndim and list(arr.shape) == p.shape
    assert np.isnan(net.fc1.weight.numpy()).all()


def _lazy_net():
    """Net built under LazyGuard from seed 11 (the seed _reference draws with)."""
    dt.seed(11)
    with dt.LazyGuard():
        return Net()


def test_parallelize_samples_only_pieces_equal_to_the_dense_model(comm):
    ref, after = _reference()
    mesh = dp_mp()
    net = _lazy_net()
    got_after = dt.rand([4]).numpy()
    net, _ = dt.parallelize(net, None, mesh, {"mp_config": {"parallelize_plan": {
        "fc1": dt.ColWiseParallel(), "fc2": dt.RowWiseParallel()}}})
    np.testing.assert_array_equal(got_after, after)
    for k, v in net.state_dict().items():
        assert v.is_dist()
        np.testing.assert_array_equal(v.numpy(), ref[k], err_msg=k)
    w = net.fc1.weight  # [6, 10] as [R, S(1)]: this rank holds its columns only
    cols = np.array_split(np.arange(10), mesh.shape[1])[mesh.get_coord(dt.get_rank())[1]]
    assert w._value.local.array.shape == (6, len(cols))


def test_shard_layer_shard_fn_and_initialize(comm):
    ref, _ = _reference()
    mesh = dp_mp()
    net = _lazy_net()

    def shard_fn(name, sub, m):
        if name == "fc2":
            sub.weight = dt.shard_tensor(sub.weight, m, [Replicate(), Shard(0)])
    dt.shard_layer(net, mesh, shard_fn)
    assert net.fc2.weight.placements == [Replicate(), Shard(0)]
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), ref[k], err_msg=k)
    dense = _lazy_net()
    for p in dense.parameters():
        assert p.initialize() is p
    for k, v in dense.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), ref[k], err_msg=k)
