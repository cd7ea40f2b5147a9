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


# -- PyTorch spellings ------------------------------------------------------------------------

def test_set_state_dict_strict_names_the_keys_and_copies_nothing():
    m = nn.Linear(2, 3)
    old_w = m.weight.numpy()
    bad = {"weight": np.ones((2, 3)), "extra": np.zeros(1)}
    with pytest.raises(ValueError, match=r"strict=True.*missing keys \['bias'\], unexpected "
                                         r"keys \['extra'\]"):
        m.set_state_dict(bad, strict=True)
    np.testing.assert_array_equal(m.weight.numpy(), old_w)  # nothing copied
    with pytest.raises(ValueError, match=r"missing keys \['bias'\]"):
        m.load_state_dict({"weight": np.ones((2, 3))})  # torch's alias: strict by default
    np.testing.assert_array_equal(m.weight.numpy(), old_w)
    with pytest.warns(UserWarning, match="missing keys"):
        res = m.load_state_dict(bad, strict=False)
    assert res.missing_keys == ["bias"] and res.unexpected_keys == ["extra"]
    missing, unexpected = res  # Paddle's (missing, unexpected) tuple
    assert (missing, unexpected) == (["bias"], ["extra"])
    np.testing.assert_array_equal(m.weight.numpy(), 1.0)
    res = m.load_state_dict({"weight": np.full((2, 3), 2.0), "bias": np.arange(3.0)})
    assert tuple(res) == ([], [])
    np.testing.assert_array_equal(m.bias.numpy(), [0, 1, 2])


class TorchStyle(nn.Module):
    """A model written with PyTorch's names only."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, 4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 1)})
        self.add_module("act", nn.Tanh())

    def forward(self, x):
        for block in self.blocks:
            x = self.act(block(x))
        return self.heads["a"](x).sum() + self.heads["b"](x).sum()


def test_torch_style_module_trains_like_numpy():
    dt.manual_seed(3)
    m = TorchStyle()
    assert isinstance(m, nn.Layer) and nn.Module is nn.Layer
    assert nn.ModuleList is nn.LayerList and nn.ModuleDict is nn.LayerDict
    names = [n for n, _ in m.named_modules()]
    assert names == ["", "blocks", "blocks.0", "blocks.1", "heads", "heads.a", "heads.b", "act"]
    assert list(m.modules())[0] is m and len(list(m.modules())) == 8
    assert list(m.heads) == ["a", "b"] and "a" in m.heads and len(m.heads) == 2
    assert list(m.state_dict()) == ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                                    "blocks.1.bias", "heads.a.weight", "heads.a.bias",
                                    "heads.b.weight", "heads.b.bias"]
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    sd = {k: v.numpy().astype(np.float64) for k, v in m.state_dict().items()}
    loss = m(dt.to_tensor(x))
    loss.backward()
    # numpy oracle, forward and backward by hand
    h0 = x.astype(np.float64)
    z1 = h0 @ sd["blocks.0.weight"] + sd["blocks.0.bias"]
    h1 = np.tanh(z1)
    z2 = h1 @ sd["blocks.1.weight"] + sd["blocks.1.bias"]
    h2 = np.tanh(z2)
    ref = (h2 @ sd["heads.a.weight"] + sd["heads.a.bias"]).sum() + \
        (h2 @ sd["heads.b.weight"] + sd["heads.b.bias"]).sum()
    np.testing.assert_allclose(loss.numpy(), ref, rtol=1e-5)
    g_h2 = np.ones((5, 2)) @ sd["heads.a.weight"].T + np.ones((5, 1)) @ sd["heads.b.weight"].T
    g_z2 = g_h2 * (1 - h2 ** 2)
    g_z1 = (g_z2 @ sd["blocks.1.weight"].T) * (1 - h1 ** 2)
    expect = {"heads.a.weight": h2.T @ np.ones((5, 2)), "heads.b.bias": np.full(1, 5.0),
              "blocks.1.weight": h1.T @ g_z2, "blocks.0.weight": h0.T @ g_z1,
              "blocks.0.bias": g_z1.sum(0)}
    params = dict(m.named_parameters())
    for k, g in expect.items():
        np.testing.assert_allclose(params[k].grad.numpy(), g, rtol=1e-4, atol=1e-5)
    m.zero_grad()  # PyTorch's default set_to_none=True
    assert all(p.grad is None for p in m.parameters())
    m(dt.to_tensor(x)).backward()
    m.zero_grad(set_to_none=False)
    assert all(np.all(p.grad.numpy() == 0) for p in m.parameters())
    del m.heads["b"]
    assert list(m.heads.keys()) == ["a"] and "heads.b.weight" not in m.state_dict()
    with pytest.raises(KeyError, match="no sublayer 'zz'"):
        m.heads["zz"]
    with pytest.raises(TypeError, match="'c' must be a Layer"):
        m.heads["c"] = 3


def test_manual_seed_is_seed():
    dt.manual_seed(11)
    a = dt.randn([4]).numpy()
    dt.seed(11)
    np.testing.assert_array_equal(dt.randn([4]).numpy(), a)
    dt.manual_seed(12)
    assert not np.array_equal(dt.randn([4]).numpy(), a)
