"""The normal / view / inplace table (docs/guide/tensors.md) and the autograd rules around it."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor.dispatch import apply
from disttensor.ops import OPS


def T(a, **k):
    return dt.to_tensor(np.asarray(a, dtype=np.float64), **k)


def shares(view: dt.Tensor, base: dt.Tensor) -> bool:
    """Same holder (buffer and version counter) and overlapping memory."""
    return (view._value.holder is base._value.holder
            and np.shares_memory(view._value.array, base._value.holder.buffer))


# -- views ---------------------------------------------------------------------------------

VIEWS = {
    "reshape": lambda x: dt.reshape(x, [4, 6]),
    "flatten": lambda x: dt.flatten(x, 1),
    "squeeze": lambda x: dt.squeeze(dt.unsqueeze(x, 0), 0),
    "unsqueeze": lambda x: dt.unsqueeze(x, [0, 2]),
    "transpose": lambda x: dt.transpose(x, [2, 0, 1]),
    "slice": lambda x: x[1, :, 1:3],
    "slice_step": lambda x: x[:, ::2],
    "split": lambda x: dt.split(x, [1, 2], axis=1)[1],
    "chunk": lambda x: dt.chunk(x, 2, axis=2)[1],
    "detach": lambda x: dt.detach(x),
    "detach_method": lambda x: x.detach(),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_shares_buffer_and_version(name):
    x = T(np.arange(24.0).reshape(2, 3, 4))
    v = VIEWS[name](x)
    assert v is not x
    assert shares(v, x), name
    assert v._value.holder.buffer is x._value.holder.buffer
    before = x.inplace_version
    v.scale_(2.0)  # a write through the view ...
    assert x.inplace_version == v.inplace_version == before + 1
    ref = VIEWS[name](T(np.arange(24.0).reshape(2, 3, 4))).numpy() * 2
    np.testing.assert_array_equal(v.numpy(), ref)
    assert x.numpy().sum() > np.arange(24.0).sum()  # ... is seen by the base


def test_writes_through_a_view_reach_base_and_other_views():
    x = T(np.zeros((3, 4)))
    a = x[1]
    b = dt.reshape(x, [12])
    a.fill_(5.0)
    assert (x.numpy()[1] == 5).all()
    assert (b.numpy()[4:8] == 5).all()
    b[0] = 7.0
    assert x.numpy()[0, 0] == 7.0
    assert x.inplace_version == a.inplace_version == b.inplace_version == 2
    x.add_(1.0)
    assert a.numpy()[0] == 6.0 and b.numpy()[0] == 8.0
    assert a.inplace_version == 3


def test_normal_ops_do_not_share():
    x = T(np.ones((2, 3)))
    for y in (dt.add(x, 1.0), dt.scale(x, 1.0), dt.assign(x), x.clone(), dt.expand(x, [2, 2, 3]),
              dt.tile(x, [1, 1]), dt.concat([x], 0), dt.softmax(x), dt.cast(x, "float32")):
        assert y._value.holder is not x._value.holder
        assert not np.shares_memory(y._value.array, x._value.array)


def test_reshape_of_non_contiguous_copies():
    x = T(np.arange(6.0).reshape(2, 3))
    y = dt.reshape(dt.transpose(x, [1, 0]), [6])
    np.testing.assert_array_equal(y.numpy(), np.arange(6.0).reshape(2, 3).T.reshape(6))
    assert y._value.holder is not x._value.holder


def test_batch_norm_running_stats_are_its_outputs_updated_inplace():
    x = T(np.random.default_rng(0).standard_normal((4, 3)))
    rm, rv = T(np.zeros(3)), T(np.ones(3))
    attrs = {"training": True, "momentum": 0.9, "epsilon": 1e-5, "data_format": "NC"}
    out, mean_out, var_out, saved_mean, saved_rstd = apply(OPS["batch_norm"],
                                                           (x, rm, rv, None, None), attrs)
    assert mean_out is rm and var_out is rv  # mutated pairs: the outputs are the inputs
    assert rm.inplace_version == 1 and rv.inplace_version == 1
    assert mean_out.inplace_version == 1
    np.testing.assert_allclose(rm.numpy(), 0.1 * x.numpy().mean(0))
    assert not np.shares_memory(saved_mean._value.array, rm._value.array)
    infer = dict(attrs, training=False)
    _, m2, v2, sm2, _ = apply(OPS["batch_norm_infer"], (x, rm, rv, None, None), infer)
    assert shares(m2, rm) and shares(v2, rv)
    assert rm.inplace_version == 1  # inference writes nothing
    assert not np.shares_memory(sm2._value.array, rm._value.array)


# -- inplace -------------------------------------------------------------------------------

INPLACE = [
    ("add_", (2.0,), lambda a: a + 2),
    ("subtract_", (2.0,), lambda a: a - 2),
    ("multiply_", (3.0,), lambda a: a * 3),
    ("divide_", (4.0,), lambda a: a / 4),
    ("scale_", (2.0, 1.0), lambda a: a * 2 + 1),
    ("relu_", (), lambda a: np.maximum(a, 0)),
    ("exp_", (), np.exp),
    ("clip_", (-0.5, 0.5), lambda a: np.clip(a, -0.5, 0.5)),
    ("zero_", (), np.zeros_like),
    ("fill_", (3.0,), lambda a: np.full_like(a, 3.0)),
    ("copy_", (T([1.0, 2.0, 3.0]),), lambda a: np.broadcast_to([1.0, 2.0, 3.0], a.shape)),
]


@pytest.mark.parametrize("form", ["function", "method"])
@pytest.mark.parametrize("name,args,ref", INPLACE, ids=[i[0] for i in INPLACE])
def test_inplace_returns_self_and_bumps_version(name, args, ref, form):
    a = np.random.default_rng(1).standard_normal((2, 3))
    x = T(a)
    view = x[0]
    v0 = x.inplace_version
    y = getattr(dt, name)(x, *args) if form == "function" else getattr(x, name)(*args)
    assert y is x
    assert x.inplace_version == v0 + 1 == view.inplace_version
    np.testing.assert_allclose(x.numpy(), ref(a), rtol=1e-12)
    np.testing.assert_allclose(view.numpy(), ref(a)[0], rtol=1e-12)


def test_setitem_is_inplace():
    x = T(np.zeros((2, 3)))
    buf = x._value.array
    x[0, 1:] = 4.0
    assert x._value.array is buf and x.inplace_version == 1
    y = dt.setitem(x, (1,), T([1.0, 2.0, 3.0]))
    assert y is x and x.inplace_version == 2
    np.testing.assert_array_equal(x.numpy(), [[0, 4, 4], [1, 2, 3]])
    ident = id(x)
    x += 1.0
    assert id(x) == ident and x.inplace_version == 3


def test_seed_example_backward_through_inplace():
    a = T([1.5], stop_gradient=False)
    x = a.scale(2.0)
    y = x.scale_(2.0)
    assert y is x
    y.backward()
    np.testing.assert_allclose(a.grad.numpy(), [4.0])
    b = T([[1.0, 2.0], [3.0, 4.0]], stop_gradient=False)
    z = dt.scale(b, 2.0)
    dt.scale_(z, 2.0)
    dt.add_(z, 1.0)
    dt.sum(z).backward()
    np.testing.assert_allclose(b.grad.numpy(), np.full((2, 2), 4.0))


def test_seed_002_example_as_written():
    """The guide's example: a [3, 4] tensor, ``y.backward()`` on the non-scalar result (the
    implicit gradient is ones of y's shape, as in Paddle)."""
    a = dt.randn([3, 4])
    a.stop_gradient = False
    x = a.scale(2.0)
    y = x.scale_(2.0)
    assert y is x
    np.testing.assert_allclose(x.numpy(), 4 * a.numpy())
    y.backward()
    np.testing.assert_array_equal(a.grad.numpy(), np.full((3, 4), 4.0, dtype=np.float32))


def test_autograd_backward_several_roots():
    a = T([[1.0, 2.0], [3.0, -1.0]], stop_gradient=False)
    b = T([0.5, 2.0], stop_gradient=False)
    u = a * a          # non-scalar, seeded with ones
    v = a * b          # non-scalar, seeded with g
    g = np.array([[1.0, -2.0], [0.5, 3.0]])
    dt.autograd.backward([u, v], [None, T(g)])
    an, bn = a.numpy(), b.numpy()
    np.testing.assert_allclose(a.grad.numpy(), 2 * an + g * bn)
    np.testing.assert_allclose(b.grad.numpy(), (g * an).sum(0))
    c = T([1.0, 2.0, 3.0], stop_gradient=False)
    dt.autograd.backward(c * 3.0)  # one tensor, no grad_tensors
    np.testing.assert_allclose(c.grad.numpy(), [3.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="2 tensors but 1 grad_tensors"):
        dt.autograd.backward([c * 1.0, c * 2.0], [None])


def test_inplace_chain_gradients():
    a = T([0.5, -1.0, 2.0], stop_gradient=False)
    w = T([1.0, 2.0, 3.0])  # constant: multiply_'s backward needs only w, not the old h
    h = dt.multiply(a, 1.0)
    h.divide_(T([0.5, 0.5, 0.5]))  # divide_ by a constant needs only the divisor
    h.multiply_(w)
    h.exp_()  # exp_ saves its output: a later inplace write on h would make backward raise
    dt.sum(h).backward()
    an, wn = a.numpy(), w.numpy()
    np.testing.assert_allclose(a.grad.numpy(), 2 * wn * np.exp(2 * an * wn))


def test_inplace_product_and_quotient_with_an_operand_needing_grad():
    """dw of h.multiply_(w) and h.divide_(w) reads h before the write: a copy is saved (as
    PyTorch's mul_ and div_ do), so both gradients are right."""
    a = T([0.5, -1.0, 2.0], stop_gradient=False)
    w = T([1.5, 2.0, -3.0], stop_gradient=False)
    g = np.array([1.0, -2.0, 0.5])
    h = dt.multiply(a, 1.0)
    h.multiply_(w)
    h.divide_(w * w)  # h = a / w
    dt.sum(h * T(g)).backward()
    an, wn = a.numpy(), w.numpy()
    np.testing.assert_allclose(h.numpy(), an / wn)
    np.testing.assert_allclose(a.grad.numpy(), g / wn)
    np.testing.assert_allclose(w.grad.numpy(), -g * an / wn ** 2)


def test_a_saved_tensor_overwritten_later_still_raises():
    a = T([0.5, -1.0, 2.0], stop_gradient=False)
    h = dt.multiply(a, 1.0)
    y = h * a  # saves h
    h.multiply_(T([2.0, 2.0, 2.0]))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        dt.sum(y).backward()


def test_leaf_inplace_error():
    a = T([1.0, 2.0], stop_gradient=False)
    a.name = "my_leaf"
    for fn in (lambda: a.scale_(2.0), lambda: dt.add_(a, 1.0), lambda: a.zero_(),
               lambda: a.__setitem__(0, 3.0), lambda: a.relu_()):
        with pytest.raises(ValueError) as info:
            fn()
        assert str(info.value).startswith(
            "Leaf Var (my_leaf) that doesn't stop gradient can't use inplace strategy.")
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    assert a.inplace_version == 0
    with dt.no_grad():  # allowed without grad recording (optimizer updates)
        a.scale_(2.0)
    np.testing.assert_array_equal(a.numpy(), [2.0, 4.0])
    b = T([1.0])
    assert b.scale_(3.0) is b  # stop_gradient leaves are fine


def test_batch_norm_leaf_running_stats_error():
    rm = T(np.zeros(2), stop_gradient=False)
    rm.name = "rm"
    x = T(np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"Leaf Var \(rm\) that doesn't stop gradient"):
        dt.batch_norm(x, rm, T(np.ones(2)), training=True)
    assert rm.inplace_version == 0


def test_saved_tensor_modified_error():
    a = T([1.0, 2.0], stop_gradient=False)
    x = dt.scale(a, 1.0)
    x.name = "xsaved"
    y = dt.exp(x)  # exp saves its output
    z = dt.multiply(x, x)  # multiply saves x (version 0)
    x.add_(1.0)  # bumps x to version 1
    with pytest.raises(RuntimeError) as info:
        dt.sum(z).backward()
    msg = str(info.value)
    assert "xsaved" in msg and "version is 1" in msg and "expected version 0" in msg
    assert "multiply" in msg
    y.exp_()  # y's saved output is modified in place as well
    with pytest.raises(RuntimeError, match="expected version"):
        dt.sum(y).backward()


def test_backward_twice():
    a = T([1.0, 2.0], stop_gradient=False)
    loss = dt.sum(dt.multiply(a, a))
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    b = T([1.0, 2.0], stop_gradient=False)
    loss = dt.sum(dt.multiply(b, b))
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(b.grad.numpy(), 2 * 2 * b.numpy())


def test_gradient_accumulation_and_clear():
    a = T([1.0, -2.0], stop_gradient=False)
    dt.sum(dt.scale(a, 3.0)).backward()
    dt.sum(dt.multiply(a, a)).backward()
    np.testing.assert_allclose(a.grad.numpy(), 3.0 + 2 * a.numpy())
    # a tensor used twice in one graph accumulates too
    b = T([2.0], stop_gradient=False)
    dt.add(dt.multiply(b, b), b).backward()
    np.testing.assert_allclose(b.grad.numpy(), [5.0])
    a.clear_grad()
    assert a.grad is None


def test_dt_grad():
    a = T([1.0, 2.0], stop_gradient=False)
    b = T([3.0, 4.0], stop_gradient=False)
    h = dt.multiply(a, b)
    out = dt.sum(dt.exp(h))
    ga, gh = dt.grad(out, [a, h], retain_graph=True)
    np.testing.assert_allclose(ga.numpy(), b.numpy() * np.exp(a.numpy() * b.numpy()))
    np.testing.assert_allclose(gh.numpy(), np.exp(a.numpy() * b.numpy()))
    assert a.grad is None and b.grad is None
    (gb,) = dt.grad([out], [b])
    np.testing.assert_allclose(gb.numpy(), a.numpy() * np.exp(a.numpy() * b.numpy()))
    c = T([1.0], stop_gradient=False)
    with pytest.raises(ValueError, match="not reachable"):
        dt.grad(dt.sum(dt.scale(a, 2.0)), [c])
    assert dt.grad(dt.sum(dt.scale(a, 2.0)), [c], allow_unused=True) == [None]


def test_no_grad():
    a = T([1.0], stop_gradient=False)
    with dt.no_grad():
        y = dt.scale(a, 2.0)
    assert y.stop_gradient and y.is_leaf

    @dt.no_grad()
    def f(t):
        return dt.exp(t)

    assert f(a).stop_gradient
    assert dt.is_grad_enabled()
    z = dt.scale(a, 2.0)
    assert not z.stop_gradient


def test_failing_inplace_leaves_target_unchanged():
    x = T(np.arange(6.0).reshape(2, 3))
    before = x.numpy()
    for fn in (lambda: x.add_(T(np.ones((4, 3)))),          # broadcast to a bigger shape
               lambda: x.multiply_(T(np.ones((2, 1, 3)))),
               lambda: x.clip_(1.0, 0.0),
               lambda: x.__setitem__(slice(0, 1), T(np.ones((2, 2)))),
               lambda: x.copy_(T(np.ones((3, 3)))),
               lambda: dt.scale_(x, "2")):
        with pytest.raises((ValueError, TypeError)):
            fn()
        np.testing.assert_array_equal(x.numpy(), before)
        assert x.inplace_version == 0


def test_inplace_on_view_needing_grad_raises_before_writing():
    a = T(np.ones((2, 2)), stop_gradient=False)
    h = dt.scale(a, 1.0)
    v = h[0]
    with pytest.raises(ValueError, match="view"):
        v.scale_(2.0)
    np.testing.assert_array_equal(h.numpy(), np.ones((2, 2)))


def test_set_value_loads_a_parameter_outside_autograd():
    """Paddle's ``Tensor.set_value``: same tensor, same buffer, new data cast to its dtype,
    no grad recorded; a wrong shape raises and leaves the tensor unchanged."""
    lin = dt.nn.Linear(3, 2)
    p = lin.weight
    buf, ident = p._value.array, id(p)
    w = np.arange(6.0).reshape(3, 2)
    assert p.set_value(w) is p
    assert id(p) == ident and p._value.array is buf and p.dtype == dt.float32
    np.testing.assert_array_equal(p.numpy(), w.astype(np.float32))
    assert not p.stop_gradient and p.is_leaf and p.grad is None
    p.set_value(dt.to_tensor(w * 2))  # a float64 Tensor: cast
    np.testing.assert_array_equal(p.numpy(), (w * 2).astype(np.float32))
    with pytest.raises(ValueError, match=r"set_value: value of shape \[2, 3\] does not match"):
        p.set_value(np.ones((2, 3)))
    np.testing.assert_array_equal(p.numpy(), (w * 2).astype(np.float32))
    x = dt.to_tensor(np.ones((4, 3), dtype=np.float32), stop_gradient=False)
    lin(x).sum().backward()  # the loaded weight is used by the next forward and backward
    np.testing.assert_allclose(p.grad.numpy(), np.ones((3, 2)) * 4)


def test_numpy_of_a_replicated_distributed_tensor_is_a_fresh_copy():
    """A replicated piece is the global value: numpy() copies it, with no reshard (which
    would record an op); Partial and sharded tensors still go through reshard."""
    mesh = dt.ProcessMesh([0], dim_names=["x"])
    a = np.arange(6.0).reshape(2, 3)
    x = dt.shard_tensor(a, mesh, [dt.Replicate()])
    p = dt.dtensor_from_local(a, mesh, [dt.Partial()])
    with dt.jit.record() as calls:
        out = x.numpy()
        assert calls == []
        np.testing.assert_array_equal(p.numpy(), a)
        assert [c.op for c in calls] == ["reshard"]
    np.testing.assert_array_equal(out, a)
    out[...] = -1
    np.testing.assert_array_equal(x.numpy(), a)   # the copy, not the tensor's buffer
