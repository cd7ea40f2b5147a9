"""PyTorch DTensor names: init_device_mesh and mesh["tp"], distribute_tensor from one rank,
DTensor.from_local, the Tensor methods, and parallelize_module with Colwise/Rowwise/Sequence
parallel styles equal to the dense module."""
from __future__ import annotations

import numpy as np
import pytest
from parallel_models import TwoLayer

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import DTensor, Partial, Replicate, Shard, nn

pytestmark = pytest.mark.mpi


def world():
    return collectives.init()


def device_mesh():
    """("dp", "tp"): 2 x 2 on 4 ranks, else 1 x n."""
    n = world().size
    return dt.init_device_mesh("cpu", (2, 2) if n == 4 else (1, n),
                               mesh_dim_names=("dp", "tp"))


def test_init_device_mesh_and_sub_meshes_by_name():
    mesh = device_mesh()
    r = world().rank
    assert mesh.mesh_dim_names == ("dp", "tp") and mesh.size() == world().size
    tp, dp = mesh["tp"], mesh["dp"]
    coord = mesh.get_coordinate()
    assert tp.ndim == 1 and r in tp.process_ids and tp.mesh_dim_names == ("tp",)
    assert tp.process_ids == [mesh.rank_at((coord[0], j)) for j in range(mesh.shape[1])]
    assert dp.process_ids == [mesh.rank_at((i, coord[1])) for i in range(mesh.shape[0])]
    assert mesh.get_local_rank("tp") == coord[1] and tp.get_local_rank() == coord[1]
    swapped = mesh["tp", "dp"]
    assert swapped.shape == mesh.shape[::-1] and swapped.rank_at((coord[1], coord[0])) == r
    assert mesh == dt.ProcessMesh(mesh.mesh, dim_names=["dp", "tp"])
    with pytest.raises(ValueError, match="multiply to the world size"):
        dt.init_device_mesh("cpu", (world().size + 1,))
    with pytest.raises(ValueError, match="has no dim named 'pp'"):
        mesh["pp"]


def test_distribute_tensor_takes_the_source_ranks_data():
    mesh = device_mesh()
    n = world().size
    mine = np.full((5, 4), float(world().rank))     # every rank holds different data
    for src in range(n):
        x = dt.distribute_tensor(mine, mesh, [Replicate(), Shard(1)], src_data_rank=src)
        assert x.placements == [Replicate(), Shard(1)]
        np.testing.assert_array_equal(x.full_tensor().numpy(), np.full((5, 4), float(src)))
    own = dt.distribute_tensor(mine, mesh, [Shard(0), Replicate()], src_data_rank=None)
    np.testing.assert_array_equal(own.to_local().numpy(),
                                  mine[np.array_split(np.arange(5), mesh.shape[0])[
                                      mesh.get_coordinate()[0]]])
    p = nn.Linear(3, 2).weight
    q = dt.distribute_tensor(p, mesh, [Replicate(), Shard(0)])
    assert isinstance(q, nn.Parameter) and q.name == p.name and not q.stop_gradient


def test_dtensor_from_local_and_tensor_methods():
    mesh = device_mesh()
    local = np.full((2, 3), float(world().rank))
    x = DTensor.from_local(local, mesh, [Shard(0), Shard(1)])
    assert isinstance(x, DTensor) and not isinstance(dt.to_tensor(local), DTensor)
    assert x.device_mesh == mesh and x.shape == [2 * mesh.shape[0], 3 * mesh.shape[1]]
    np.testing.assert_array_equal(x.to_local().numpy(), local)
    full = x.full_tensor()
    assert not full.is_dist()
    want = np.block([[np.full((2, 3), float(mesh.rank_at((i, j)))) for j in range(mesh.shape[1])]
                     for i in range(mesh.shape[0])])
    np.testing.assert_array_equal(full.numpy(), want)
    y = x.redistribute(placements=[Replicate(), Shard(0)])
    assert y.placements == [Replicate(), Shard(0)]
    np.testing.assert_array_equal(y.numpy(), want)
    assert dt.to_tensor(local).device_mesh is None
    with pytest.raises(TypeError, match="not distributed"):
        dt.to_tensor(local).to_local()


class Block(nn.Layer):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 6)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(self.norm(x))))


X = np.random.default_rng(0).standard_normal((3, 5, 6)).astype(np.float32)


def test_parallelize_module_on_the_tp_sub_mesh_equals_the_dense_block():
    mesh = device_mesh()
    dt.seed(1)
    block = Block()
    x = dt.to_tensor(X, stop_gradient=False)
    dense = block(x)
    dense.sum().backward()
    want, want_gx = dense.numpy(), x.grad.numpy()
    want_g = {k: p.grad.numpy() for k, p in block.named_parameters()}
    block.clear_gradients(set_to_zero=False)

    tp = mesh["tp"]
    dt.parallelize_module(block, tp, {"fc1": dt.ColwiseParallel(),
                                      "fc2": dt.RowwiseParallel()})
    assert block.fc1.weight.placements == [Shard(1)] and block.fc1.weight.process_mesh == tp
    assert block.fc2.weight.placements == [Shard(0)] and block.fc2.bias.placements == [Replicate()]
    x = dt.to_tensor(X, stop_gradient=False)
    out = block(x)
    assert not out.is_dist(), "use_local_output: a plain local tensor (replicated here)"
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), want_gx, rtol=1e-5, atol=1e-6)
    for k, p in block.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), want_g[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_sequence_parallel_style_and_kept_dtensor_outputs():
    mesh = device_mesh()
    tp = mesh["tp"]
    dt.seed(2)
    block = Block()
    want = block(dt.to_tensor(X)).numpy()
    dt.parallelize_module(block, tp, {
        "norm": dt.SequenceParallel(),
        "fc1": dt.ColwiseParallel(input_layouts=Shard(1)),
        "fc2": dt.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    assert block.norm.weight.placements == [Replicate()]
    # the input is this rank's sequence piece, as in a sequence-parallel region
    j = tp.get_local_rank()
    mine = np.array_split(X, tp.size(), axis=1)[j]
    out = block(dt.to_tensor(mine))
    assert isinstance(out, DTensor) and out.placements == [Shard(1)]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)


def test_embedding_rowwise_gives_a_replicated_output():
    tp = device_mesh()["tp"]
    dt.seed(3)
    emb = nn.Embedding(9, 4)
    ids = dt.to_tensor(np.array([[0, 8, 3], [5, 5, 1]]))
    want = emb(ids).numpy()
    holder = nn.Sequential(emb)
    dt.parallelize_module(holder, tp, {"0": dt.RowwiseParallel(input_layouts=Replicate())})
    assert emb.weight.placements == [Shard(0)]
    np.testing.assert_allclose(holder(ids).numpy(), want, rtol=1e-6)


def test_parallelize_module_bad_input_changes_nothing():
    mesh = device_mesh()
    block = Block()
    with pytest.raises(ValueError, match="must be 1-d"):
        dt.parallelize_module(block, mesh, {"fc1": dt.ColwiseParallel()})
    with pytest.raises(ValueError, match="'fc3' matches no submodule"):
        dt.parallelize_module(block, mesh["tp"], {"fc1": dt.ColwiseParallel(),
                                                  "fc3": dt.RowwiseParallel()})
    with pytest.raises(ValueError, match="supports Linear and Embedding, got LayerNorm"):
        dt.parallelize_module(block, mesh["tp"], {"fc1": dt.ColwiseParallel(),
                                                  "norm": dt.RowwiseParallel()})
    assert not any(p.is_dist() for p in block.parameters())
    stack = nn.LayerList([Block(), Block()])
    dt.parallelize_module(stack, mesh["tp"], {"*.fc1": dt.ColwiseParallel(),
                                              "*.fc2": dt.RowwiseParallel()})
    assert all(stack[i].fc1.weight.is_dist() and stack[i].fc2.weight.is_dist()
               for i in range(2))
    assert not isinstance(stack[0].fc2.weight.placements[0], Partial)


def _Block():
    return TwoLayer(6, 8, 5)


def test_fully_shard_after_tp_lifts_to_the_2d_mesh_and_equals_dense():
    """TP on mesh["tp"], then fully_shard on mesh["dp"]: parameters on the 2-d mesh with dp
    sharding added to the TP layout; 3 SGD steps equal numpy's."""
    mesh = device_mesh()
    dt.seed(5)
    model = _Block()
    w1, b1 = model.fc1.weight.numpy(), model.fc1.bias.numpy()
    w2, b2 = model.fc2.weight.numpy(), model.fc2.bias.numpy()
    dt.parallelize_module(model, mesh["tp"], {
        "fc1": dt.ColwiseParallel(use_local_output=False),
        "fc2": dt.RowwiseParallel(use_local_output=False)})
    fc1_weight = model.fc1.weight
    dt.fully_shard(model, mesh=mesh["dp"])
    assert model.fc1.weight is fc1_weight and fc1_weight.process_mesh == mesh
    assert fc1_weight.placements == [Shard(0), Shard(1)]
    assert model.fc2.weight.placements == [Shard(1), Shard(0)]
    assert model.fc2.bias.placements == [Shard(0), Replicate()]
    # the column-parallel bias is split over tp first, then each tp piece over dp: one
    # all-gather over dp gives back its TP layout, and a gradient Partial over dp becomes its
    # layout by one reduce-scatter (dp first would need both mesh dims' collectives)
    b1_layout = [Shard(0, shard_order=1), Shard(0, shard_order=0)]
    assert model.fc1.bias.placements == b1_layout
    dp_moves = mesh.shape[0] > 1
    assert [s.kind for s in dt.reshard_plan(model.fc1.bias, mesh, [Replicate(), Shard(0)]).steps] \
        == ["all_gather"] * dp_moves
    grad = dt.reshard(model.fc1.bias.detach(), mesh, [Partial(), Shard(0)])
    assert [s.kind for s in dt.reshard_plan(grad, mesh, b1_layout).steps] \
        == ["reduce_scatter"] * dp_moves
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    rng = np.random.default_rng(3)
    for _ in range(3):
        x, y = rng.standard_normal((8, 6)), rng.standard_normal((8, 5))
        xd = dt.distribute_tensor(x.astype(np.float32), mesh, [Shard(0), Replicate()])
        yd = dt.distribute_tensor(y.astype(np.float32), mesh, [Shard(0), Replicate()])
        loss = F.mse_loss(model(xd), yd)
        loss.backward()
        opt.step()
        opt.clear_grad()
        h = x @ w1 + b1
        r = np.maximum(h, 0)
        g = 2 * (r @ w2 + b2 - y) / y.size
        gh = (g @ w2.T) * (h > 0)
        w2, b2 = w2 - 0.1 * r.T @ g, b2 - 0.1 * g.sum(0)
        w1, b1 = w1 - 0.1 * x.T @ gh, b1 - 0.1 * gh.sum(0)
    for p, want in ((model.fc1.weight, w1), (model.fc1.bias, b1), (model.fc2.weight, w2),
                    (model.fc2.bias, b2)):
        np.testing.assert_allclose(p.numpy(), want, rtol=1e-4, atol=1e-5)


def test_fully_shard_bad_input_changes_nothing():
    mesh = device_mesh()
    model = _Block()
    other = dt.ProcessMesh(mesh.mesh, dim_names=["a", "b"])
    model.fc1.weight = dt.shard_tensor(model.fc1.weight, other, [Replicate(), Replicate()])
    before = model.fc2.weight
    with pytest.raises(ValueError, match="fully_shard: parameter .* is not a sub-mesh"):
        dt.fully_shard(model, mesh=mesh["dp"])
    assert model.fc2.weight is before and not before.is_dist()
    with pytest.raises(ValueError, match="fully_shard: mesh must be a 1-d"):
        dt.fully_shard(_Block(), mesh=mesh)
