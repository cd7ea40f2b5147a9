"""A forward reference for every registered op, written with numpy (and ``math.erf``) alone:
``REFERENCES[name](arrays, attrs, outs) -> tuple of arrays`` — the op's outputs for the global
input ``arrays`` (copies: mutated inputs are never touched) and ``attrs``. ``outs`` are the op's
own outputs, read only by dropout, whose mask is random (its reference checks the output
against the mask it drew). The op-by-placement oracle compares every dense run with these, and
a test fails when an op is registered without one."""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _one(fn):
    """A single-output reference of the arrays alone."""
    return lambda a, k, o: (fn(*a),)


def _grad(fn):
    """The gradient of a unary op: ``fn(saved, g)``."""
    return lambda a, k, o: (fn(*a),)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _gelu(x, approximate):
    if approximate:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_grad(x, g, approximate):
    if approximate:  # derivative of the tanh form
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x ** 3))
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2))
    return g * (0.5 * (1 + _erf(x / math.sqrt(2.0)))
                + x * np.exp(-x * x / 2) / math.sqrt(2 * np.pi))


def _reduce(fn):
    def ref(a, k, o):
        axis = tuple(k["axis"]) if k.get("axis") else None
        return (fn(a[0], axis=axis, keepdims=k["keepdim"]),)
    return ref


def _arg(fn):
    def ref(a, k, o):
        x, axes = a[0], tuple(k["axis"]) if k.get("axis") else tuple(range(a[0].ndim))
        rest = [d for d in range(x.ndim) if d not in axes]
        moved = np.transpose(x, rest + list(axes)).reshape([x.shape[d] for d in rest] + [-1])
        out = fn(moved, axis=-1)
        if k["keepdim"]:
            out = out.reshape([1 if d in axes else x.shape[d] for d in range(x.ndim)])
        return (out.astype(np.int64),)
    return ref


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(a, k, o):
    x, w, b = a
    axes = tuple(range(k["begin_norm_axis"], x.ndim))
    tail = x.shape[k["begin_norm_axis"]:]
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    out = (x - mean) / np.sqrt(var + k["epsilon"])
    out = out * (1 if w is None else w.reshape(tail)) + (0 if b is None else b.reshape(tail))
    lead = x.shape[:k["begin_norm_axis"]]
    return out, mean.reshape(lead), (1 / np.sqrt(var + k["epsilon"])).reshape(lead)


def _layer_norm_grad(a, k, o):
    """The vector-Jacobian product of the normalization, written out per row (d xhat / d x)."""
    x, w, mean, rstd, dout = a
    b = k["begin_norm_axis"]
    tail = x.shape[b:]
    rows, n = int(np.prod(x.shape[:b], dtype=np.int64)), int(np.prod(tail, dtype=np.int64))
    xr, gr = x.reshape(rows, n), dout.reshape(rows, n)
    wr = np.ones(n) if w is None else w.reshape(n)
    dx = np.empty_like(xr)
    for i in range(rows):
        mu, s = mean.reshape(-1)[i], rstd.reshape(-1)[i]
        jac = s * (np.eye(n) - 1.0 / n) - s ** 3 / n * np.outer(xr[i] - mu, xr[i] - mu)
        dx[i] = jac.T @ (gr[i] * wr)  # jac[j, l] = d xhat_j / d x_l
    xhat = (xr - mean.reshape(rows, 1)) * rstd.reshape(rows, 1)
    dw, db = (gr * xhat).sum(0), gr.sum(0)
    shape = tail if w is None else w.shape
    return dx.reshape(x.shape), dw.reshape(shape), db.reshape(shape)


def _bn_axes(x, fmt):
    c = 1 if fmt in ("NC", "NCL", "NCHW", "NCDHW") else x.ndim - 1
    shape = [1] * x.ndim
    shape[c] = x.shape[c]
    return tuple(d for d in range(x.ndim) if d != c), tuple(shape)


def _batch_norm(a, k, o):
    x, rm, rv, w, b = a
    red, bshape = _bn_axes(x, k["data_format"])
    if k["training"]:
        mean, var = x.mean(axis=red), x.var(axis=red)
        rm = k["momentum"] * rm + (1 - k["momentum"]) * mean
        rv = k["momentum"] * rv + (1 - k["momentum"]) * var
    else:
        mean, var = rm, rv
    rstd = 1 / np.sqrt(var + k["epsilon"])
    out = (x - mean.reshape(bshape)) * rstd.reshape(bshape)
    out = out * (1 if w is None else w.reshape(bshape)) + (0 if b is None else b.reshape(bshape))
    return out, rm, rv, mean, rstd


def _batch_norm_grad(a, k, o):
    """Per channel, the VJP of ``w * (x - mean(x)) / sqrt(var(x) + eps)`` by its Jacobian (the
    statistics are constants with ``use_global_stats``)."""
    x, w, mean, rstd, dout = a
    red, bshape = _bn_axes(x, k["data_format"])
    c_ax = [d for d in range(x.ndim) if d not in red][0]
    xm, gm = np.moveaxis(x, c_ax, 0), np.moveaxis(dout, c_ax, 0)
    dx = np.empty_like(xm)
    for c in range(xm.shape[0]):
        v, g = xm[c].reshape(-1), gm[c].reshape(-1)
        n, s, mu = v.size, rstd[c], mean[c]
        if k["use_global_stats"]:
            jac = s * np.eye(n)
        else:
            jac = s * (np.eye(n) - 1.0 / n) - s ** 3 / n * np.outer(v - mu, v - mu)
        dx[c] = (jac.T @ (g * (1 if w is None else w[c]))).reshape(xm[c].shape)
    xhat = (x - mean.reshape(bshape)) * rstd.reshape(bshape)
    return np.moveaxis(dx, 0, c_ax), (dout * xhat).sum(axis=red), dout.sum(axis=red)


def _cross_entropy(a, k, o):
    logits, label = a
    axis, ign = k["axis"], k["ignore_index"]
    sm = _softmax(logits, axis)
    lab = np.expand_dims(label.reshape(np.delete(logits.shape, axis)), axis)
    valid = lab != ign
    picked = np.take_along_axis(np.log(sm), np.where(valid, lab, 0), axis=axis)
    return sm, np.where(valid, -picked, 0.0)


def _cross_entropy_grad(a, k, o):
    sm, label, dloss = a
    axis = k["axis"]
    lab = np.expand_dims(label.reshape(np.delete(sm.shape, axis)), axis)
    onehot = np.arange(sm.shape[axis]).reshape(
        [-1 if d == axis else 1 for d in range(sm.ndim)]) == lab
    return ((sm - onehot) * np.where(lab != k["ignore_index"], dloss, 0.0),)


def _cross_entropy_mean(a, k, o):
    """(softmax, the mean of the non-ignored rows' losses (0 with none), their count)."""
    sm, loss = _cross_entropy(a, k, o)
    lab = a[1]
    count = float(np.count_nonzero(lab != k["ignore_index"]))
    return sm, np.asarray(loss.sum() / max(count, 1.0)), np.asarray(count)


def _cross_entropy_mean_grad(a, k, o):
    sm, label, count, dloss = a
    rows = np.broadcast_to(dloss / max(float(count), 1.0),
                           np.delete(sm.shape, k["axis"]).tolist() + [1])
    return _cross_entropy_grad((sm, label, np.moveaxis(rows, -1, k["axis"])), k, o)


def _embedding(a, k, o):
    ids, w = a
    out = w[ids].copy()
    if k["padding_idx"] is not None:
        out[ids == k["padding_idx"]] = 0
    return (out,)


def _embedding_grad(a, k, o):
    ids, dout = a
    dw = np.zeros((k["num_embeddings"], dout.shape[-1]))
    for i, row in zip(ids.reshape(-1), dout.reshape(-1, dout.shape[-1])):
        if i != k["padding_idx"]:
            dw[i] += row
    return (dw,)


def _gather_grad(a, k, o):
    index, dout = a
    axis = k["axis"]
    shape = list(dout.shape)
    shape[axis] = k["input_shape"][axis]
    dx = np.zeros(shape)
    for j, i in enumerate(index):
        dx[(slice(None),) * axis + (i,)] += dout[(slice(None),) * axis + (j,)]
    return (dx,)


def _slice_grad(a, k, o):
    dx = np.zeros(k["input_shape"])
    dx[k["index"]] = a[0]
    return (dx,)


def _set_value(a, k, o):
    x = a[0].copy()
    x[k["index"]] = a[1]
    return (x,)


def _split(a, k, o):
    bounds = np.cumsum(k["sections"])[:-1]
    return tuple(np.split(a[0], bounds, axis=k["axis"]))


def _dropout(a, k, o):
    """The mask is random: it must be 0/1 (all ones for p = 0) and the output the input there,
    scaled by 1/(1-p) in upscale_in_train mode."""
    x, mask, p = a[0], np.asarray(o[1]), k["p"]
    assert set(np.unique(mask)) <= {0.0, 1.0}, "dropout mask is not 0/1"
    if p == 0.0:
        assert mask.all()
    up = 1.0 / (1.0 - p) if k["mode"] == "upscale_in_train" and p < 1.0 else 1.0
    return x * mask * up, mask


def _adam(a, k, o):
    param, grad, m1, m2, b1p, b2p, lr = (np.array(v, dtype=np.float64) for v in a)
    b1, b2, eps = k["beta1"], k["beta2"], k["epsilon"]
    b1p, b2p = b1p * b1, b2p * b2
    lr_v = float(lr) * k["lr_scale"]
    g = grad + k["l2"] * param
    param = param * (1 - lr_v * k["weight_decay"])
    m1 = b1 * m1 + (1 - b1) * g
    m2 = b2 * m2 + (1 - b2) * g * g
    mhat, vhat = m1 / (1 - b1p), m2 / (1 - b2p)
    return param - lr_v * mhat / (np.sqrt(vhat) + eps), m1, m2, b1p, b2p


def _momentum(a, k, o):
    param, grad, vel, lr = a
    g = grad + k["l2"] * param
    vel = k["mu"] * vel + g
    step = g + k["mu"] * vel if k["use_nesterov"] else vel
    return param - float(lr) * k["lr_scale"] * step, vel


def _sgd(a, k, o):
    param, grad, lr = a
    return (param - float(lr) * k["lr_scale"] * (grad + k["l2"] * param),)


def _tile(a, k, o):
    return (np.tile(a[0], k["repeat_times"]),)


def _scale(a, k, o):
    x, s, b = a[0], k["scale"], k["bias"]
    return ((x * s + b) if k["bias_after_scale"] else (x + b) * s,)


def _matmul(a, k, o):
    x, y = a
    if k["transpose_x"] and x.ndim > 1:
        x = np.swapaxes(x, -1, -2)
    if k["transpose_y"] and y.ndim > 1:
        y = np.swapaxes(y, -1, -2)
    return (np.matmul(x, y),)


def _minmax_mask(a, k, o):
    x, y = a
    pick = np.greater_equal(x, y) if k["pick"] == "maximum" else np.less_equal(x, y)
    return (np.broadcast_to(pick, np.broadcast_shapes(x.shape, y.shape)).astype(x.dtype),)


def _clip(x, lo, hi):
    return np.minimum(np.maximum(x, -np.inf if lo is None else lo), np.inf if hi is None else hi)


def _clip_grad(a, k, o):
    out, g = a
    inside = (out > (-np.inf if k["min"] is None else k["min"])) & \
        (out < (np.inf if k["max"] is None else k["max"]))
    return (g * inside,)


REFERENCES = {
    # elementwise, binary
    "add": _one(np.add), "subtract": _one(np.subtract), "multiply": _one(np.multiply),
    "divide": _one(np.true_divide), "pow": _one(np.power), "maximum": _one(np.maximum),
    "minimum": _one(np.minimum), "equal": _one(np.equal), "not_equal": _one(np.not_equal),
    "less_than": _one(np.less), "less_equal": _one(np.less_equal),
    "greater_than": _one(np.greater), "greater_equal": _one(np.greater_equal),
    "logical_and": _one(np.logical_and), "logical_or": _one(np.logical_or),
    "logical_not": _one(np.logical_not), "minmax_mask": _minmax_mask,
    "where": _one(np.where),
    # elementwise, unary and their gradients (saved value, dout)
    "neg": _one(np.negative), "abs": _one(np.abs), "abs_grad": _grad(lambda x, g: g * np.sign(x)),
    "exp": _one(np.exp), "exp_grad": _grad(lambda out, g: g * out),
    "log": _one(np.log), "log_grad": _grad(lambda x, g: g / x),
    "sqrt": _one(np.sqrt), "sqrt_grad": _grad(lambda out, g: g / (2 * out)),
    "rsqrt": _one(lambda x: x ** -0.5), "rsqrt_grad": _grad(lambda out, g: -0.5 * g * out ** 3),
    "tanh": _one(np.tanh), "tanh_grad": _grad(lambda out, g: g * (1 - out ** 2)),
    "sigmoid": _one(_sig), "sigmoid_grad": _grad(lambda out, g: g * out * (1 - out)),
    "relu": _one(lambda x: np.where(x > 0, x, 0).astype(x.dtype)),
    "relu_grad": _grad(lambda out, g: np.where(out > 0, g, 0)),
    "silu": _one(lambda x: x * _sig(x)),
    "silu_grad": _grad(lambda x, g: g * (_sig(x) + x * _sig(x) * (1 - _sig(x)))),
    "gelu": lambda a, k, o: (_gelu(a[0], k["approximate"]),),
    "gelu_grad": lambda a, k, o: (_gelu_grad(a[0], a[1], k["approximate"]),),
    "scale": _scale, "cast": lambda a, k, o: (a[0].astype(k["dtype"]),),
    "clip": lambda a, k, o: (_clip(a[0], k["min"], k["max"]),), "clip_grad": _clip_grad,
    "full_like": lambda a, k, o: (np.full(np.shape(a[0]), k["fill_value"], k["dtype"]),),
    "detach": lambda a, k, o: (a[0],),
    # reductions
    "sum": _reduce(np.sum), "max": _reduce(np.max), "min": _reduce(np.min),
    "argmax": _arg(np.argmax), "argmin": _arg(np.argmin),
    # matmul, activations, normalization, losses
    "matmul": _matmul,
    "softmax": lambda a, k, o: (_softmax(a[0], k["axis"]),),
    "log_softmax": lambda a, k, o: (np.log(_softmax(a[0], k["axis"])),),
    "softmax_grad": lambda a, k, o: (
        a[0] * (a[1] - (a[1] * a[0]).sum(axis=k["axis"], keepdims=True)),),
    "log_softmax_grad": lambda a, k, o: (
        a[1] - np.exp(a[0]) * a[1].sum(axis=k["axis"], keepdims=True),),
    "layer_norm": _layer_norm, "layer_norm_grad": _layer_norm_grad,
    "batch_norm": _batch_norm, "batch_norm_infer": _batch_norm,
    "batch_norm_grad": _batch_norm_grad,
    "cross_entropy": _cross_entropy, "cross_entropy_grad": _cross_entropy_grad,
    "cross_entropy_mean": _cross_entropy_mean, "cross_entropy_mean_grad": _cross_entropy_mean_grad,
    "embedding": _embedding, "embedding_grad": _embedding_grad,
    "one_hot": lambda a, k, o: ((a[0][..., None] == np.arange(k["num_classes"])).astype(
        np.float32),),
    "gather": lambda a, k, o: (np.take(a[0], a[1], axis=k["axis"]),),
    "gather_grad": _gather_grad,
    "dropout": _dropout,
    # shape
    "reshape": lambda a, k, o: (np.reshape(a[0], k["shape"]),),
    "transpose": lambda a, k, o: (np.transpose(a[0], k["perm"]),),
    "slice": lambda a, k, o: (a[0][k["index"]],), "slice_grad": _slice_grad,
    "set_value": _set_value, "split": _split,
    "concat": lambda a, k, o: (np.concatenate(a, axis=k["axis"]),),
    "stack": lambda a, k, o: (np.stack(a, axis=k["axis"]),),
    "tile": _tile, "expand": lambda a, k, o: (np.broadcast_to(a[0], k["shape"]),),
    # optimizers (the updated parameter and states)
    "adam_update": _adam, "momentum_update": _momentum, "sgd_update": _sgd,
}


def _merge_families() -> None:
    """Op families keep their references in ``references_<family>.py`` beside this file, each
    defining ``REFERENCES`` (numpy alone); they are merged here."""
    import importlib
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    for fname in sorted(os.listdir(here)):
        if fname.startswith("references_") and fname.endswith(".py"):
            for op, fn in importlib.import_module(fname[:-3]).REFERENCES.items():
                if op in REFERENCES:
                    raise ValueError(f"{fname}: REFERENCES[{op!r}] is defined twice")
                REFERENCES[op] = fn


_merge_families()
