"""Captured programs in one process: the pitfalls peers' users hit (inplace through views,
``x[i] = v``, optimizer updates, shape changes, per-step floats, an op reading and writing one
value), dropout's mask advancing as in eager mode, DistModel's modes, the union-find over a long
inplace chain, and bad input refused at capture time with nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import nn
from disttensor.jit import CaptureError
from disttensor.jit.program import InplaceChains


def _both(make, steps: int = 4):
    """Run ``make()`` -> (step function, inputs per step, state getter) eagerly and captured;
    return both histories and the captured StaticFunction."""
    out = {}
    for captured in (False, True):
        dt.seed(0)
        step, inputs, state = make()
        f = dt.jit.to_static(step) if captured else step
        hist = []
        for k in range(steps):
            res = f(*inputs(k))
            hist.append((np.asarray(res.numpy()) if isinstance(res, dt.Tensor) else res,
                         [np.asarray(s) for s in state()]))
        out[captured] = (hist, f)
    for (r0, s0), (r1, s1) in zip(out[False][0], out[True][0]):
        np.testing.assert_array_equal(r1, r0)
        for a, b in zip(s1, s0):
            np.testing.assert_array_equal(a, b)
    return out[True][1]


def test_inplace_through_a_view_and_setitem():
    def make():
        buf = dt.to_tensor(np.arange(12.0).reshape(3, 4))
        c = dt.to_tensor(np.ones((4, 3)))

        def step(x):
            a = buf.transpose([1, 0])   # a view of the external buffer
            a.add_(c * x)               # written through the view
            buf[1, 0:3] = x * 2.0       # x[i] = v on the external
            t = x * 1.0
            t[1:3] = 7.0                # and on a temporary
            return buf.sum() + t.sum()
        return step, lambda k: (dt.to_tensor(np.full((3,), k + 1.0)),), \
            lambda: [buf.numpy()]
    f = _both(make)
    assert f.captures == 1


# writes into an external [3, 4] buffer through a view: (the view, the same view in numpy, the
# shape written); None: ``acc[:, 1:3] = x``
VIEW_WRITES = {
    "slice": (lambda a: a[1:3], lambda a: a[1:3], (2, 4)),
    "transpose": (lambda a: a.transpose([1, 0]), lambda a: a.T, (4, 3)),
    "reshape": (lambda a: a.reshape([12]), lambda a: a.reshape(12), (12,)),
    "row_of_a_transpose": (lambda a: a.transpose([1, 0])[2], lambda a: a.T[2], (3,)),
    "setitem": (None, lambda a: a[:, 1:3], (3, 2)),
}


@pytest.mark.parametrize("kind", sorted(VIEW_WRITES))
def test_writes_through_views_bump_the_versions_as_in_eager_mode(kind):
    """A captured step writing into an external buffer through a view (slice, transpose,
    reshape, a view of a view, ``x[i] = v``) bumps the buffer's version counter (shared with
    every view of it, one made outside the step included) on every replay, as eager mode does;
    values against numpy, step by step."""
    view, np_view, shape = VIEW_WRITES[kind]
    history = {}
    for captured in (False, True):
        acc = dt.to_tensor(np.arange(12.0).reshape(3, 4))
        outside = acc[0]  # a view made before any step

        def step(x):
            if view is None:
                acc[:, 1:3] = x
            else:
                view(acc).add_(x)
            return acc.sum()
        f = dt.jit.to_static(step) if captured else step
        want = acc.numpy().copy()
        got = []
        for k in range(4):
            x = np.arange(float(np.prod(shape))).reshape(shape) * (k + 1)
            total = f(dt.to_tensor(x))
            if view is None:
                np_view(want)[...] = x
            else:
                np_view(want)[...] += x
            np.testing.assert_array_equal(acc.numpy(), want, err_msg=f"step {k}")
            assert float(total.numpy()) == want.sum()
            got.append((acc.inplace_version, outside.inplace_version))
        history[captured] = got
    assert history[False] == [(k, k) for k in range(1, 5)]
    assert history[True] == history[False], f"captured {history[True]}, eager {history[False]}"
    assert not captured or f.captures == 1


def test_optimizer_updates_inside_the_step_and_set_lr_between_steps():
    def make():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = dt.optimizer.Momentum(0.1, parameters=model.parameters())
        x = dt.to_tensor(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))

        def step(x):
            loss = model(x).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        def inputs(k):
            opt.set_lr(0.1 / (k + 1))   # a scheduler: read when the update runs
            return (x,)
        return step, inputs, lambda: [p.numpy() for p in model.parameters()]
    f = _both(make, steps=5)
    assert f.captures == 2  # the first step makes the velocity states


def test_dropout_masks_advance_as_in_eager_mode():
    def make():
        w = dt.to_tensor(np.linspace(-1, 1, 24).reshape(4, 6))

        def step(x):
            return dt.nn.functional.dropout(x * w, 0.4).sum(axis=1)
        return step, lambda k: (dt.to_tensor(np.full((4, 6), k + 1.0)),), lambda: []
    f = _both(make, steps=6)
    assert f.captures == 1


def test_an_op_that_reads_and_writes_one_value():
    def make():
        s = dt.to_tensor(np.array([1.5, -2.0, 0.5]))

        def step(x):
            s.multiply_(s)  # reads and writes s
            s.add_(x)
            return s * 1.0
        return step, lambda k: (dt.to_tensor(np.full((3,), 0.1 * k)),), lambda: [s.numpy()]
    _both(make)


def test_an_inplace_product_whose_factors_both_need_grad():
    """h.multiply_(w2) with w2 needing grad saves a copy of h's old value for w2's gradient:
    the copy is an op of the captured program; updates match eager mode and numpy."""
    rng = np.random.default_rng(3)
    W1, W2 = rng.standard_normal((3, 2)), rng.standard_normal((4, 2))
    params = []

    def make():
        w1 = dt.to_tensor(W1, stop_gradient=False)
        w2 = dt.to_tensor(W2, stop_gradient=False)
        params[:] = [w1, w2]
        opt = dt.optimizer.SGD(0.1, parameters=[w1, w2])

        def step(x):
            h = dt.matmul(x, w1)
            h.multiply_(w2)
            loss = (h * h).sum()
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss
        return step, lambda k: (dt.to_tensor(np.full((4, 3), 0.1 * (k + 1))),), \
            lambda: [w1.numpy(), w2.numpy()]
    f = _both(make)
    assert f.captures == 2  # no .grad at the first entry, zeroed ones (clear_grad) after
    w1, w2 = W1.copy(), W2.copy()
    for k in range(4):  # the same steps in numpy
        x = np.full((4, 3), 0.1 * (k + 1))
        p = x @ w1
        w1, w2 = w1 - 0.1 * x.T @ (2 * p * w2 * w2), w2 - 0.1 * 2 * p * p * w2
    np.testing.assert_allclose(params[0].numpy(), w1, rtol=1e-12)
    np.testing.assert_allclose(params[1].numpy(), w2, rtol=1e-12)


@pytest.mark.parametrize("clear", ["never", "to_none_outside"])
def test_gradients_accumulate_across_replays_as_in_eager_mode(clear):
    """A step that does not clear its gradients: each replay adds to the .grad the tensor holds
    when the step begins (not to the one it held at capture); gradients set to None outside
    the step between calls need no new capture."""
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(4)]
    w = dt.to_tensor(rng.standard_normal((3, 2)).astype(np.float32), stop_gradient=False)
    w0 = w.numpy().copy()

    def step(x):
        loss = ((x @ w) ** 2).sum()
        loss.backward()
        return loss
    f = dt.jit.to_static(step)
    want = np.zeros_like(w0, dtype=np.float64)
    for x in xs:
        if clear == "to_none_outside":
            w.clear_grad()
            want[...] = 0
        f(dt.to_tensor(x))
        want += x.T.astype(np.float64) @ (2 * (x @ w0))  # d sum((xw)^2) / dw
        np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    # no gradient, then one at entry: two programs; clearing to None each time: one
    assert f.captures == (2 if clear == "never" else 1)


def test_optional_inputs_left_out_are_captured():
    """layer_norm without weight and bias, linear without bias: the kernels get None for the
    missing inputs on replay too; loss and gradient against numpy on every step."""
    import disttensor.nn.functional as F
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((6, 5)).astype(np.float32)
    w = dt.to_tensor(w0.copy(), stop_gradient=False)

    def step(x):
        h = F.linear(x, w)
        loss = (F.layer_norm(h, 5, epsilon=1e-5) * h).sum()
        loss.backward()
        g = w.grad * 1.0
        w.clear_grad()
        return loss, g
    f = dt.jit.to_static(step)
    for k in range(3):
        x = rng.standard_normal((4, 6)).astype(np.float32)
        h = x.astype(np.float64) @ w0
        mu, var = h.mean(1, keepdims=True), h.var(1, keepdims=True)
        r = 1 / np.sqrt(var + 1e-5)
        y = (h - mu) * r
        dy = h  # d(sum(y * h)) = h dy + y dh
        dh = y + r * (dy - dy.mean(1, keepdims=True) - y * (dy * y).mean(1, keepdims=True))
        loss, g = f(dt.to_tensor(x))
        np.testing.assert_allclose(loss.numpy(), (y * h).sum(), rtol=1e-4)
        np.testing.assert_allclose(g.numpy(), x.T @ dh, rtol=1e-4, atol=1e-4)
    assert f.captures == 1


def test_shape_change_captures_once_more_and_floats_never():
    w = dt.to_tensor(np.ones((4, 2)), stop_gradient=False)

    def step(x, lr):
        loss = dt.matmul(x, w).square().mean() if hasattr(dt.Tensor, "square") else \
            (dt.matmul(x, w) * dt.matmul(x, w)).mean()
        loss.backward()
        with dt.no_grad():
            w.subtract_(w.grad * lr)
        w.clear_grad()
        return loss

    f = dt.jit.to_static(step)
    rng = np.random.default_rng(1)
    xa = dt.to_tensor(rng.standard_normal((8, 4)))
    xb = dt.to_tensor(rng.standard_normal((6, 4)))
    ref = np.ones((4, 2))
    for k in range(100):
        lr = 0.01 / (1 + k)  # a different float every step: an input, not a new capture
        x = xa if k % 2 == 0 else xb
        f(x, lr)
        xv = x.numpy()
        g = 2 * xv.T @ (xv @ ref) / (xv.shape[0] * 2)
        ref = ref - np.float32(lr) * g
    assert f.captures == 2, "one capture per shape, none for the floats"
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-5)


def test_dist_model_modes():
    def build():
        dt.seed(3)
        layer = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        opt = dt.optimizer.AdamW(0.01, parameters=layer.parameters())
        return layer, opt

    rng = np.random.default_rng(2)
    xs = [dt.to_tensor(rng.standard_normal((8, 6)).astype(np.float32)) for _ in range(3)]
    ys = [dt.to_tensor(rng.integers(0, 3, 8)) for _ in range(3)]
    loss_fn = nn.CrossEntropyLoss()
    layer, opt = build()
    eager = []
    for x, y in zip(xs, ys):
        loss = loss_fn(layer(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        eager.append(float(loss.numpy()))
    layer.eval()
    with dt.no_grad():
        eager_eval = float(loss_fn(layer(xs[0]), ys[0]).numpy())
        eager_pred = layer(xs[1]).numpy()
    layer2, opt2 = build()
    model = dt.to_static(layer2, None, loss_fn, opt2)
    model.train()
    got = [float(model(x, y).numpy()) for x, y in zip(xs, ys)]
    assert got == eager
    model.eval()
    before = [p.numpy() for p in layer2.parameters()]
    val = float(model(xs[0], ys[0]).numpy())
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(before, layer2.parameters()))
    assert val == eager_eval  # dropout off, no update
    model.predict()
    for _ in range(2):  # captured, then replayed
        np.testing.assert_array_equal(model(xs[1]).numpy(), eager_pred)
    assert model.program is not None and "matmul" in str(model.program)


def test_union_find_over_a_long_inplace_chain():
    """A chain far deeper than Python's recursion limit: one root (the named input), and after
    the finds every member points straight at it (path compression; the time it takes is
    benchmarks/capture.py's ``union_find`` figure)."""
    n = 10_000
    chains = InplaceChains(n + 1, lambda v: v == 0)
    for i in range(n):
        chains.union(i, i + 1)
    assert {chains.find(i) for i in range(n + 1)} == {0}
    assert set(chains.parent) == {0}
    late = InplaceChains(n + 1, lambda v: v == n)  # the named member joins last: still the root
    for i in range(n):
        late.union(i, i + 1)
    assert {late.find(i) for i in range(n + 1)} == {n}


def test_a_long_captured_inplace_chain_is_rooted_at_its_buffer():
    acc = dt.to_tensor(np.zeros(3))

    def step(x):
        for _ in range(2000):
            acc.add_(x)
        return acc * 1.0
    f = dt.jit.to_static(step)
    x = dt.to_tensor(np.ones(3))
    f(x)
    f(x)
    np.testing.assert_array_equal(acc.numpy(), np.full(3, 4000.0))
    prog = f.program
    ext = prog.externals[0][0]
    assert all(prog.root(b) == ext for op in prog.ops for _, b in op.inplace)
    assert acc.inplace_version == 4000


def test_bad_input_is_refused_at_capture_time_with_nothing_changed():
    w = dt.to_tensor(np.ones(3), stop_gradient=False)  # a leaf that requires grad
    keep = dt.to_tensor(np.arange(3.0))

    def step(x):
        keep.add_(x)   # runs first, then must be undone
        w.add_(x)      # a mutated input that requires grad
        return keep

    f = dt.jit.to_static(step)
    with pytest.raises(CaptureError, match=r"Leaf Var.*add_"):
        f(dt.to_tensor(np.ones(3)))
    assert keep.tolist() == [0.0, 1.0, 2.0] and keep.inplace_version == 0
    assert w.tolist() == [1.0, 1.0, 1.0]

    def branchy(x):
        y = x * 2.0
        return y if bool(y.sum() > 0) else -y
    with pytest.raises(CaptureError, match="control flow"):
        dt.jit.to_static(branchy)(dt.to_tensor(np.ones(2)))


def test_returned_structures_and_printing():
    p = dt.to_tensor(np.ones((2, 2)))

    def step(x):
        y = x + p
        return {"y": y, "pair": (y.sum(), p), "n": 3}
    f = dt.jit.to_static(step)
    for k in range(3):
        out = f(dt.to_tensor(np.full((2, 2), float(k))))
        np.testing.assert_array_equal(out["y"].numpy(), np.full((2, 2), k + 1.0))
        assert out["pair"][1] is p and out["n"] == 3
        assert float(out["pair"][0].numpy()) == 4.0 * (k + 1)
    text = str(f.program)
    assert "forward(" in text and "add(" in text and "backward(" in text
