"""parallelize with Paddle's plans and shard_layer: placements, training equal to the dense
run (values and gradients), sequence parallelism, hooks, and bad plans failing before any
change."""
from __future__ import annotations

import numpy as np
import pytest
from parallel_models import TwoLayer

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Partial, Replicate, Shard, nn

pytestmark = pytest.mark.mpi


def world():
    return collectives.init()


def dp_mp():
    """[dp, mp]: 2 x 2 on 4 ranks, else 1 x n (mp spans every rank; 3 gives uneven splits)."""
    n = world().size
    grid = [[0, 1], [2, 3]] if n == 4 else [list(range(n))]
    return dt.ProcessMesh(grid, dim_names=["dp", "mp"])


def MLP():
    return TwoLayer(6, 10, 5)


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.mlp(x))


DATA = np.random.default_rng(0).standard_normal((4, 6, 6)).astype(np.float32)
LABEL = np.random.default_rng(1).standard_normal((4, 6, 3)).astype(np.float32)


def _train(model, opt, steps=3):
    losses = []
    for i in range(steps):
        loss = F.mse_loss(model(dt.to_tensor(DATA[i])), dt.to_tensor(LABEL[i]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss.numpy()))
    return losses


def _fresh(seed=0):
    dt.seed(seed)
    model = Net()
    return model, dt.optimizer.AdamW(learning_rate=0.02, parameters=model.parameters())


PLAN = {"mlp.fc1": dt.ColWiseParallel(), "mlp.fc2": dt.RowWiseParallel(),
        "head.weight": dt.ColWiseParallel()}


def test_plan_places_parameters_and_training_equals_the_dense_run():
    mesh = dp_mp()
    dense = _train(*_fresh())
    model, opt = _fresh()
    model, opt = dt.parallelize(model, opt, mesh, {"dp_config": {},
                                                   "mp_config": {"parallelize_plan": PLAN}})
    R = Replicate()
    want = {"mlp.fc1.weight": [R, Shard(1)], "mlp.fc1.bias": [R, Shard(0)],
            "mlp.fc2.weight": [R, Shard(0)], "mlp.fc2.bias": [R, R],
            "head.weight": [R, Shard(1)], "head.bias": [R, R]}
    assert {k: v.placements for k, v in model.state_dict().items()} == want
    np.testing.assert_allclose(_train(model, opt), dense, rtol=1e-5)
    ref, _ = _fresh()
    _train(ref, dt.optimizer.AdamW(learning_rate=0.02, parameters=ref.parameters()))
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7, err_msg=k)
    assert dt.get_mesh() == mesh


def test_wildcard_keys_and_gather_output():
    mesh = dp_mp()

    class Stack(nn.Layer):
        def __init__(self):
            super().__init__()
            self.layers = nn.LayerList([MLP() for _ in range(2)])

        def forward(self, x):
            for m in self.layers:
                x = m(x) @ dt.ones([5, 6])
            return x

    dt.seed(3)
    model = Stack()
    x = dt.to_tensor(DATA[0])
    dense = model(x).numpy()
    dt.parallelize(model, None, mesh, {"mp_config": {"parallelize_plan": {
        "layers.*.fc1": dt.ColWiseParallel(gather_output=True),
        "layers.*.fc2": dt.RowWiseParallel(is_input_parallel=False)}}})
    for i in range(2):
        assert model.layers[i].fc1.weight.placements[1] == Shard(1)
        assert model.layers[i].fc2.weight.placements[1] == Shard(0)
    h = model.layers[0].fc1(x)
    assert h.placements[1] == Replicate(), "gather_output reshards to Replicate on mp"
    np.testing.assert_allclose(model(x).numpy(), dense, rtol=1e-5, atol=1e-6)


class SeqModel(nn.Layer):
    """embedding -> norm -> mlp -> norm -> head on [batch, seq, hidden]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm1 = nn.LayerNorm(8)
        self.mlp = MLP2()
        self.norm2 = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        h = self.norm1(self.emb(ids))
        h = h + self.mlp(h)
        return self.head(self.norm2(h))


class MLP2(nn.Layer):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


IDS = np.random.default_rng(2).integers(0, 11, (4, 6))


def test_sequence_parallel_region_equals_the_dense_model():
    mesh = dp_mp()
    dt.seed(5)
    model = SeqModel()
    ids = dt.to_tensor(IDS)
    out = model(ids)
    out.mean().backward()
    dense_out = out.numpy()
    dense_grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    model.clear_gradients(set_to_zero=False)

    seen = []
    dt.parallelize(model, None, mesh, {"dp_config": {}, "mp_config": {"parallelize_plan": {
        "emb": [dt.ColWiseParallel(), dt.SequenceParallelBegin()],
        "mlp": dt.SequenceParallelDisable(),
        "mlp.up": dt.ColWiseParallel(),
        "mlp.down": dt.RowWiseParallel(),
        "norm2": dt.PrepareLayerInput(lambda process_mesh: lambda layer, inputs:
                                      seen.append(inputs[0].placements)),
        "head": [dt.SequenceParallelEnd(), dt.ColWiseParallel()],
    }}})
    out = model(ids)
    mp = mesh.dim_names.index("mp")
    assert seen and seen[0][mp] == Shard(0), "inside the region the sequence dim is sharded"
    np.testing.assert_allclose(out.numpy(), dense_out, rtol=1e-5, atol=1e-6)
    out.mean().backward()
    for k, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), dense_grads[k], rtol=1e-4, atol=1e-6,
                                   err_msg=k)


def test_sequence_parallel_enable_on_one_layer():
    mesh = dp_mp()
    dt.seed(6)
    norm = nn.LayerNorm(8)
    x = dt.to_tensor(np.random.default_rng(4).standard_normal((2, 6, 8)).astype(np.float32))
    dense = norm(x).numpy()
    holder = nn.Sequential(norm)
    dt.parallelize(holder, None, mesh, {"mp_config": {"parallelize_plan": {
        "0": dt.SequenceParallelEnable()}}})
    np.testing.assert_allclose(holder(x).numpy(), dense, rtol=1e-5, atol=1e-6)


def test_prepare_layer_output_and_sharding_level():
    mesh = dp_mp()
    model, opt = _fresh()
    W1, B1 = model.mlp.fc1.weight.numpy().astype(np.float64), model.mlp.fc1.bias.numpy()
    ref_model, ref_opt = _fresh()  # one dense step: the expected parameters
    _train(ref_model, ref_opt, steps=1)
    ref = {k: p.numpy() for k, p in ref_model.named_parameters()}

    def to_replicate(process_mesh):
        return lambda layer, inputs, out: dt.reshard(out, process_mesh,
                                                     [Replicate()] * process_mesh.ndim)
    model, opt = dt.parallelize(model, opt, mesh, {
        "dp_config": {"sharding_level": 2}, "mp_config": {
            "parallelize_plan": {"mlp.fc1": [dt.ColWiseParallel(),
                                             dt.PrepareLayerOutput(to_replicate)]}}})
    assert isinstance(opt._shard_fn, dt.ShardingStage2)
    h = model.mlp.fc1(dt.to_tensor(DATA[0]))
    assert h.placements == [Replicate(), Replicate()]
    np.testing.assert_allclose(h.numpy(), DATA[0].astype(np.float64) @ W1 + B1, rtol=1e-5,
                               atol=1e-6)
    # the stage-2 optimizer steps as AdamW does in numpy
    _train(model, opt, steps=1)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.numpy(), ref[name], rtol=1e-4, atol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="sharding_level=3 shards the optimizer"):
        dt.parallelize(_fresh()[0], None, mesh, {"dp_config": {"sharding_level": 3}})


def test_bad_plans_raise_before_any_parameter_changes():
    mesh = dp_mp()
    model, opt = _fresh()
    before = {k: v for k, v in model.state_dict().items()}
    cases = [
        ({"mp_config": {"parallelize_plan": {"mlp.fc1": dt.ColWiseParallel(),
                                             "mlp.fc9": dt.RowWiseParallel()}}},
         ValueError, "'mlp.fc9' matches no sublayer"),
        ({"mp_config": {"parallelize_plan": {"mlp.fc1": "col"}}}, TypeError, "must be a plan"),
        ({"mp_config": {"parallelize_plan": {"mlp.fc(": dt.ColWiseParallel()}}},
         ValueError, "not a valid pattern"),
        ({"dp_config": {"sharding_level": 5}}, ValueError, "sharding_level must be"),
        ({"pp_config": {"split_spec": "x"}}, ValueError,
         r"pp_config\): mesh .* has no dim named .pp."),
    ]
    for config, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            dt.parallelize(model, opt, mesh, config)
    with pytest.raises(ValueError, match="has no dim named 'mp'"):
        dt.parallelize(model, opt, dt.ProcessMesh(list(range(world().size)), dim_names=["dp"]),
                       {"mp_config": {"parallelize_plan": PLAN}})
    after = model.state_dict()
    assert all(after[k] is before[k] and not after[k].is_dist() for k in before)
    seq = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match="RowWiseParallel on '1': parameter 'weight' has shape "
                                         r"\[4\]; it needs 2 dims"):
        dt.parallelize(seq, None, mesh, {"mp_config": {"parallelize_plan": {
            "0": dt.ColWiseParallel(), "1": dt.RowWiseParallel()}}})
    assert not any(p.is_dist() for p in seq.parameters())


def test_parallelize_refuses_an_optimizer_with_state():
    model, opt = _fresh()
    _train(model, opt, steps=1)
    with pytest.raises(ValueError, match="already has state"):
        dt.parallelize(model, opt, dp_mp(), {"dp_config": {}})


def test_shard_layer_with_input_and_output_functions():
    mesh = dp_mp()
    dt.seed(7)
    model = MLP()
    x = DATA[1]
    dense = model(dt.to_tensor(x)).numpy()
    shared = model.fc1.weight

    def shard_fn(name, layer, pm):
        if name == "fc1":
            layer.weight = dt.shard_tensor(layer.weight, pm, [Replicate(), Shard(1)])

    dt.shard_layer(model, mesh, shard_fn,
                   input_fn=lambda inputs, pm: dt.shard_tensor(inputs[0], pm,
                                                               [Shard(0), Replicate()]),
                   output_fn=lambda out, pm: dt.unshard_dtensor(out))
    assert model.fc1.weight is not shared and model.fc1.weight.placements[1] == Shard(1)
    assert model.fc2.weight.placements == [Replicate(), Replicate()]
    out = model(dt.to_tensor(x))
    assert not out.is_dist()
    np.testing.assert_allclose(out.numpy(), dense, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="shard_fn must be callable"):
        dt.shard_layer(model, mesh, "not a function")


def test_rowwise_output_is_partial_until_needed():
    mesh = dp_mp()
    dt.seed(8)
    fc = nn.Linear(6, 4, bias_attr=False)
    holder = nn.Sequential(fc)
    dt.parallelize(holder, None, mesh, {"mp_config": {"parallelize_plan": {
        "0": dt.RowWiseParallel()}}})
    W = fc.weight.numpy().astype(np.float64)
    X = DATA[0].astype(np.float64)
    G = np.random.default_rng(9).standard_normal((6, 4))
    y = holder(dt.shard_tensor(DATA[0], mesh, [Replicate(), Shard(1)]))
    if mesh.get_dim_size("mp") > 1:
        assert isinstance(y.placements[1], Partial)
    np.testing.assert_allclose(y.numpy(), X @ W, rtol=1e-5, atol=1e-6)
    z = F.relu(y)  # not linear: needs the reduced value
    assert not any(isinstance(p, Partial) for p in z.placements), z.placements
    np.testing.assert_allclose(z.numpy(), np.maximum(X @ W, 0), rtol=1e-5, atol=1e-6)
    (z * dt.to_tensor(G.astype(np.float32))).sum().backward()
    np.testing.assert_allclose(fc.weight.grad.numpy(), X.T @ ((X @ W > 0) * G), rtol=1e-4,
                               atol=1e-5)
