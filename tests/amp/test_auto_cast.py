"""auto_cast O1/O2 as a dispatch policy, against a numpy step that rounds the white-list
inputs to bfloat16 (ml_dtypes) and keeps the black list in float32; custom lists, nesting,
backward without the policy, capture, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from amp_oracle import BF16, bf, is_bf16_exact, model_arrays, o1_step

import disttensor as dt
import disttensor.nn.functional as F


def _leaf(a):
    t = dt.to_tensor(a)
    t.stop_gradient = False
    return t


def _o1_loss(x, w, b, dtype="bfloat16"):
    with dt.amp.auto_cast(dtype=dtype):
        y = dt.matmul(x, w)
        z = y + b
        loss = dt.pow(dt.exp(z), 2.0).mean()
    return y, z, loss


def test_o1_step_equals_numpy():
    xa, wa, ba = model_arrays()
    x, w, b = dt.to_tensor(xa), _leaf(wa), _leaf(ba)
    y, z, loss = _o1_loss(x, w, b)
    assert y.dtype == BF16 and z.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    want_loss, want_dw, want_db = o1_step(xa, wa, ba)
    np.testing.assert_allclose(loss.numpy(), want_loss, rtol=1e-6)
    assert w.grad.dtype == np.float32 and is_bf16_exact(w.grad.numpy())
    np.testing.assert_allclose(w.grad.numpy(), want_dw, rtol=2 ** -7)
    np.testing.assert_allclose(b.grad.numpy(), want_db, rtol=1e-6)
    # without autocast the same step is float32 throughout (and differs)
    w.grad = b.grad = None
    plain = dt.pow(dt.exp(dt.matmul(x, w) + b), 2.0).mean()
    assert not np.isclose(plain.numpy(), want_loss, rtol=1e-6)


def test_black_list_runs_low_inputs_in_float32():
    a = bf(np.random.default_rng(3).standard_normal((3, 5)))
    x = dt.to_tensor(a).cast("bfloat16")
    with dt.amp.auto_cast(dtype="bfloat16"):
        s = F.softmax(x)
        ln = F.layer_norm(x, [5])
        tot = x.sum()
    assert s.dtype == ln.dtype == tot.dtype == np.float32
    e = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(s.numpy(), e / e.sum(-1, keepdims=True), rtol=1e-6)
    assert not is_bf16_exact(s.numpy())


def test_float16_and_custom_lists():
    xa, wa, _ = model_arrays()
    x, w = dt.to_tensor(xa), dt.to_tensor(wa)
    with dt.amp.auto_cast(dtype="float16"):
        assert dt.matmul(x, w).dtype == np.float16
    with dt.amp.auto_cast(dtype="bfloat16", custom_black_list=["matmul"]):
        assert dt.matmul(x, w).dtype == np.float32
    with dt.amp.auto_cast(dtype="bfloat16", custom_white_list=["softmax"]):
        assert F.softmax(x).dtype == BF16
    with dt.amp.auto_cast(dtype="bfloat16"):
        with dt.amp.auto_cast(enable=False):
            assert dt.matmul(x, w).dtype == np.float32
        assert dt.matmul(x, w).dtype == BF16
        lo = x.cast("bfloat16")
        assert dt.concat([lo, x]).dtype == np.float32          # promote: the widest
    assert dt.matmul(x, w).dtype == np.float32                  # restored after the block


def test_o2_runs_mixed_unlisted_ops_low():
    lo = dt.to_tensor(np.ones(3, np.float32)).cast("bfloat16")
    hi = dt.to_tensor(np.full(3, 0.5, np.float32))
    with dt.amp.auto_cast(level="O1", dtype="bfloat16"):
        assert (lo + hi).dtype == np.float32
    with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
        assert (lo + hi).dtype == BF16
        assert (hi + hi).dtype == np.float32


def test_backward_runs_without_the_policy():
    xa, wa, _ = model_arrays(1)
    w = _leaf(wa)
    with dt.amp.auto_cast(dtype="bfloat16"):
        y = dt.matmul(dt.to_tensor(xa), w)
        y.cast("float32").sum().backward()          # backward inside the block
    # the matmul's gradient ran in bfloat16 (its forward's dtype), then cast back
    assert w.grad.dtype == np.float32 and is_bf16_exact(w.grad.numpy())
    np.testing.assert_allclose(w.grad.numpy(), bf(bf(xa).T @ np.ones((6, 5), np.float32)),
                               rtol=2 ** -7)


def test_captured_o1_step_equals_eager():
    xa, wa, ba = model_arrays(4)

    def run(captured):
        w, b = _leaf(wa), _leaf(ba)
        opt = dt.optimizer.SGD(learning_rate=0.01, parameters=[w, b])

        def step(x):
            _, _, loss = _o1_loss(x, w, b)
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss
        f = dt.jit.to_static(step) if captured else step
        losses = [f(dt.to_tensor(xa * (k + 1) / 4)).numpy() for k in range(3)]
        return losses, w.numpy(), b.numpy()
    eager, captured = run(False), run(True)
    for a, c in zip(eager[0], captured[0]):
        np.testing.assert_array_equal(c, a)
    np.testing.assert_array_equal(captured[1], eager[1])
    np.testing.assert_array_equal(captured[2], eager[2])


@pytest.mark.parametrize("kwargs,match", [
    ({"level": "O3"}, "auto_cast: argument 'level' must be one of"),
    ({"dtype": "float8"}, ("auto_cast: argument 'dtype' must be 'float16' or 'bfloat16', got "
                           "'float8'")),
    ({"dtype": "float32"}, "auto_cast: argument 'dtype'"),
    ({"custom_white_list": ["matmul"], "custom_black_list": ["matmul"]},
     r"auto_cast: ops \['matmul'\] are in both"),
])
def test_bad_input(kwargs, match):
    x = dt.to_tensor(np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match=match):
        with dt.amp.auto_cast(**kwargs):
            pass
    assert dt.matmul(x, x).dtype == np.float32          # no policy left installed
    with pytest.raises(TypeError, match="auto_cast: argument 'custom_white_list'"):
        with dt.amp.auto_cast(custom_white_list="matmul"):
            pass


def test_supported_dtypes_per_device():
    assert dt.amp.is_float16_supported() and dt.amp.is_bfloat16_supported()
    assert dt.amp.is_float16_supported("gpu:0") and not dt.amp.is_bfloat16_supported("cuda")
    with pytest.raises(ValueError, match="is_bfloat16_supported: argument 'device'"):
        dt.amp.is_bfloat16_supported("tpu")
