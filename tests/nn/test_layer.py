"""Layer: registration, state_dict round trip, hooks, train/eval, initializers, containers."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn
from disttensor.nn import initializer as I


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4, 2, bias_attr=False)
        self.scale = self.create_parameter([2], default_initializer=I.Constant(2.0))
        self.register_buffer("steps", dt.zeros([1]))
        self.register_buffer("scratch", dt.zeros([2]), persistable=False)
        self.config = 7  # a plain attribute

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) * self.scale


def test_registration_and_traversal():
    m = MLP()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "fc2.weight"]
    assert m.fc2.bias is None
    for p in m.parameters():
        assert isinstance(p, dt.Tensor) and not p.stop_gradient and p.persistable and p.name
    assert [n for n, _ in m.named_sublayers()] == ["fc1", "act", "fc2"]
    assert list(m.children()) == [m.fc1, m.act, m.fc2]
    assert m.sublayers(include_self=True)[0] is m
    assert [n for n, _ in m.named_buffers()] == ["steps", "scratch"]
    assert m.config == 7 and "config" not in m.state_dict()
    assert m.fc1.weight.shape == [3, 4] and m.fc1.weight.name.endswith(".w_0")
    assert m.fc1.bias.name.endswith(".b_0")
    # reassigning a parameter name keeps it registered; None clears it
    m.scale = None
    assert "scale" not in m.state_dict() and m.scale is None
    with pytest.raises(TypeError, match="parameter 'scale'"):
        m.scale = 3
    del m.act
    assert "act" not in dict(m.named_sublayers())


def test_shared_parameter_listed_once():
    a = nn.Linear(2, 2)
    seq = nn.Sequential(a, a)
    assert len(seq.parameters()) == 2
    assert len(seq.sublayers()) == 1


def test_state_dict_round_trip_inplace():
    dt.seed(1)
    src, dst = MLP(), MLP()
    with dt.no_grad():
        src.steps.fill_(5.0)
    sd = src.state_dict()
    assert list(sd) == ["scale", "steps", "fc1.weight", "fc1.bias", "fc2.weight"]
    assert sd["fc1.weight"] is src.fc1.weight  # live tensors, not copies
    before = {k: v for k, v in dst.state_dict().items()}
    view = dst.fc1.weight[0]  # a view must see the load
    version = dst.fc1.weight.inplace_version
    missing, unexpected = dst.set_state_dict(sd)
    assert missing == [] and unexpected == []
    for k, v in dst.state_dict().items():
        assert v is before[k]  # identity kept
        np.testing.assert_array_equal(v.numpy(), sd[k].numpy())
    np.testing.assert_array_equal(view.numpy(), src.fc1.weight.numpy()[0])
    assert dst.fc1.weight.inplace_version > version
    assert not dst.fc1.weight.stop_gradient and dst.fc1.weight.grad is None
    x = dt.randn([5, 3])
    np.testing.assert_allclose(dst(x).numpy(), src(x).numpy())


def test_set_state_dict_numpy_values_and_dtype():
    m = nn.Linear(2, 3)
    w = np.arange(6, dtype=np.float64).reshape(2, 3)
    m.set_state_dict({"weight": w, "bias": [1, 2, 3]})
    assert m.weight.dtype == dt.float32
    np.testing.assert_array_equal(m.weight.numpy(), w.astype(np.float32))
    np.testing.assert_array_equal(m.bias.numpy(), [1, 2, 3])


def test_set_state_dict_shape_mismatch_and_keys():
    m = nn.Linear(2, 3)
    old = m.bias.numpy()
    with pytest.raises(ValueError, match=r"'weight' has shape \[3, 2\].*\[2, 3\]"):
        m.set_state_dict({"bias": np.ones(3), "weight": np.zeros((3, 2))})
    np.testing.assert_array_equal(m.bias.numpy(), old)  # nothing copied on error
    with pytest.warns(UserWarning, match="missing keys"):
        missing, unexpected = m.set_state_dict({"weight": np.zeros((2, 3)), "extra": 1})
    assert missing == ["bias"] and unexpected == ["extra"]
    with pytest.raises(TypeError):
        m.set_state_dict([1, 2])


def test_set_state_dict_by_tensor_name():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sd = {b.weight.name: a.weight, b.bias.name: a.bias}
    b.set_state_dict(sd, use_structured_name=False)
    np.testing.assert_array_equal(b.weight.numpy(), a.weight.numpy())


def test_train_eval_and_dropout():
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    assert m.training and m[1].training
    m.eval()
    assert not m.training and not m[1].training
    x = dt.ones([8, 4])
    np.testing.assert_array_equal(m(x).numpy(), m[0](x).numpy())  # eval dropout = identity
    m.train()
    assert m[1].training
    out = m[1](dt.ones([100, 100])).numpy()
    assert set(np.unique(out)) <= {0.0, 2.0} and 0.3 < (out == 0).mean() < 0.7


def test_forward_hooks():
    m = nn.Linear(2, 2, weight_attr=I.Constant(1.0))
    calls = []

    def pre(layer, inputs):
        calls.append("pre")
        return (inputs[0] * 2,)

    def post(layer, inputs, out):
        calls.append("post")
        return out + 1

    h1 = m.register_forward_pre_hook(pre)
    h2 = m.register_forward_post_hook(post)
    x = dt.ones([1, 2])
    np.testing.assert_array_equal(m(x).numpy(), [[5.0, 5.0]])
    assert calls == ["pre", "post"]
    h1.remove()
    np.testing.assert_array_equal(m(x).numpy(), [[3.0, 3.0]])
    h2.remove()
    h2.remove()  # idempotent
    np.testing.assert_array_equal(m(x).numpy(), [[2.0, 2.0]])


def test_gradients_flow_to_parameters():
    m = MLP()
    loss = m(dt.randn([6, 3])).sum()
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, n
    m.clear_gradients()
    assert all(np.all(p.grad.numpy() == 0) for p in m.parameters())
    m.clear_gradients(set_to_zero=False)
    assert all(p.grad is None for p in m.parameters())


def test_default_initializers_follow_paddle():
    dt.seed(3)
    lin = nn.Linear(300, 200)
    w = lin.weight.numpy()
    limit = np.sqrt(6.0 / 500)
    assert np.abs(w).max() <= limit and np.abs(w).max() > 0.95 * limit  # XavierUniform
    assert np.all(lin.bias.numpy() == 0)
    ln = nn.LayerNorm([5])
    assert np.all(ln.weight.numpy() == 1) and np.all(ln.bias.numpy() == 0)
    bn = nn.BatchNorm2D(3)
    assert np.all(bn._mean.numpy() == 0) and np.all(bn._variance.numpy() == 1)
    assert bn._mean.stop_gradient and "_variance" in bn.state_dict()
    # seeded: same seed, same weights
    dt.seed(3)
    np.testing.assert_array_equal(nn.Linear(300, 200).weight.numpy(), w)


@pytest.mark.parametrize("init,check", [
    (I.Normal(1.0, 0.5), lambda a: abs(a.mean() - 1) < 0.05 and abs(a.std() - 0.5) < 0.05),
    (I.Uniform(-2, 3), lambda a: a.min() >= -2 and a.max() < 3 and abs(a.mean() - 0.5) < 0.1),
    (I.XavierNormal(), lambda a: abs(a.std() - np.sqrt(2 / 600)) < 0.005),
    (I.KaimingUniform(), lambda a: np.abs(a).max() <= np.sqrt(6 / 200)),
    (I.KaimingNormal(), lambda a: abs(a.std() - np.sqrt(2 / 200)) < 0.01),
    (I.Constant(0.25), lambda a: np.all(a == 0.25)),
])
def test_initializers(init, check):
    p = dt.create_parameter([200, 400], "float32", attr=dt.ParamAttr(initializer=init))
    assert check(p.numpy())
    # called on an existing tensor: inplace, identity kept
    q = dt.zeros([200, 400])
    assert init(q) is q and check(q.numpy())


def test_param_attr():
    lin = nn.Linear(2, 3, weight_attr=dt.ParamAttr(name="w", learning_rate=0.5, trainable=False),
                    bias_attr=False)
    assert lin.weight.name == "w" and lin.weight.stop_gradient
    assert lin.weight.optimize_attr["learning_rate"] == 0.5
    assert lin.bias is None and len(lin.parameters()) == 1
    with pytest.raises(TypeError, match="ParamAttr"):
        nn.Linear(2, 3, weight_attr=3)


def test_containers_and_repr():
    seq = nn.Sequential(("a", nn.Linear(2, 3)), ("b", nn.GELU()))
    assert seq["a"] is seq[0] and len(seq) == 2 and isinstance(seq[1:], nn.Sequential)
    assert "(a): Linear(in_features=2, out_features=3" in repr(seq)
    ll = nn.LayerList([nn.ReLU(), nn.Tanh()])
    ll.append(nn.Sigmoid())
    ll.insert(0, nn.Identity())
    assert [type(x).__name__ for x in ll] == ["Identity", "ReLU", "Tanh", "Sigmoid"]
    assert [n for n, _ in ll.named_children()] == ["0", "1", "2", "3"]
    with pytest.raises(IndexError):
        ll[4]
    with pytest.raises(TypeError, match="Sequential: item 0"):
        nn.Sequential(3)


def test_layer_validation_errors():
    with pytest.raises(ValueError, match="Linear: in_features"):
        nn.Linear(0, 3)
    with pytest.raises(ValueError, match="linear: the last dim of x"):
        nn.Linear(2, 3)(dt.ones([4, 5]))
    with pytest.raises(ValueError, match="BatchNorm2D: expected a 4-D input"):
        nn.BatchNorm2D(3)(dt.ones([4, 3]))
    with pytest.raises(ValueError, match="MSELoss: reduction"):
        nn.MSELoss("avg")

    class Bad(nn.Layer):
        def __init__(self):
            self.fc = nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="super"):
        Bad()


def test_to_dtype_keeps_identity():
    m = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1D(3))
    w, mean = m[0].weight, m[1]._mean
    m.to(dtype="float64")
    assert m[0].weight is w and w.dtype == dt.float64 and mean.dtype == dt.float64
    assert m(dt.ones([4, 2], dtype="float64")).dtype == dt.float64


def test_to_device_checks_the_name_and_keeps_what_is_there():
    m = nn.Linear(2, 3)
    w, before = m.weight, m.weight.numpy().copy()
    m.to(device="cpu")
    assert m.weight is w and m.weight._value is w._value
    np.testing.assert_array_equal(m.weight.numpy(), before)
    with pytest.raises(ValueError, match=r"Linear.to: argument 'device' .*'tpu'"):
        m.to(device="tpu")


def test_move_copies_each_piece_under_its_mesh_and_placements():
    """The copy Layer.to makes per tensor (here CPU to CPU, the one place this machine has):
    a new buffer with the same values, mesh and placements, and no gradient."""
    from disttensor.nn.layer import _move
    mesh = dt.ProcessMesh([0], dim_names=["x"])
    data = np.arange(6.0).reshape(2, 3)
    for t in (dt.to_tensor(data), dt.shard_tensor(data, mesh, [dt.Shard(0)])):
        t.grad = dt.ones([2, 3])
        before = t._local_array()
        _move(t, "cpu")
        assert t._local_array() is not before and not np.shares_memory(t._local_array(), before)
        np.testing.assert_array_equal(t.numpy(), data)
        assert t.grad is None
        if t.is_dist():
            assert t.process_mesh == mesh and t.placements == [dt.Shard(0)]


def test_embedding_padding_idx():
    emb = nn.Embedding(10, 4, padding_idx=-1)
    assert emb._padding_idx == 9
    assert np.all(emb.weight.numpy()[9] == 0)
    out = emb(dt.to_tensor([[1, 9]]))
    assert out.shape == [1, 2, 4]
    np.testing.assert_array_equal(out.numpy()[0, 1], np.zeros(4))
