"""The tensor ops through their public functions and Tensor methods (Paddle signatures), on one
process: values and gradients against numpy written out by hand, list/tensor indexing, the
bad-input errors (named op, argument and shapes; nothing modified), and the containers."""
from __future__ import annotations

import math

import numpy as np
import pytest

import disttensor as dt

RNG = np.random.default_rng(26)


def t(a, grad=False):
    return dt.to_tensor(np.array(a), stop_gradient=not grad)


def grad_of(fn, *arrays):
    """Values of ``fn(*tensors)`` and the gradients of ``sum(out * W)`` (W fixed random)."""
    ts = [t(a, grad=np.asarray(a).dtype.kind == "f") for a in arrays]
    out = fn(*ts)
    w = RNG.standard_normal(out.shape)
    (out * dt.to_tensor(w)).sum().backward()
    return out.numpy(), w, [None if x.grad is None else x.grad.numpy() for x in ts]


X = RNG.standard_normal((5, 7))


@pytest.mark.parametrize("name,ref,dref", [
    ("sin", np.sin, np.cos), ("cos", np.cos, lambda x: -np.sin(x)),
    ("erf", np.vectorize(math.erf), lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x)),
    ("square", np.square, lambda x: 2 * x), ("reciprocal", lambda x: 1 / x, lambda x: -1 / x ** 2),
    ("log1p", np.log1p, lambda x: 1 / (1 + x))])
def test_unary_math_values_and_grads(name, ref, dref):
    x = np.abs(X) + 0.5
    out, w, (g,) = grad_of(getattr(dt, name), x)
    np.testing.assert_allclose(out, ref(x), rtol=1e-12)
    np.testing.assert_allclose(g, w * dref(x), rtol=1e-10)
    np.testing.assert_allclose(getattr(t(x), name)().numpy(), ref(x), rtol=1e-12)  # method


def test_floor_and_sign_have_no_gradient_path():
    x = t(X, grad=True)
    y = dt.floor(x) * x + dt.sign(x)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.floor(X))
    assert dt.sign(t(np.array([-2, 0, 3]))).numpy().tolist() == [-1, 0, 1]


def test_masked_fill_scalar_and_tensor_value():
    mask = X > 0.2
    out, w, (gx, _, gv) = grad_of(lambda x, m, v: dt.masked_fill(x, m, v), X, mask, np.array(1.5))
    np.testing.assert_array_equal(out, np.where(mask, 1.5, X))
    np.testing.assert_allclose(gx, np.where(mask, 0, w))
    np.testing.assert_allclose(gv, (w * mask).sum())
    causal = dt.tril(dt.ones([4, 4])) == 0
    scores = dt.masked_fill(dt.zeros([4, 4]), causal, float("-inf"))
    assert np.isinf(scores.numpy()[0, 1]) and scores.numpy()[1, 0] == 0
    y = t(X.copy())
    assert y.masked_fill_(t(mask), -1.0) is y
    np.testing.assert_array_equal(y.numpy(), np.where(mask, -1.0, X))
    with pytest.raises(TypeError, match="masked_fill: mask must be bool"):
        dt.masked_fill(t(X), t(np.ones((5, 7))), 0.0)


@pytest.mark.parametrize("diagonal", [-2, 0, 3])
def test_tril_triu(diagonal):
    x = RNG.standard_normal((2, 5, 7))
    for name, ref in (("tril", np.tril), ("triu", np.triu)):
        out, w, (g,) = grad_of(lambda a: getattr(dt, name)(a, diagonal), x)
        np.testing.assert_array_equal(out, ref(x, diagonal))
        np.testing.assert_array_equal(g, ref(w, diagonal))
    with pytest.raises(ValueError, match=r"tril: x must have at least 2 dims, got shape \[3\]"):
        dt.tril(t(np.ones(3)))


def test_einsum_and_outer():
    a, b, c = (RNG.standard_normal(s) for s in ((3, 4), (4, 5), (5, 2)))
    out, w, (ga, gb, gc) = grad_of(lambda x, y, z: dt.einsum("ij,jk,kl->il", x, y, z), a, b, c)
    np.testing.assert_allclose(out, a @ b @ c, rtol=1e-12)
    np.testing.assert_allclose(ga, w @ (b @ c).T, rtol=1e-10)
    np.testing.assert_allclose(gc, (a @ b).T @ w, rtol=1e-10)
    np.testing.assert_allclose(gb, a.T @ w @ c.T, rtol=1e-10)
    out, w, (ga,) = grad_of(lambda x: dt.einsum("ij->j", x), a)  # one operand, implicit summing
    np.testing.assert_allclose(out, a.sum(0))
    np.testing.assert_allclose(ga, np.broadcast_to(w, a.shape))
    np.testing.assert_allclose(dt.einsum("ij,jk", t(a), t(b)).numpy(), a @ b)  # implicit output
    out, w, (gx, gy) = grad_of(dt.outer, a, np.arange(3.0))
    np.testing.assert_allclose(out, np.outer(a, np.arange(3.0)))
    np.testing.assert_allclose(gx, (w @ np.arange(3.0)).reshape(a.shape))
    with pytest.raises(ValueError, match="einsum: label 'j' has size 4 and 3"):
        dt.einsum("ij,jk->ik", t(a), t(a))
    with pytest.raises(ValueError, match=r"einsum: equation 'i...,j->ij'"):
        dt.einsum("i...,j->ij", t(a), t(b))


def test_statistics():
    for axis, keep in ((None, False), (1, True), ([0, 1], False)):
        ax = None if axis is None else tuple(np.atleast_1d(axis))
        m = X.max(axis=ax, keepdims=True)
        lse = np.log(np.exp(X - m).sum(axis=ax, keepdims=True)) + m
        np.testing.assert_allclose(dt.logsumexp(t(X), axis, keep).numpy(),
                                   lse if keep else np.squeeze(lse, ax), rtol=1e-12)
        np.testing.assert_allclose(t(X).var(axis, keepdim=keep).numpy(),
                                   np.var(X, axis=ax, ddof=1, keepdims=keep), rtol=1e-12)
        np.testing.assert_allclose(dt.std(t(X), axis, False, keep).numpy(),
                                   np.std(X, axis=ax, keepdims=keep), rtol=1e-12)
        np.testing.assert_allclose(dt.norm(t(X), "fro", axis, keep).numpy(),
                                   np.sqrt((X * X).sum(axis=ax, keepdims=keep)), rtol=1e-12)
    big = np.array([1000.0, 1000.0])
    assert np.isclose(dt.logsumexp(t(big)).numpy(), 1000 + math.log(2))
    _, w, (g,) = grad_of(lambda x: dt.var(x, 1), X)
    np.testing.assert_allclose(g, 2 * (X - X.mean(1, keepdims=True)) / 6 * w[:, None])
    _, _, (g,) = grad_of(lambda x: dt.norm(x, 2, 0), np.zeros((3, 2)))
    np.testing.assert_array_equal(g, 0)
    with pytest.raises(ValueError, match="norm: p=1 is not supported"):
        dt.norm(t(X), p=1)
    with pytest.raises(ValueError, match="spectral"):
        dt.norm(t(X), p=2, axis=[0, 1])
    with pytest.raises(TypeError, match="var: x must be floating"):
        dt.var(t(np.arange(3)))


def test_sort_argsort_topk():
    x = np.array([[3.0, 1.0, 3.0, 2.0], [0.0, 5.0, 5.0, -1.0]])
    np.testing.assert_array_equal(dt.argsort(t(x), descending=True).numpy(),
                                  [[0, 2, 3, 1], [1, 2, 0, 3]])  # stable: ties keep order
    np.testing.assert_array_equal(t(x).sort(axis=0).numpy(), np.sort(x, axis=0))
    v, i = dt.topk(t(x), 2)
    np.testing.assert_array_equal(v.numpy(), [[3, 3], [5, 5]])
    np.testing.assert_array_equal(i.numpy(), [[0, 2], [1, 2]])
    v, i = t(x).topk(1, axis=0, largest=False)
    np.testing.assert_array_equal(v.numpy(), [[0, 1, 3, -1]])
    d = RNG.permutation(20).reshape(4, 5) * 1.0
    out, w, (g,) = grad_of(lambda a: dt.topk(a, 3, axis=1)[0], d)
    want = np.zeros_like(d)
    idx = np.argsort(-d, axis=1)[:, :3]
    np.put_along_axis(want, idx, w, 1)
    np.testing.assert_array_equal(g, want)
    with pytest.raises(ValueError,
                       match=r"topk: k=5 must be an int in \[0, 4\] \(x shape \[2, 4\]"):
        dt.topk(t(x), 5)


def test_cumsum_flip_roll_repeat_unbind():
    x = RNG.standard_normal((3, 4))
    np.testing.assert_allclose(dt.cumsum(t(x)).numpy(), np.cumsum(x))
    assert dt.cumsum(t(np.array([True, True]))).numpy().dtype == np.int64
    out, w, (g,) = grad_of(lambda a: dt.cumsum(a, axis=1), x)
    np.testing.assert_allclose(g, np.flip(np.cumsum(np.flip(w, 1), 1), 1))
    np.testing.assert_array_equal(dt.flip(t(x), 0).numpy(), x[::-1])
    np.testing.assert_array_equal(dt.roll(t(x), 2).numpy(), np.roll(x, 2))
    np.testing.assert_array_equal(dt.roll(t(x), [1, -1], [0, 1]).numpy(),
                                  np.roll(x, [1, -1], [0, 1]))
    np.testing.assert_array_equal(dt.repeat_interleave(t(x), 2, 1).numpy(), np.repeat(x, 2, 1))
    np.testing.assert_array_equal(
        dt.repeat_interleave(t(x.ravel()[:3]), t(np.array([1, 0, 2]))).numpy(),
        np.repeat(x.ravel()[:3], [1, 0, 2]))
    out, w, (g,) = grad_of(lambda a: dt.repeat_interleave(a, [2, 0, 1], 0), x)
    np.testing.assert_allclose(g, np.stack([w[0] + w[1], 0 * w[0], w[2]]))
    parts = dt.unbind(t(x, grad=True), axis=1)
    assert len(parts) == 4 and parts[2].shape == [3] and dt.unbind(t(np.ones((0, 2)))) == []
    np.testing.assert_array_equal(parts[2].numpy(), x[:, 2])
    with pytest.raises(ValueError, match="repeat_interleave: repeats must be"):
        dt.repeat_interleave(t(x), [1, 2], axis=1)


def test_take_put_scatter():
    x = RNG.standard_normal((3, 4))
    idx = np.array([[0, 3], [1, 1], [2, 0]])
    np.testing.assert_array_equal(dt.take_along_axis(t(x), t(idx), 1).numpy(),
                                  np.take_along_axis(x, idx, 1))
    np.testing.assert_array_equal(dt.take_along_axis(t(x), t(np.array([[2]])), 1).numpy(),
                                  x[:, [2]])  # broadcast off the axis
    out = dt.put_along_axis(t(x), t(idx[:, :1]), 9.0, 1).numpy()
    want = x.copy()
    np.put_along_axis(want, idx[:, :1], 9.0, 1)
    np.testing.assert_array_equal(out, want)
    out = dt.put_along_axis(t(x), t(idx), t(np.ones((3, 2))), 1, reduce="add").numpy()
    want = x.copy()
    np.add.at(want, (np.arange(3)[:, None], idx), 1.0)
    np.testing.assert_array_equal(out, want)
    # Paddle's scatter example: overwrite, and accumulate into zeroed rows
    base = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    upd = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]])
    ids = np.array([2, 1, 0, 1])
    np.testing.assert_array_equal(dt.scatter(t(base), t(ids), t(upd)).numpy(),
                                  [[3, 3], [4, 4], [1, 1]])
    np.testing.assert_array_equal(dt.scatter(t(base), t(ids), t(upd), overwrite=False).numpy(),
                                  [[3, 3], [6, 6], [1, 1]])
    out, w, (gx, _, gu) = grad_of(lambda a, i, u: dt.scatter(a, i, u), base, np.array([2, 0]),
                                  upd[:2])
    np.testing.assert_array_equal(gx, w * np.array([[0], [1], [0]]))
    np.testing.assert_array_equal(gu, w[[2, 0]])


@pytest.mark.parametrize("index", [
    (slice(None), -1, slice(None)), (slice(None), [-1], slice(None)), ([1, 0, 1],),
    (0, slice(None), [1, 3]), (slice(None), np.array([[0, 1], [2, 2]])), (Ellipsis, [0, 3]),
    (np.array([True, False]),), (1, [2, 0]), ([0, 1], slice(1, 3)), (None, slice(None), [2]),
    (0, slice(1, 3), [1, 3]), (Ellipsis, np.arange(12).reshape(3, 4) % 5 == 1)])
def test_getitem_matches_numpy(index):
    a = RNG.standard_normal((2, 3, 4))
    out, w, (g,) = grad_of(lambda x: x[index], a)
    np.testing.assert_array_equal(out, a[index])
    want = np.zeros_like(a)
    np.add.at(want, index, w)
    np.testing.assert_allclose(g, want)


def test_getitem_tensor_and_mask_indices():
    a = RNG.standard_normal((2, 3, 4))
    x = t(a)
    np.testing.assert_array_equal(x[:, t(np.array([2, -3]))].numpy(), a[:, [2, -3]])
    np.testing.assert_array_equal(x[t(a > 0)].numpy(), a[a > 0])
    np.testing.assert_array_equal(x[t(np.int64(1))].numpy(), a[1])  # a 0-d tensor is an int
    with pytest.raises(IndexError, match=r"__getitem__: index 3 is out of range for axis 1 of "
                                         r"size 3 \(x shape \[2, 3, 4\]\)"):
        x[:, [3]]
    with pytest.raises(IndexError, match=r"__getitem__: gather: index value 5 is out of range"):
        x[:, :, t(np.array([0, 5]))]
    with pytest.raises(IndexError, match="only one list/array/tensor index"):
        x[[0], [1]]
    with pytest.raises(IndexError, match=r"bool mask of shape \[3\] does not match"):
        x[np.array([True, False, True])]


def test_setitem_lists_tensors_masks():
    a = RNG.standard_normal((2, 3, 4))
    for index, value in (((slice(None), [0, 2], 1), 5.0), (([1],), np.ones((1, 3, 4))),
                         ((1, np.array([[0], [2]])), np.arange(4.0))):
        x = t(a.copy())
        x[index] = value
        want = a.copy()
        want[index] = value
        np.testing.assert_array_equal(x.numpy(), want)
    x = t(a.copy())
    x[:, t(np.array([0, -1]))] = 0.0  # -1 counts from the end
    want = a.copy()
    want[:, [0, -1]] = 0.0
    np.testing.assert_array_equal(x.numpy(), want)
    x = t(a.copy())
    x[t(a > 0)] = 0.0
    np.testing.assert_array_equal(x.numpy(), np.where(a > 0, 0, a))
    x = t(a.copy())
    with pytest.raises(IndexError, match="out of range"):
        x[:, t(np.array([0, 3]))] = 1.0
    np.testing.assert_array_equal(x.numpy(), a)  # nothing modified
    with pytest.raises(ValueError, match=r"__setitem__: value of shape \[3\] cannot be broadcast"):
        x[:, [0, 1]] = t(np.ones(3))


def test_bad_indices_name_op_and_leave_input_alone():
    x = RNG.standard_normal((3, 4))
    with pytest.raises(ValueError, match=r"index_select: index value 4 is out of range \[0, 4\) "
                                         r"\(x of shape \[3, 4\], index of shape \[2\], "
                                         r"axis 1\)"):
        dt.index_select(t(x), t(np.array([0, 4])), axis=1)
    with pytest.raises(ValueError, match=r"take_along_axis: index value -1 is out of range "
                                         r"\[0, 4\) \(arr of shape \[3, 4\], indices of shape "
                                         r"\[3, 1\], axis 1\)"):
        dt.take_along_axis(t(x), t(np.array([[-1]])), 1)
    with pytest.raises(ValueError, match=r"take_along_axis: indices of shape \[2, 1\] cannot "
                                         r"be broadcast to \[3, 1\]"):
        dt.take_along_axis(t(x), t(np.zeros((2, 1), dtype=np.int64)), 1)
    with pytest.raises(ValueError, match=r"put_along_axis: index value 7 is out of range"):
        dt.put_along_axis(t(x), t(np.array([[7]])), 1.0, 1)
    y = t(x.copy())
    with pytest.raises(ValueError, match=r"scatter: index value 3 is out of range \[0, 3\) "
                                         r"\(x of shape \[3, 4\], index of shape \[2\]"):
        dt.scatter_(y, t(np.array([0, 3])), t(np.ones((2, 4))))
    np.testing.assert_array_equal(y.numpy(), x)
    with pytest.raises(ValueError, match=r"scatter: updates of shape \[2, 3\] must have shape "
                                         r"\[2, 4\]"):
        dt.scatter(t(x), t(np.array([0, 1])), t(np.ones((2, 3))))


def test_multinomial_seeded_and_checked():
    p = np.array([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]])
    dt.seed(5)
    a = dt.multinomial(t(p), 3).numpy()
    dt.seed(5)
    b = t(p).multinomial(3).numpy()
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 3) and 1 not in a[0] and all(len(set(r)) == 3 for r in a)
    draws = dt.multinomial(t(np.array([0.2, 0.0, 0.8])), 4000, replacement=True).numpy()
    counts = np.bincount(draws, minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.2, 0.0, 0.8], atol=0.03)
    for bad, why in ((np.array([[0.5, -0.1]]), "negative"), (np.array([[0.0, 0.0]]), "all-zero"),
                     (np.array([[0.0, 1.0, 0.0]]), "fewer non-zero")):
        with pytest.raises(ValueError, match=f"multinomial: x of shape .* {why}"):
            dt.multinomial(t(bad), 2)
    with pytest.raises(ValueError, match="num_samples=3 exceeds the 2 categories"):
        dt.multinomial(t(np.ones((1, 2))), 3)


def test_astype_and_containers():
    x = t(np.arange(3))
    y = x.astype("float32")
    assert np.dtype(y.dtype) == np.float32
    np.testing.assert_array_equal(y.numpy(), [0.0, 1.0, 2.0])
    z = t(X, grad=True)
    z.astype("float32").sum().backward()
    np.testing.assert_array_equal(z.grad.numpy(), np.ones_like(X))

    heads = dt.nn.LayerDict({"lm": dt.nn.Linear(4, 6), "cls": dt.nn.Linear(4, 2)})
    heads["extra"] = dt.nn.Linear(2, 2)
    assert list(heads.keys()) == ["lm", "cls", "extra"] and "cls" in heads and len(heads) == 3
    assert len(heads.parameters()) == 6
    assert sorted(heads.state_dict()) == sorted(f"{k}.{p}" for k in heads for p in ("weight",
                                                                                       "bias"))
    assert isinstance(heads.pop("extra"), dt.nn.Linear) and len(heads) == 2
    with pytest.raises(KeyError, match=r"LayerDict: no sublayer 'nope'; keys: \['lm', 'cls'\]"):
        heads["nope"]

    layer = dt.nn.Layer()
    params = dt.nn.ParameterList([layer.create_parameter([2, 2]) for _ in range(2)])
    params.append(layer.create_parameter([3]))
    assert len(params) == 3 and params[-1].shape == [3]
    first = params[0]
    params[1] = layer.create_parameter([5])
    assert [p.shape for p in params] == [[2, 2], [5], [3]] and params[0] is first

    class Scales(dt.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = dt.nn.ParameterList([self.create_parameter([4]) for _ in range(3)])

        def forward(self, x):
            for p in self.w:
                x = x * p
            return x

    m = Scales()
    assert [n for n, _ in m.named_parameters()] == ["w.0", "w.1", "w.2"]
    m(dt.ones([4])).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    with pytest.raises(IndexError, match="ParameterList: index 3 is out of range for 3"):
        m.w[3]


TENSOR_OPS = ["sin", "cos", "erf", "square", "reciprocal", "log1p", "floor", "sign",
              "masked_fill", "tril", "triu", "einsum", "outer", "logsumexp", "var", "std", "norm",
              "sort", "argsort", "topk", "cumsum", "flip", "roll", "unbind", "repeat_interleave",
              "take_along_axis", "put_along_axis", "scatter", "multinomial", "gather"]


def test_every_tensor_op_has_a_rule_and_public_names():
    report = dt.coverage_report()
    grads = [n for n in dt.ops.OPS if n.endswith("_grad") and n[:-5] in TENSOR_OPS]
    assert set(TENSOR_OPS + grads) <= set(report["rule"]), set(TENSOR_OPS + grads) - set(
        report["rule"])
    assert not report["fallback"] and not report["unknown"]
    for name in TENSOR_OPS + ["index_select", "masked_fill_", "scatter_"]:
        if name != "gather":
            assert callable(getattr(dt, name)), name
    x = t(np.ones((2, 3)))
    for method in ("sin", "masked_fill", "tril", "logsumexp", "norm", "topk", "sort", "cumsum",
                   "flip", "roll", "unbind", "repeat_interleave", "take_along_axis", "scatter",
                   "multinomial", "astype", "outer", "index_select", "put_along_axis", "var"):
        assert callable(getattr(x, method)), method

