"""Normalization: layer_norm and batch_norm (Paddle ``F.layer_norm`` / ``F.batch_norm``).

layer_norm normalizes over the trailing axes ``x.shape[begin_norm_axis:]`` (kept whole on every
rank by its rule), so its kernels need no communication. batch_norm reduces over every axis but
the channel one; its kernels take a :class:`~.registry.KernelCtx` and all-reduce per-channel
sums (never x itself), so a batch-sharded x gives global batch statistics.

Variance convention (as in Paddle): the *biased* batch variance (divide by the element count
``n``) both normalizes the batch and enters the running update
``running = momentum * running + (1 - momentum) * batch_stat``.
Each piece computes its per-channel sum (float64) and its sum of squares about its own mean
(two local passes); one all-reduce of ``[2, C]`` float64 values combines them
(:func:`batch_moments`, Chan's parallel variance), so only the spread of the pieces' means
around the batch mean cancels, never x's magnitude.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..dispatch import apply, check_inplace_target
from ..dtype import is_floating
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from . import fast, gpu_fused
from .common import as_tensor
from .shape import reshape_to

# -- layer_norm ----------------------------------------------------------------------------------


def _row_dot(xp, a, b):
    """Per-row ``sum(a * b)`` of two [rows, n] arrays in one pass (no temporary)."""
    vecdot = getattr(xp, "vecdot", None)
    return vecdot(a, b) if vecdot is not None else xp.einsum("ij,ij->i", a, b)


def _layer_norm_kernel(xp, x, weight, bias, begin_norm_axis, epsilon):
    """(out, mean, rstd) with x viewed as [rows, n]: the mean as a matrix-vector product, the
    variance as a row dot of the centred x, which then becomes the output in place."""
    lead, tail = x.shape[:begin_norm_axis], x.shape[begin_norm_axis:]
    n = math.prod(tail)
    x2 = x.reshape(math.prod(lead), n)
    mean = x2 @ xp.full(n, 1.0 / n, dtype=x.dtype) if n else xp.zeros(len(x2), x.dtype)
    out = xp.subtract(x2, mean[:, None], dtype=x.dtype)
    rstd = _row_dot(xp, out, out)
    rstd *= 1.0 / n
    rstd += epsilon
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    out *= rstd[:, None]
    if weight is not None:
        out *= weight.reshape(n)
    if bias is not None:
        out += bias.reshape(n)
    return out.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def _layer_norm_grad_kernel(xp, x, weight, mean, rstd, dout, begin_norm_axis, epsilon):
    """(dx, dweight, dbias); dweight/dbias have weight's shape (x.shape[b:] without weight).
    With xhat = (x - mean) * rstd and dxhat = dout * weight (rows of n):
    ``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``."""
    lead, tail = x.shape[:begin_norm_axis], x.shape[begin_norm_axis:]
    n, rows = math.prod(tail), math.prod(lead)
    x2, dout2 = x.reshape(rows, n), dout.reshape(rows, n)
    mean, rstd = mean.reshape(rows, 1), rstd.reshape(rows, 1)
    xhat = xp.subtract(x2, mean, dtype=x.dtype)
    xhat *= rstd
    dweight = xp.einsum("ij,ij->j", dout2, xhat)
    dbias = xp.sum(dout2, axis=0)
    dxhat = xp.multiply(dout2, weight.reshape(n), dtype=x.dtype) if weight is not None \
        else dout2.astype(x.dtype, copy=True)
    a = dxhat @ xp.full(n, 1.0 / n, dtype=x.dtype) if n else xp.zeros(rows, x.dtype)
    c = _row_dot(xp, dxhat, xhat)
    c *= 1.0 / n
    xhat *= c[:, None]
    dxhat -= xhat
    dxhat -= a[:, None]
    dxhat *= rstd
    if weight is not None:
        dweight, dbias = dweight.reshape(weight.shape), dbias.reshape(weight.shape)
    else:
        dweight, dbias = dweight.reshape(tail), dbias.reshape(tail)
    return dxhat.reshape(x.shape), dweight, dbias


def _layer_norm_bwd(node, g, *_):
    x, w, mean, rstd = (node.saved_tensor(i) for i in range(4))
    dx, dw, db = apply(OPS["layer_norm_grad"], (x, w, mean, rstd, g), node.attrs)
    _, sw, sb = node.in_shapes
    if sb is not None and tuple(db.shape) != tuple(sb):
        db = reshape_to(db, sb)
    return dx, (dw if sw is not None else None), (db if sb is not None else None)


def _ln_grad_dtype(dtypes, attrs) -> tuple:
    x, dout = np.dtype(dtypes[0]), np.dtype(dtypes[4])
    return x, np.result_type(dout, x), dout


register("layer_norm_grad",
         fast.layer_norm_grad(gpu_fused.layer_norm_grad(_layer_norm_grad_kernel)),
         rule="layer_norm_grad", n_out=3, dtype=_ln_grad_dtype)
register("layer_norm", fast.layer_norm(gpu_fused.layer_norm(_layer_norm_kernel)),
         backward=_layer_norm_bwd, rule="layer_norm", n_out=3,
         save_inputs=(0, 1), save_outputs=(1, 2), nondiff_outputs=frozenset({1, 2}),
         dtype=same_dtype(0, n_out=3), recompute=True)


def _prod(xs) -> int:
    return int(np.prod(list(xs), dtype=np.int64))


@public()
def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, epsilon: float = 1e-5,
               name: str | None = None) -> Tensor:
    """Normalize over the trailing ``normalized_shape`` axes (biased variance), then scale by
    ``weight`` and shift by ``bias`` (each shaped ``normalized_shape`` or its flattening)."""
    x = as_tensor(x)
    if not is_floating(x.dtype):
        raise TypeError(f"layer_norm: x must be floating, got {np.dtype(x.dtype).name}")
    ns = [int(normalized_shape)] if isinstance(normalized_shape, (int, np.integer)) \
        else [int(s) for s in normalized_shape]
    k = len(ns)
    if k == 0 or k > x.ndim or list(x.shape[x.ndim - k:]) != ns:
        raise ValueError(f"layer_norm: normalized_shape {ns} must be a non-empty suffix of x's "
                         f"shape {x.shape}")
    if _prod(ns) == 0:
        raise ValueError(f"layer_norm: normalized_shape {ns} holds no elements")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, Tensor) or _prod(t.shape) != _prod(ns)
                              or (t.ndim != 1 and t.shape != ns)):
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"layer_norm: {arg} must have shape {ns} or [{_prod(ns)}], got "
                             f"{got}")
    out, _, _ = apply(OPS["layer_norm"], (x, weight, bias),
                      {"begin_norm_axis": x.ndim - k, "epsilon": float(epsilon)})
    return out


# -- batch_norm ----------------------------------------------------------------------------------

_CHANNEL_FIRST = ("NC", "NCL", "NCHW", "NCDHW")
_CHANNEL_LAST = ("NLC", "NHWC", "NDHWC")


def _channel_axis(data_format: str, ndim: int) -> int:
    return 1 if data_format in _CHANNEL_FIRST else ndim - 1


def _bn_layout(x, data_format):
    c = _channel_axis(data_format, x.ndim)
    red = tuple(a for a in range(x.ndim) if a != c)
    bshape = [1] * x.ndim
    bshape[c] = x.shape[c]
    return red, tuple(bshape)


def _channel_dot(xp, a, b, red: tuple[int, ...]):
    """Per-channel sum of ``a * b`` over the axes ``red`` in one pass (no temporary)."""
    letters = "abcdefghij"[:a.ndim]
    keep = "".join(letters[i] for i in range(a.ndim) if i not in red)
    return xp.einsum(f"{letters},{letters}->{keep}", a, b)


def batch_moments(xp, ctx, red: tuple[int, ...], total, m2, c, n: int, count: int):
    """[mean, biased variance] (float64, per channel) of the whole batch from this piece's
    per-channel sum ``total``, its sum of squares about ``c`` (``m2``, c near the piece's mean),
    its ``n`` elements per channel and the batch's ``count``, with one all-reduce over the mesh
    dims sharding the axes ``red``: of [sum, sum of squares] where this piece's sum of squares is
    ``m2 + c * (2 * total - n * c)`` in float64. Only the pieces' means are squared, so the
    cancellation in ``E[x^2] - mean^2`` is that of their spread around the global mean (Chan's
    parallel variance), not of x's."""
    c = c.astype(np.float64)
    sums = ctx.allreduce(xp.stack([total, m2 + c * (2.0 * total - n * c)]), "sum", 0, red)
    mean = sums[0] / count
    sums[1] = xp.maximum(sums[1] / count - mean * mean, 0.0)
    sums[0] = mean
    return sums


def _batch_norm_kernel(xp, x, running_mean, running_var, weight, bias, training, momentum,
                       epsilon, data_format, ctx):
    """``training``: normalize with the batch statistics and update the running ones in place;
    else normalize with the running statistics. Returns (out, running_mean, running_var,
    saved_mean, saved_rstd)."""
    red, bshape = _bn_layout(x, data_format)
    if training:
        n = _prod(x.shape[a] for a in red)
        count = _prod(ctx.global_shape(0, x.shape)[a] for a in red)
        total = xp.sum(x, axis=red, dtype=np.float64)
        c = (total / max(n, 1)).astype(x.dtype)
        xc = x - c.reshape(bshape)
        moments = batch_moments(xp, ctx, red, total, _channel_dot(xp, xc, xc, red), c, n, count)
        mean, var = moments[0].astype(x.dtype), moments[1].astype(x.dtype)
        xc = x - mean.reshape(bshape)
        running_mean[...] = momentum * running_mean + (1.0 - momentum) * mean
        running_var[...] = momentum * running_var + (1.0 - momentum) * var
    else:
        mean = running_mean.astype(x.dtype, copy=True)
        var = running_var.astype(x.dtype, copy=False)
        xc = x - mean.reshape(bshape)
    rstd = 1.0 / xp.sqrt(var + epsilon)
    scale = rstd if weight is None else rstd * weight  # per channel: one pass over x below
    out = xc * scale.reshape(bshape)
    if bias is not None:
        out += bias.reshape(bshape)
    return out.astype(x.dtype, copy=False), running_mean, running_var, mean, rstd


def _batch_norm_grad_kernel(xp, x, weight, saved_mean, saved_rstd, dout, use_global_stats,
                            data_format, ctx):
    """(dx, dweight, dbias). The per-channel sums of dout and dout * xhat are all-reduced over
    the non-channel axes; with ``use_global_stats`` the statistics were constants."""
    red, bshape = _bn_layout(x, data_format)
    xhat = (x - saved_mean.reshape(bshape)) * saved_rstd.reshape(bshape)
    # both per-channel sums in one all-reduce
    sums = ctx.allreduce(xp.stack([xp.sum(dout, axis=red), _channel_dot(xp, dout, xhat, red)]),
                         "sum", 0, red)
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    k = saved_rstd if weight is None else weight * saved_rstd
    dx = dout * k.reshape(bshape)
    if not use_global_stats:
        # dx = k * (dout - (sum_dy + xhat * sum_dy_xhat) / count), with per-channel factors
        count = _prod(ctx.global_shape(0, x.shape)[a] for a in red)
        dx -= xhat * (k * sum_dy_xhat / count).reshape(bshape)
        dx -= (k * sum_dy / count).reshape(bshape)
    return dx.astype(x.dtype, copy=False), sum_dy_xhat, sum_dy


def _batch_norm_bwd(node, g, *_):
    x, w, mean, rstd = (node.saved_tensor(i) for i in range(4))
    attrs = {"use_global_stats": not node.attrs["training"],
             "data_format": node.attrs["data_format"]}
    dx, dw, db = apply(OPS["batch_norm_grad"], (x, w, mean, rstd, g), attrs)
    return dx, None, None, dw, db


def _bn_grad_dtype(dtypes, attrs) -> tuple:
    x = np.dtype(dtypes[0])
    stat = np.result_type(dtypes[4], x)
    return x, stat, stat


def _bn_dtype(dtypes, attrs) -> tuple:
    x = np.dtype(dtypes[0])
    return x, np.dtype(dtypes[1]), np.dtype(dtypes[2]), x, x


register("batch_norm_grad", fast.batch_norm_grad(_batch_norm_grad_kernel),
         rule="batch_norm_grad", n_out=3, needs_ctx=True, dtype=_bn_grad_dtype)
_BN_SPEC = dict(backward=_batch_norm_bwd, rule="batch_norm", n_out=5, save_inputs=(0, 3),
                save_outputs=(3, 4), nondiff_outputs=frozenset({1, 2, 3, 4}),
                grad_inputs=(0, 3, 4), needs_ctx=True, dtype=_bn_dtype)
# Training (batch statistics): the kernel updates the running statistics (inputs 1 and 2) in
# place: outputs 1 and 2 *are* those tensors (mean -> mean_out, variance -> variance_out, as
# Paddle's batch_norm_). Inference: the same kernel writes nothing; its outputs 1 and 2 are
# views of the running statistics.
register("batch_norm", fast.batch_norm(_batch_norm_kernel), mutates=((1, 1), (2, 2)), **_BN_SPEC)
register("batch_norm_infer", _batch_norm_kernel, view=((1, 1), (2, 2)), **_BN_SPEC)


@public()
def batch_norm(x: Tensor, running_mean: Tensor, running_var: Tensor,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum: float = 0.9, epsilon: float = 1e-5, data_format: str = "NCHW",
               use_global_stats: bool | None = None, name: str | None = None) -> Tensor:
    """Batch normalization over every axis but the channel one (axis 1 for NC/NCL/NCHW/NCDHW,
    the last for NLC/NHWC/NDHWC).

    With batch statistics (``use_global_stats`` False; its default is ``not training``) the
    biased batch variance normalizes and ``running_mean``/``running_var`` are updated in place:
    ``running = momentum * running + (1 - momentum) * batch_stat``. Otherwise the running
    statistics normalize and nothing is written.
    """
    x = as_tensor(x)
    if not is_floating(x.dtype):
        raise TypeError(f"batch_norm: x must be floating, got {np.dtype(x.dtype).name}")
    if data_format not in _CHANNEL_FIRST + _CHANNEL_LAST:
        raise ValueError(f"batch_norm: data_format must be one of "
                         f"{list(_CHANNEL_FIRST + _CHANNEL_LAST)}, got {data_format!r}")
    if x.ndim < 2:
        raise ValueError(f"batch_norm: x must have at least 2 dims, got shape {x.shape}")
    c_axis = _channel_axis(data_format, x.ndim)
    channels = x.shape[c_axis]
    for arg, t in (("running_mean", running_mean), ("running_var", running_var),
                   ("weight", weight), ("bias", bias)):
        if t is None and arg.startswith("running"):
            raise TypeError(f"batch_norm: {arg} is required")
        if t is not None and (not isinstance(t, Tensor) or t.shape != [channels]):
            got = t.shape if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"batch_norm: {arg} must have shape [{channels}] (channel axis "
                             f"{c_axis} of x {x.shape}, data_format {data_format}), got {got}")
    if use_global_stats is None:
        use_global_stats = not training
    batch_stats = not use_global_stats
    op = OPS["batch_norm"] if batch_stats else OPS["batch_norm_infer"]
    if batch_stats:
        count = _prod(n for a, n in enumerate(x.shape) if a != c_axis)
        if count == 0:
            raise ValueError(f"batch_norm: x of shape {x.shape} has no elements per channel to "
                             "compute batch statistics from")
        for t in (running_mean, running_var):
            check_inplace_target(op, t)
    attrs = {"training": batch_stats, "momentum": float(momentum), "epsilon": float(epsilon),
             "data_format": data_format}
    return apply(op, (x, running_mean, running_var, weight, bias), attrs)[0]


# -- rms_norm ------------------------------------------------------------------------------------

def _rms_rows(x, begin: int):
    lead, tail = x.shape[:begin], x.shape[begin:]
    return x.reshape(math.prod(lead), math.prod(tail)), tuple(range(begin, x.ndim))


def _rms_norm_kernel(xp, x, weight, begin_norm_axis, epsilon, ctx):
    """(out, rstd): ``rstd = 1 / sqrt(mean(x^2) + eps)`` over the trailing axes; the rows' sums
    of squares are all-reduced over the mesh dims sharding them (a ``[rows]`` message)."""
    x2, tail = _rms_rows(x, begin_norm_axis)
    n = math.prod(ctx.global_shape(0, x.shape)[begin_norm_axis:])
    rstd = ctx.allreduce(_row_dot(xp, x2, x2), "sum", 0, tail)
    rstd *= 1.0 / n
    rstd += epsilon
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    out = xp.multiply(x2, rstd[:, None], dtype=x.dtype)
    if weight is not None:
        out *= weight.reshape(-1)
    return out.reshape(x.shape), rstd.reshape(x.shape[:begin_norm_axis])


def _rms_norm_grad_kernel(xp, x, weight, rstd, dout, begin_norm_axis, ctx):
    """(dx, dweight) with xhat = x * rstd, dxhat = dout * weight:
    ``dx = rstd * (dxhat - xhat * mean(dxhat * xhat))`` (the row mean all-reduced like the
    forward's), ``dweight = sum over rows of dout * xhat``."""
    x2, tail = _rms_rows(x, begin_norm_axis)
    dout2 = dout.reshape(x2.shape)
    n = math.prod(ctx.global_shape(0, x.shape)[begin_norm_axis:])
    r = rstd.reshape(-1, 1)
    xhat = xp.multiply(x2, r, dtype=x.dtype)
    dweight = xp.einsum("ij,ij->j", dout2, xhat)
    dxhat = xp.multiply(dout2, weight.reshape(-1), dtype=x.dtype) if weight is not None \
        else dout2.astype(x.dtype, copy=True)
    c = ctx.allreduce(_row_dot(xp, dxhat, xhat), "sum", 0, tail)
    c *= 1.0 / n
    xhat *= c[:, None]
    dxhat -= xhat
    dxhat *= r
    return dxhat.reshape(x.shape), dweight.reshape(x.shape[begin_norm_axis:])


def _rms_norm_bwd(node, g, _):
    x, w, rstd = (node.saved_tensor(i) for i in range(3))
    dx, dw = apply(OPS["rms_norm_grad"], (x, w, rstd, g),
                   {"begin_norm_axis": node.attrs["begin_norm_axis"]})
    return dx, (dw if node.in_shapes[1] is not None else None)


register("rms_norm_grad", _rms_norm_grad_kernel, rule="rms_norm_grad", n_out=2, needs_ctx=True,
         dtype=lambda d, a: (np.dtype(d[0]), np.result_type(d[3], d[0])))
register("rms_norm", _rms_norm_kernel, backward=_rms_norm_bwd, rule="rms_norm", n_out=2,
         needs_ctx=True, save_inputs=(0, 1), save_outputs=(1,), nondiff_outputs=frozenset({1}),
         dtype=same_dtype(0, n_out=2))


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             epsilon: float = 1e-5, name: str | None = None) -> Tensor:
    """``x / sqrt(mean(x^2) + epsilon) * weight`` over the trailing ``normalized_shape`` axes,
    one fused op; ``weight`` has shape ``normalized_shape``. A sharded normalized axis costs an
    all-reduce of the rows' sums of squares, never a gather of x.

    Example::

        y = dt.nn.functional.rms_norm(dt.randn([2, 8, 16]), 16, dt.ones([16]))
    """
    x = as_tensor(x)
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"rms_norm: x must be floating, got {np.dtype(x.dtype).name}")
    ns = [int(normalized_shape)] if isinstance(normalized_shape, (int, np.integer)) \
        else [int(s) for s in normalized_shape]
    k = len(ns)
    if k == 0 or k > x.ndim or list(x.shape[x.ndim - k:]) != ns or _prod(ns) == 0:
        raise ValueError(f"rms_norm: normalized_shape {ns} must be a non-empty suffix of x's "
                         f"shape {x.shape} holding elements")
    if weight is not None and (not isinstance(weight, Tensor) or weight.shape != ns):
        got = weight.shape if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"rms_norm: weight must have shape {ns}, got {got}")
    return apply(OPS["rms_norm"], (x, weight),
                 {"begin_norm_axis": x.ndim - k, "epsilon": float(epsilon)})[0]
