"""bfloat16 as a dtype: names, Paddle's promotion table, kernels computing in float32 and
rounding (against ml_dtypes + numpy), gradients, Layer dtype conversion, bad input."""
from __future__ import annotations

import numpy as np
import pytest
from amp_oracle import BF16, bf, is_bf16_exact

import disttensor as dt
import disttensor.nn.functional as F


def _t(a, dtype="float32", grad=False):
    t = dt.to_tensor(np.asarray(a, np.float32)).cast(dtype)
    t.stop_gradient = not grad
    return t


def test_names_and_creation():
    assert dt.bfloat16 == BF16
    x = dt.to_tensor(np.ones((2, 3), np.float32), dtype="bfloat16")
    assert x.dtype == BF16 and x.numpy().dtype == BF16
    assert dt.zeros([2], dtype="bfloat16").dtype == BF16
    with pytest.raises(TypeError, match="dtype: unsupported dtype name 'bfloat17'"):
        dt.zeros([2], dtype="bfloat17")


@pytest.mark.parametrize("a,b,want", [
    ("bfloat16", "bfloat16", "bfloat16"), ("bfloat16", "float16", "float32"),
    ("float16", "bfloat16", "float32"), ("bfloat16", "float32", "float32"),
    ("float64", "bfloat16", "float64")])
def test_promotion_table(a, b, want):
    x, y = _t(np.ones(3), a), _t(np.full(3, 2.0), b)
    for r in (x + y, x * y, dt.maximum(x, y), dt.where(x > 0, x, y)):
        assert r.dtype == dt.dtype.to_np_dtype(want)
        np.testing.assert_array_equal(r.numpy().astype(np.float32)[0], (r.numpy()[0]))
    assert (x + 1.5).dtype == x.dtype           # Tensor-scalar keeps the tensor's dtype


def test_promotion_refuses_int_with_bfloat16():
    x, i = _t(np.ones(3), "bfloat16"), dt.to_tensor(np.ones(3, np.int32))
    with pytest.raises(TypeError, match=r"add: inputs of different dtypes \(input 0: bfloat16, "
                                        r"input 1: int32\).*shapes \[\[3\], \[3\]\]"):
        dt.add(x, i)
    with pytest.raises(TypeError, match="matmul: .*bfloat16.*float32"):
        dt.matmul(_t(np.ones((2, 2)), "bfloat16"), _t(np.ones((2, 2))))


def test_kernels_compute_in_float32_and_round():
    rng = np.random.default_rng(1)
    a, b = bf(rng.standard_normal((5, 7))), bf(rng.standard_normal((7, 3)))
    x, y = _t(a, "bfloat16"), _t(b, "bfloat16")
    got = dt.matmul(x, y)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.numpy().astype(np.float32), bf(a @ b))
    s = got.sum(axis=1)
    assert s.dtype == BF16
    np.testing.assert_allclose(s.numpy().astype(np.float32), bf((a @ b).sum(1)), rtol=2 ** -7)
    sm = F.softmax(x, axis=-1).numpy().astype(np.float32)
    e = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(sm, bf(e / e.sum(-1, keepdims=True)), rtol=2 ** -7, atol=1e-6)
    assert is_bf16_exact(sm)
    ln = F.layer_norm(x, [7]).numpy().astype(np.float32)
    mu, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
    np.testing.assert_allclose(ln, bf((a - mu) / np.sqrt(var + 1e-5)), rtol=2 ** -7, atol=1e-2)


def test_gradients_arrive_in_bfloat16():
    rng = np.random.default_rng(2)
    a, b = bf(rng.standard_normal((4, 6))), bf(rng.standard_normal((6, 3)))
    x, y = _t(a, "bfloat16", grad=True), _t(b, "bfloat16", grad=True)
    dt.matmul(x, y).exp().sum().backward()
    assert x.grad.dtype == BF16 and y.grad.dtype == BF16
    g = bf(np.exp(bf(a @ b)))                      # exp's gradient, rounded
    np.testing.assert_allclose(x.grad.numpy().astype(np.float32), bf(g @ b.T), rtol=2 ** -7)
    np.testing.assert_allclose(y.grad.numpy().astype(np.float32), bf(a.T @ g), rtol=2 ** -7)


def test_promoting_op_gives_each_input_its_own_gradient_dtype():
    x, y = _t([1.0, 2.0], "bfloat16", grad=True), _t([3.0, 4.0], "float32", grad=True)
    (x * y).sum().backward()
    assert x.grad.dtype == BF16 and y.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad.numpy().astype(np.float32), [3.0, 4.0])
    np.testing.assert_array_equal(y.grad.numpy(), [1.0, 2.0])


class _Net(dt.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = dt.nn.Linear(4, 4)
        self.norm = dt.nn.LayerNorm(4)


@pytest.mark.parametrize("method,want", [("half", np.float16), ("bfloat16", BF16),
                                         ("float16", np.float16)])
def test_layer_dtype_methods(method, want):
    net = _Net()
    w = net.fc.weight.numpy()
    assert getattr(net, method)() is net
    assert {p.dtype for p in net.parameters()} == {np.dtype(want)}
    np.testing.assert_array_equal(net.fc.weight.numpy(), w.astype(want))
    net.float()
    assert {p.dtype for p in net.parameters()} == {np.dtype(np.float32)}
    getattr(net, method)(excluded_layers=[dt.nn.LayerNorm])
    assert net.fc.weight.dtype == want and net.norm.weight.dtype == np.float32
    net.to(dtype="bfloat16")
    assert net.norm.weight.dtype == BF16


def test_layer_dtype_bad_input_changes_nothing():
    net = _Net()
    with pytest.raises(TypeError, match="_Net.to: argument 'dtype'.*'float8'"):
        net.to(dtype="float8")
    with pytest.raises(TypeError, match="_Net.to: argument 'dtype' must be a floating dtype, "
                                        "got int32"):
        net.to(dtype="int32")
    with pytest.raises(TypeError, match="_Net.half: argument 'excluded_layers'"):
        net.half(excluded_layers=["norm"])
    assert {p.dtype for p in net.parameters()} == {np.dtype(np.float32)}


def test_bfloat16_checkpoint_round_trip(tmp_path):
    net = _Net().bfloat16()
    dt.save_state_dict(net.state_dict(), str(tmp_path / "ckpt"))
    other = _Net().bfloat16()
    target = other.state_dict()
    dt.load_state_dict(target, str(tmp_path / "ckpt"))
    for (k, a), b in zip(net.state_dict().items(), other.state_dict().values()):
        assert b.dtype == BF16
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=k)
