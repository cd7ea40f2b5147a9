"""Optimizers against hand-written numpy references over 3 steps."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn

RNG = np.random.default_rng(0)
P0 = RNG.standard_normal((3, 4)).astype(np.float32)
GRADS = [RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(3)]


def _run(make_opt, steps=3):
    """Apply ``steps`` updates with the fixed GRADS; returns (param, optimizer)."""
    p = dt.create_parameter([3, 4], "float32", attr=nn.ParamAttr(
        initializer=nn.initializer.Constant(0.0)))
    with dt.no_grad():
        p.copy_(dt.to_tensor(P0))
    opt = make_opt([p])
    ident = id(p)
    for g in GRADS[:steps]:
        p.grad = dt.to_tensor(g)
        opt.step()
        assert id(p) == ident
    return p, opt


def ref_sgd(lr, wd=0.0, mu=0.0, nesterov=False):
    p, v = P0.astype(np.float64), np.zeros_like(P0, dtype=np.float64)
    for g in GRADS:
        g = g + wd * p
        v = mu * v + g
        p = p - lr * ((g + mu * v) if nesterov else v)
    return p


def ref_adam(lr, b1=0.9, b2=0.999, eps=1e-8, l2=0.0, decoupled=0.0):
    p = P0.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(GRADS, 1):
        p = p * (1 - lr * decoupled)
        g = g + l2 * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * mh / (np.sqrt(vh) + eps)
    return p


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1}, {"momentum": 0.9},
                                {"momentum": 0.8, "weight_decay": 0.05},
                                {"momentum": 0.9, "use_nesterov": True}])
def test_sgd(kw):
    p, _ = _run(lambda ps: dt.optimizer.SGD(0.1, parameters=ps, **kw))
    ref = ref_sgd(0.1, kw.get("weight_decay", 0.0), kw.get("momentum", 0.0),
                  kw.get("use_nesterov", False))
    np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_momentum_alias_defaults():
    p, opt = _run(lambda ps: dt.optimizer.Momentum(0.05, parameters=ps))
    assert opt._momentum == 0.9
    np.testing.assert_allclose(p.numpy(), ref_sgd(0.05, mu=0.9), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wd", [None, 0.1])
def test_adam(wd):
    p, _ = _run(lambda ps: dt.optimizer.Adam(0.01, beta1=0.8, beta2=0.9, epsilon=1e-6,
                                             parameters=ps, weight_decay=wd))
    ref = ref_adam(0.01, 0.8, 0.9, 1e-6, l2=wd or 0.0)
    np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_adamw():
    p, _ = _run(lambda ps: dt.optimizer.AdamW(0.01, parameters=ps, weight_decay=0.2))
    np.testing.assert_allclose(p.numpy(), ref_adam(0.01, decoupled=0.2), rtol=1e-5, atol=1e-6)


def test_adamw_apply_decay_param_fun_and_param_lr():
    lin = nn.Linear(3, 4, weight_attr=nn.ParamAttr(learning_rate=0.5))
    w0, b0 = lin.weight.numpy(), lin.bias.numpy()
    opt = dt.optimizer.AdamW(0.01, parameters=lin.parameters(), weight_decay=0.5,
                             apply_decay_param_fun=lambda n: n.endswith("w_0"))
    lin.weight.grad = dt.zeros([3, 4])
    lin.bias.grad = dt.zeros([4])
    opt.step()
    # zero gradient: only the decay moves the weight, with the param's 0.5 lr multiplier
    np.testing.assert_allclose(lin.weight.numpy(), w0 * (1 - 0.005 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(lin.bias.numpy(), b0)


def test_skips_params_without_grad_and_frozen():
    a = nn.Linear(2, 2)
    frozen = nn.Linear(2, 2, weight_attr=nn.ParamAttr(trainable=False))
    params = a.parameters() + frozen.parameters()
    before = [p.numpy() for p in params]
    opt = dt.optimizer.Adam(0.1, parameters=params)
    a.weight.grad = dt.ones([2, 2])
    frozen.weight.grad = dt.ones([2, 2])
    opt.step()
    assert not np.allclose(a.weight.numpy(), before[0])
    for p, b in zip(params[1:], before[1:]):
        np.testing.assert_array_equal(p.numpy(), b)
    # the state dict names every trainable parameter's states (frozen ones: none); only the
    # weight's moments moved
    sd = opt.state_dict()
    trainable = [a.weight, a.bias, frozen.bias]
    assert list(sd) == [f"{p.name}_{n}_0" for p in trainable
                        for n in ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")]
    assert np.any(sd[f"{a.weight.name}_moment1_0"].numpy() != 0)
    assert not np.any(sd[f"{a.bias.name}_moment1_0"].numpy())


def test_training_loop_grads_and_clear_grad():
    dt.seed(0)
    lin = nn.Linear(3, 1)
    opt = dt.optimizer.SGD(0.1, parameters=lin.parameters())
    x = dt.randn([8, 3])
    y = lin(x).sum()
    y.backward()
    w_before = lin.weight.numpy()
    opt.step()
    np.testing.assert_allclose(lin.weight.numpy(), w_before - 0.1 * lin.weight.grad.numpy(),
                               rtol=1e-6)
    opt.clear_grad()
    assert np.all(lin.weight.grad.numpy() == 0)
    opt.zero_grad(set_to_zero=False)
    assert lin.weight.grad is None


def test_lr_and_state_dict_round_trip():
    p, opt = _run(lambda ps: dt.optimizer.Adam(0.01, parameters=ps), steps=2)
    assert opt.get_lr() == 0.01
    opt.set_lr(0.02)
    assert opt.get_lr() == 0.02
    with pytest.raises(TypeError, match="learning_rate"):
        opt.set_lr("fast")
    sd = {k: v.numpy() for k, v in opt.state_dict().items()}
    # a fresh optimizer loaded from the state continues exactly like the original
    q = dt.create_parameter([3, 4], "float32", name=p.name)
    with dt.no_grad():
        q.copy_(p)
    opt2 = dt.optimizer.Adam(0.02, parameters=[q])
    opt2.set_state_dict(sd)
    for t, o in ((p, opt), (q, opt2)):
        t.grad = dt.to_tensor(GRADS[2])
        o.step()
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-6)
    bad = dict(sd)
    bad[f"{p.name}_moment1_0"] = np.zeros((2, 2))
    with pytest.raises(ValueError, match="moment1_0' has shape"):
        opt2.set_state_dict(bad)


def test_constructor_errors():
    with pytest.raises(ValueError, match="parameters is required"):
        dt.optimizer.SGD(0.1)
    with pytest.raises(TypeError, match=r"parameters\[0\]"):
        dt.optimizer.SGD(0.1, parameters=[1.0])
    with pytest.raises(ValueError, match="beta1"):
        dt.optimizer.Adam(parameters=[], beta1=1.0)
    with pytest.raises(TypeError, match="weight_decay"):
        dt.optimizer.SGD(0.1, parameters=[], weight_decay="l2")
