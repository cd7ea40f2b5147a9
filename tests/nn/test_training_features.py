"""Parameter groups, gradient clipping, LR schedules and PyTorch spellings against numpy-only
references (single process; the distributed global norm is in tests/parallel)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn
from disttensor.optimizer import lr as sched

RNG = np.random.default_rng(7)
SHAPES = [(3, 4), (4,), (2, 3)]
P0 = [RNG.standard_normal(s).astype(np.float32) for s in SHAPES]
GRADS = [[(3 * RNG.standard_normal(s)).astype(np.float32) for s in SHAPES] for _ in range(6)]


def _params():
    ps = []
    for i, a in enumerate(P0):
        p = dt.create_parameter(list(a.shape), "float32", name=f"p{i}")
        with dt.no_grad():
            p.copy_(dt.to_tensor(a))
        ps.append(p)
    return ps


def ref_warmup_cosine(step, base, warmup, total):
    if step < warmup:
        return base * step / warmup
    return base * (1 + math.cos(math.pi * (step - warmup) / total)) / 2


def ref_adamw_groups_clip(base_lr, groups, clip, warmup, total, b1=0.9, b2=0.999, eps=1e-8):
    """numpy AdamW with per-group (weight_decay, lr scale), global-norm clipping (Paddle's
    rule) and linear warmup + cosine, stepped once per update."""
    p = [a.astype(np.float64) for a in P0]
    m = [np.zeros_like(a) for a in p]
    v = [np.zeros_like(a) for a in p]
    for t, grads in enumerate(GRADS, 1):
        lr = ref_warmup_cosine(t - 1, base_lr, warmup, total)
        gn = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
        grads = [g * clip / max(gn, clip) for g in grads]
        for i, g in enumerate(grads):
            wd, scale = groups[i]
            lr_i = lr * scale
            p[i] = p[i] * (1 - lr_i * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            p[i] = p[i] - lr_i * (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps)
    return p


def _warmup_cosine(base, warmup, total):
    return sched.LinearWarmup(sched.CosineAnnealingDecay(base, T_max=total), warmup, 0.0, base)


def _train(opt, params, scheduler):
    for grads in GRADS:
        for p, g in zip(params, grads):
            p.grad = dt.to_tensor(g)
        opt.step()
        scheduler.step()


def test_adamw_groups_clip_warmup_cosine_matches_numpy():
    ps = _params()
    s = _warmup_cosine(0.05, 2, 10)
    opt = dt.optimizer.AdamW(s, parameters=[
        {"params": [ps[0], ps[2]], "weight_decay": 0.1},
        {"params": [ps[1]], "weight_decay": 0.0, "learning_rate": 0.5}],
        grad_clip=nn.ClipGradByGlobalNorm(1.0))
    _train(opt, ps, s)
    ref = ref_adamw_groups_clip(0.05, [(0.1, 1.0), (0.0, 0.5), (0.1, 1.0)], 1.0, 2, 10)
    for p, r in zip(ps, ref):
        np.testing.assert_allclose(p.numpy(), r, rtol=2e-5, atol=1e-6)


def test_grad_clip_leaves_grad_attribute():
    ps = _params()
    opt = dt.optimizer.SGD(0.1, parameters=ps, grad_clip=nn.ClipGradByGlobalNorm(0.01))
    for p, g in zip(ps, GRADS[0]):
        p.grad = dt.to_tensor(g)
    opt.step()
    gn = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in GRADS[0]))
    for p, p0, g in zip(ps, P0, GRADS[0]):
        np.testing.assert_array_equal(p.grad.numpy(), g)
        np.testing.assert_allclose(p.numpy(), p0 - 0.1 * g * 0.01 / gn, rtol=1e-5, atol=1e-7)


def test_clip_by_norm_and_value():
    pairs = [(None, dt.to_tensor(g)) for g in GRADS[1]]
    for (_, c), g in zip(nn.ClipGradByNorm(0.5)(pairs), GRADS[1]):
        n = np.sqrt((g.astype(np.float64) ** 2).sum())
        np.testing.assert_allclose(c.numpy(), g * 0.5 / max(n, 0.5), rtol=1e-6)
    for (_, c), g in zip(nn.ClipGradByValue(0.7)(pairs), GRADS[1]):
        np.testing.assert_array_equal(c.numpy(), np.clip(g, -0.7, 0.7))


def test_clip_grad_norm_torch_rule():
    ps = _params()
    for p, g in zip(ps, GRADS[2]):
        p.grad = dt.to_tensor(g)
    total = dt.nn.utils.clip_grad_norm_(ps, max_norm=1.0)
    gn = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in GRADS[2]))
    np.testing.assert_allclose(float(total.numpy()), gn, rtol=1e-6)
    for p, g in zip(ps, GRADS[2]):
        np.testing.assert_allclose(p.grad.numpy(), g * min(1.0, 1.0 / (gn + 1e-6)), rtol=1e-6)


def test_clip_grad_norm_float16_accumulates_in_float32():
    g = np.full((256,), 300.0, np.float32)          # squares overflow float16
    p = dt.create_parameter([256], "float16")
    p.grad = dt.to_tensor(g.astype(np.float16))
    total = dt.nn.utils.clip_grad_norm_([p], max_norm=1e9)
    np.testing.assert_allclose(float(total.numpy()), 300.0 * 16, rtol=1e-3)


def test_clip_grad_norm_nonfinite():
    p = dt.create_parameter([2], "float32")
    p.grad = dt.to_tensor(np.array([1.0, np.inf], np.float32))
    with pytest.raises(RuntimeError, match="clip_grad_norm_: the total norm .* inf"):
        dt.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    np.testing.assert_array_equal(p.grad.numpy(), [1.0, np.inf])   # nothing modified


@pytest.mark.parametrize("make,ref", [
    (lambda: sched.StepDecay(0.1, step_size=3, gamma=0.5), lambda t: 0.1 * 0.5 ** (t // 3)),
    (lambda: sched.MultiStepDecay(0.1, [2, 5], 0.1),
     lambda t: 0.1 * 0.1 ** ((t >= 2) + (t >= 5))),
    (lambda: sched.ExponentialDecay(0.1, 0.9), lambda t: 0.1 * 0.9 ** t),
    (lambda: sched.PolynomialDecay(0.1, 4, end_lr=0.01, power=2.0),
     lambda t: (0.1 - 0.01) * (1 - min(t, 4) / 4) ** 2 + 0.01),
    (lambda: sched.CosineAnnealingDecay(0.1, T_max=5, eta_min=0.01),
     lambda t: 0.01 + 0.09 * (1 + math.cos(math.pi * t / 5)) / 2),
    (lambda: sched.LambdaDecay(0.1, lambda e: 1 / (e + 1)), lambda t: 0.1 / (t + 1)),
    (lambda: sched.LinearWarmup(0.1, 4, 0.02, 0.1),
     lambda t: 0.02 + 0.08 * t / 4 if t < 4 else 0.1),
    (lambda: sched.OneCycleLR(1.0, total_steps=10, divide_factor=10.0, end_learning_rate=0.0,
                              anneal_strategy="linear"),
     lambda t: 0.1 + 0.9 * t / 2 if t <= 2 else 1.0 - (t - 2) / 7),
])
def test_schedules(make, ref):
    s = make()
    opt = dt.optimizer.SGD(s, parameters=_params())
    for t in range(10):
        assert opt.get_lr() == pytest.approx(ref(t), rel=1e-12, abs=1e-15), t
        s.step()


def test_schedule_round_trips_through_state_dict():
    s = _warmup_cosine(0.1, 3, 10)
    opt = dt.optimizer.AdamW(s, parameters=_params())
    for _ in range(5):
        s.step()
    saved = opt.state_dict()["LR_Scheduler"]
    s2 = _warmup_cosine(0.1, 3, 10)
    opt2 = dt.optimizer.AdamW(s2, parameters=_params())
    opt2.set_state_dict({k: (v.numpy() if isinstance(v, dt.Tensor) else v)
                         for k, v in opt.state_dict().items()})
    assert saved["last_epoch"] == 5 and s2.last_epoch == 5
    for _ in range(4):
        assert opt2.get_lr() == opt.get_lr()
        s.step()
        s2.step()


def test_pytorch_spellings():
    ps = _params()
    opt = dt.optimizer.AdamW(ps, lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert (opt.get_lr(), opt._beta1, opt._beta2, opt._epsilon, opt._weight_decay) == \
        (0.05, 0.8, 0.9, 1e-6, 0.1)
    lin = nn.Linear(2, 2)
    sgd = dt.optimizer.SGD(lin.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    assert sgd.get_lr() == 0.1 and sgd._use_nesterov
    lin(dt.ones([1, 2])).sum().backward()
    sgd.step()
    sgd.zero_grad(set_to_none=True)
    assert lin.weight.grad is None
    lin(dt.ones([1, 2])).sum().backward()
    sgd.zero_grad(set_to_none=False)
    assert not np.any(lin.weight.grad.numpy())
    with pytest.raises(TypeError, match="parameters given twice"):
        dt.optimizer.Adam(ps, parameters=ps)


def test_bad_input_names_the_argument():
    ps = _params()
    with pytest.raises(ValueError, match="group 1 has no 'params'"):
        dt.optimizer.AdamW(parameters=[{"params": ps[:1]}, {"weight_decay": 0.1}])
    with pytest.raises(ValueError, match="'p0' is in group 0 and group 1"):
        dt.optimizer.AdamW(parameters=[{"params": ps[:1]}, {"params": ps}])
    with pytest.raises(ValueError, match=r"unknown keys \['lr_mult'\]"):
        dt.optimizer.SGD(parameters=[{"params": ps, "lr_mult": 2}])
    with pytest.raises(ValueError, match="beta1"):
        dt.optimizer.Adam(parameters=[{"params": ps, "beta1": 1.5}])
    with pytest.raises(ValueError, match="T_max must be a positive int"):
        sched.CosineAnnealingDecay(0.1, T_max=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        sched.LinearWarmup(0.1, -1, 0.0, 0.1)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="ClipGradByGlobalNorm: clip_norm"):
            nn.ClipGradByGlobalNorm(bad)
        with pytest.raises(ValueError, match="clip_grad_norm_: max_norm"):
            dt.nn.utils.clip_grad_norm_(ps, bad)
    with pytest.raises(TypeError, match="grad_clip"):
        dt.optimizer.SGD(parameters=ps, grad_clip=1.0)


def _stepped_adam():
    ps = _params()
    opt = dt.optimizer.Adam(0.01, parameters=ps)
    for p, g in zip(ps, GRADS[0]):
        p.grad = dt.to_tensor(g)
    opt.step()
    return ps, opt


def test_set_state_dict_into_fresh_optimizer_creates_states():
    _, opt = _stepped_adam()
    saved = {k: v.numpy() for k, v in opt.state_dict().items()}
    qs = _params()
    opt2 = dt.optimizer.Adam(0.01, parameters=qs)     # no states yet
    opt2.set_state_dict(saved)
    for k, v in opt2.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), saved[k])


def test_set_state_dict_strict():
    _, opt = _stepped_adam()
    saved = {k: v.numpy() for k, v in opt.state_dict().items()}
    opt2 = dt.optimizer.Adam(0.01, parameters=_params())
    before = {k: v.numpy() for k, v in opt2.state_dict().items()}
    extra = dict(saved, stray_moment1_0=np.zeros(3))
    with pytest.raises(KeyError, match=r"unused keys \['stray_moment1_0'\]"):
        opt2.set_state_dict(extra)
    partial = {k: v for k, v in saved.items() if not k.startswith("p1_")}
    with pytest.raises(KeyError, match=r"missing keys \['p1_beta1_pow_acc_0'"):
        opt2.set_state_dict(partial)
    for k, v in opt2.state_dict().items():                # nothing modified
        np.testing.assert_array_equal(v.numpy(), before[k])
    opt2.set_state_dict(dict(partial, stray=np.zeros(1)), strict=False)
    np.testing.assert_array_equal(opt2.state_dict()["p0_moment1_0"].numpy(),
                                  saved["p0_moment1_0"])
    np.testing.assert_array_equal(opt2.state_dict()["p1_moment1_0"].numpy(),
                                  before["p1_moment1_0"])
