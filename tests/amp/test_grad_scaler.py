"""GradScaler (dynamic loss scaling, skipped steps, state) and decorate (O2: low-precision
parameters, float32 master weights, checkpoints) in one process, against numpy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from amp_oracle import BF16, bf, model_arrays

import disttensor as dt


def _linear(w):
    layer = dt.nn.Linear(*w.shape)
    layer.weight.set_value(w)
    layer.bias.set_value(np.zeros(w.shape[1], np.float32))
    return layer


def test_scale_unscale_step_against_numpy():
    xa, wa, _ = model_arrays()
    layer = _linear(wa)
    opt = dt.optimizer.SGD(learning_rate=0.5, parameters=layer.parameters())
    scaler = dt.amp.GradScaler(init_loss_scaling=1024.0)
    loss = layer(dt.to_tensor(xa)).sum()
    scaled = scaler.scale(loss)
    np.testing.assert_allclose(scaled.numpy(), 1024.0 * loss.numpy(), rtol=1e-6)
    scaled.backward()
    np.testing.assert_allclose(layer.weight.grad.numpy(), 1024.0 * np.tile(
        xa.sum(0)[:, None], (1, 5)), rtol=1e-6)
    scaler.unscale_(opt)
    gw = np.tile(xa.sum(0)[:, None], (1, 5))
    np.testing.assert_allclose(layer.weight.grad.numpy(), gw, rtol=1e-6)
    scaler.step(opt)                  # already unscaled: not again
    scaler.update()
    np.testing.assert_allclose(layer.weight.numpy(), wa - 0.5 * gw, rtol=1e-5, atol=1e-6)
    assert scaler.get_loss_scaling() == 1024.0 and not scaler.found_inf


def test_inf_skips_the_step_and_the_scale_adapts():
    xa, wa, _ = model_arrays()
    layer = _linear(wa)
    opt = dt.optimizer.SGD(learning_rate=0.5, parameters=layer.parameters())
    scaler = dt.amp.GradScaler(init_loss_scaling=8.0, incr_every_n_steps=2,
                               decr_every_n_nan_or_inf=1)
    before = layer.weight.numpy()
    scaler.scale(layer(dt.to_tensor(xa)).sum()).backward()
    g = layer.weight.grad.numpy()
    g[0, 0] = np.inf
    layer.weight.grad = dt.to_tensor(g)
    scaler.minimize(opt, None)
    np.testing.assert_array_equal(layer.weight.numpy(), before)       # skipped
    assert scaler.get_loss_scaling() == 4.0
    for want in (4.0, 8.0, 8.0, 16.0):                                 # two good steps: x2
        opt.clear_grad()
        scaler.scale(layer(dt.to_tensor(xa)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_loss_scaling() == want
    assert not np.array_equal(layer.weight.numpy(), before)


def test_state_dict_round_trip_and_static_scaling():
    s = dt.amp.GradScaler(init_loss_scaling=32.0, incr_every_n_steps=3)
    s.load_state_dict({"scale": 32.0, "incr_count": 2, "decr_count": 0})
    sd = s.state_dict()
    assert sd["scale"] == 32.0 and sd["incr_count"] == 2 and sd["incr_every_n_steps"] == 3
    t = dt.amp.GradScaler()
    t.load_state_dict(sd)
    assert t.state_dict() == sd
    static = dt.amp.GradScaler(init_loss_scaling=4.0, use_dynamic_loss_scaling=False)
    static._finite = dt.to_tensor(False)      # as after a step whose gradients held inf
    static.update()
    assert static.get_loss_scaling() == 4.0
    off = dt.amp.GradScaler(enable=False)
    x = dt.to_tensor(np.ones(2, np.float32))
    assert off.scale(x) is x and off.state_dict() == {}


@pytest.mark.parametrize("kwargs,arg", [
    ({"init_loss_scaling": math.inf}, "init_loss_scaling"),
    ({"init_loss_scaling": math.nan}, "init_loss_scaling"),
    ({"init_loss_scaling": -1.0}, "init_loss_scaling"),
    ({"incr_ratio": 1.0}, "incr_ratio"), ({"decr_ratio": 1.5}, "decr_ratio"),
    ({"incr_every_n_steps": 0}, "incr_every_n_steps"),
    ({"decr_every_n_nan_or_inf": 1.5}, "decr_every_n_nan_or_inf")])
def test_bad_scaler_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=f"GradScaler: argument '{arg}'"):
        dt.amp.GradScaler(**kwargs)


def test_unscale_twice_is_refused():
    layer = _linear(model_arrays()[1])
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=layer.parameters())
    scaler = dt.amp.GradScaler()
    scaler.scale(layer(dt.to_tensor(model_arrays()[0])).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) was already called"):
        scaler.unscale_(opt)


class _Net(dt.nn.Layer):
    def __init__(self, w):
        super().__init__()
        self.fc = _linear(w)
        self.norm = dt.nn.LayerNorm(w.shape[1])

    def forward(self, x):
        return self.norm(self.fc(x))


def test_o2_master_weights_against_numpy():
    xa, wa, _ = model_arrays()
    net = _Net(wa)
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    net, opt = dt.amp.decorate(net, opt, level="O2", dtype="bfloat16")
    assert net.fc.weight.dtype == BF16 and net.norm.weight.dtype == np.float32
    np.testing.assert_array_equal(net.fc.weight.numpy().astype(np.float32), bf(wa))
    master = wa.copy()
    for _ in range(3):
        with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = net(dt.to_tensor(xa)).pow(2.0).mean()
        loss.backward()
        g = net.fc.weight.grad.numpy().astype(np.float32)
        opt.step()
        opt.clear_grad()
        master = master - np.float32(0.1) * g          # SGD on the float32 master
        np.testing.assert_allclose(opt._amp_master.master_of(net.fc.weight).numpy(),
                                   master, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(net.fc.weight.numpy().astype(np.float32), bf(master))
    # small updates accumulate in the master, not lost to bfloat16 rounding
    assert not np.array_equal(bf(master), bf(wa))
    sd = opt.state_dict()
    key = f"{net.fc.weight._label()}_fp32_master_0"
    np.testing.assert_allclose(sd[key].numpy(), master, rtol=1e-6, atol=1e-7)


def test_o2_checkpoint_round_trip():
    xa, wa, _ = model_arrays()
    net = _Net(wa)
    opt = dt.optimizer.AdamW(learning_rate=0.01, parameters=net.parameters())
    net, opt = dt.amp.decorate(net, opt, level="O2", dtype="bfloat16")
    with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
        net(dt.to_tensor(xa)).mean().backward()
    opt.step()
    sd = {k: v.numpy() for k, v in opt.state_dict().items()}
    assert any(k.endswith("_fp32_master_0") for k in sd)
    assert all(v.dtype != BF16 for v in sd.values())           # moments in float32
    net2 = _Net(np.zeros_like(wa))
    opt2 = dt.optimizer.AdamW(learning_rate=0.01, parameters=net2.parameters())
    net2, opt2 = dt.amp.decorate(net2, opt2, level="O2", dtype="bfloat16")
    opt2.create_states()
    names = {p._label(): q._label() for p, q in zip(net.parameters(), net2.parameters())}
    renamed = {}
    for k, v in sd.items():          # state keys carry the (auto-numbered) parameter names
        old = next(n for n in names if k.startswith(n + "_"))
        renamed[names[old] + k[len(old):]] = v
    opt2.set_state_dict(renamed)
    np.testing.assert_array_equal(net2.fc.weight.numpy(), net.fc.weight.numpy())


def test_decorate_o1_and_bad_input():
    net = _Net(model_arrays()[1])
    assert dt.amp.decorate(net, level="O1") is net
    assert net.fc.weight.dtype == np.float32
    opt = dt.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    with pytest.raises(ValueError, match="decorate: argument 'dtype' must be 'float16' or "
                                         "'bfloat16', got 'int8'"):
        dt.amp.decorate(net, opt, level="O2", dtype="int8")
    with pytest.raises(ValueError, match="decorate: argument 'level'"):
        dt.amp.decorate(net, opt, level="O4")
    with pytest.raises(TypeError, match="decorate: argument 'models'"):
        dt.amp.decorate("net", opt, level="O2")
    assert net.fc.weight.dtype == np.float32                    # nothing changed
    dt.amp.decorate(net, opt, level="O2", dtype="float16")
    with pytest.raises(ValueError, match="decorate: optimizer SGD is already decorated"):
        dt.amp.decorate(net, opt, level="O2", dtype="float16")
