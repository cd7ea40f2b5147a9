"""Losses: softmax cross entropy (a fused op, parallel over a sharded class axis), Paddle's
``F.cross_entropy`` and ``F.mse_loss`` composed from registered ops.

The fused ``cross_entropy`` kernel never needs the whole class axis: it all-reduces (through
``ctx``) the row max, the row sum of ``exp(x - max)`` and the logit picked by the label, which
only the piece holding the label's class contributes. Dense (``DENSE_CTX``) these reductions are
identities and the kernel is the plain single-process computation. ``cross_entropy_mean`` (what
``F.cross_entropy`` calls for the mean over hard labels without weights) also reduces over the
batch: the loss sum, the label count and the out-of-range count in one all-reduce.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..dispatch import apply
from ..dtype import is_floating
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from . import fast
from .activation import log_softmax, softmax
from .common import as_tensor, check_index_range, normalize_axis
from .elementwise import (
    cast,
    divide,
    log,
    maximum,
    multiply,
    neg,
    not_equal,
    scale,
    subtract,
    where,
)
from .indexing import gather, one_hot
from .reduction import mean as _mean
from .reduction import sum as _sum
from .shape import reshape, reshape_to, squeeze, transpose

_REDUCTIONS = ("mean", "sum", "none")


def _keep_shape(shape, axis):
    return tuple(shape[:axis]) + (1,) + tuple(shape[axis + 1:])


def _ce_rows(xp, logits, label, axis, ignore_index, ctx):
    """(softmax, loss, stats) of this rank's rows, with no label check: loss shaped like logits
    with the class axis reduced to 1, 0 on rows labelled ``ignore_index``; ``stats`` the float64
    [sum of loss, rows not ignored, of those the ones whose label is outside [0, C)] (this
    piece's counts, not reduced over the batch). An out-of-range label picks no logit."""
    keep = _keep_shape(logits.shape, axis)
    n_cls = ctx.global_shape(0, logits.shape)[axis]
    lab = label.reshape(keep)
    valid = lab != ignore_index
    c_local = logits.shape[axis]
    if c_local:
        m = xp.max(logits, axis=axis, keepdims=True)
    else:
        m = xp.full(keep, -np.inf, dtype=logits.dtype)
    m = ctx.allreduce(m, "max", 0, (axis,))
    e = xp.subtract(logits, m, out=xp.empty_like(logits))
    xp.exp(e, out=e)
    s = ctx.allreduce(xp.sum(e, axis=axis, keepdims=True), "sum", 0, (axis,))
    local = lab - ctx.offset(0, axis)
    hit = valid & (local >= 0) & (local < c_local)
    if c_local:
        picked = xp.take_along_axis(logits, xp.where(hit, local, 0), axis=axis)
        picked = xp.where(hit, picked, 0).astype(logits.dtype, copy=False)
    else:
        picked = xp.zeros(keep, dtype=logits.dtype)
    picked = ctx.allreduce(picked, "sum", 0, (axis,))
    loss = xp.where(valid, xp.log(s) + m - picked, 0).astype(logits.dtype, copy=False)
    e /= s
    stats = xp.empty(3, dtype=np.float64)
    stats[0] = loss.sum(dtype=np.float64)
    stats[1] = xp.count_nonzero(valid)
    stats[2] = xp.count_nonzero(valid & ((lab < 0) | (lab >= n_cls)))
    return e, loss, stats


_ce_rows = fast.cross_entropy_rows(_ce_rows)


def _check_labels(xp, ctx, logits, label, axis, ignore_index, now: bool = False):
    """The labels, checked by ``check_index_range`` (``now``: agreed at once)."""
    return check_index_range(xp, ctx, "cross_entropy", "label value", label,
                             ctx.global_shape(0, logits.shape)[axis], 1, label != ignore_index,
                             f" (ignore_index={ignore_index})", now=now)


def _ce_kernel(xp, logits, label, axis, ignore_index, ctx):
    """(softmax, loss) with loss shaped like logits with the class axis reduced to 1; rows whose
    label is ``ignore_index`` get loss 0."""
    label = _check_labels(xp, ctx, logits, label, axis, ignore_index)
    e, loss, _ = _ce_rows(xp, logits, label, axis, ignore_index, ctx)
    return e, loss


def _ce_mean_kernel(xp, logits, label, axis, ignore_index, ctx):
    """(softmax, loss, count): ``count`` the labels not ignored over the whole batch, ``loss``
    the sum of their losses over ``max(count, 1)``. The sum, the count and the number of
    out-of-range labels are all-reduced together over the batch's mesh dims (the one
    collective); only when that number is not 0 does every rank run the label check, which
    names the value and raises everywhere."""
    e, _, stats = _ce_rows(xp, logits, label, axis, ignore_index, ctx)
    batch = tuple(a for a in range(logits.ndim) if a != axis)
    stats = ctx.allreduce(stats, "sum", 0, batch)
    total, count, bad = (float(v) for v in stats)
    if bad:
        _check_labels(xp, ctx, logits, label, axis, ignore_index, now=True)
    return e, xp.asarray(total / max(count, 1.0), logits.dtype), xp.asarray(count, logits.dtype)


def _ce_grad_kernel(xp, softmax, label, dloss, axis, ignore_index, ctx, out=None):
    """dlogits = (softmax - onehot(label)) * dloss, zero on ignored rows; the one-hot uses this
    piece's global class indices. ``out`` may be softmax."""
    keep = _keep_shape(softmax.shape, axis)
    lab = label.reshape(keep)
    cls_shape = [1] * softmax.ndim
    cls_shape[axis] = softmax.shape[axis]
    cls = (xp.arange(softmax.shape[axis]) + ctx.offset(0, axis)).reshape(cls_shape)
    scale = xp.where(lab != ignore_index, dloss, 0)
    hot = (cls == lab) * scale
    r = xp.multiply(softmax, scale, out=xp.empty_like(softmax) if out is None else out)
    r -= hot
    return r


def _ce_mean_grad_kernel(xp, softmax, label, count, dloss, axis, ignore_index, ctx, out=None):
    """dlogits of the mean loss: ``_ce_grad_kernel`` with every row's dloss ``dloss / max(count,
    1)``. ``out`` may be softmax."""
    return _ce_grad_kernel(xp, softmax, label, dloss / xp.maximum(count, 1), axis, ignore_index,
                           ctx, out=out)


def _ce_bwd(node, g_softmax, g_loss):
    if g_loss is None:
        return None, None
    label, sm = node.saved_tensor(0), node.saved_tensor(1)
    return apply(OPS["cross_entropy_grad"], (sm, label, g_loss), node.attrs), None


def _ce_mean_bwd(node, g_softmax, g_loss, g_count):
    if g_loss is None:
        return None, None
    label, sm, count = (node.saved_tensor(i) for i in range(3))
    return apply(OPS["cross_entropy_mean_grad"], (sm, label, count, g_loss), node.attrs), None


_ce_grad_kernel = fast.cross_entropy_grad(_ce_grad_kernel)
register("cross_entropy_grad", _ce_grad_kernel, rule="cross_entropy_grad", needs_ctx=True,
         reuse=(0,), dtype=same_dtype(0), accepts_out=True)
register("cross_entropy", _ce_kernel, backward=_ce_bwd, rule="cross_entropy", n_out=2,
         save_inputs=(1,), save_outputs=(0,), nondiff_outputs=frozenset({0}), grad_inputs=(0,),
         needs_ctx=True, no_need_buffer=(0,), dtype=same_dtype(0, n_out=2))
register("cross_entropy_mean_grad", _ce_mean_grad_kernel, rule="cross_entropy_mean_grad",
         needs_ctx=True, reuse=(0,), dtype=same_dtype(0), accepts_out=True)
register("cross_entropy_mean", _ce_mean_kernel, backward=_ce_mean_bwd, rule="cross_entropy_mean",
         n_out=3, save_inputs=(1,), save_outputs=(0, 2), nondiff_outputs=frozenset({0, 2}),
         grad_inputs=(0,), needs_ctx=True, no_need_buffer=(0,), dtype=same_dtype(0, n_out=3))


# -- public functions ------------------------------------------------------------------------

def _check_logits(op: str, x: Any, axis: int) -> tuple[Tensor, int]:
    x = as_tensor(x)
    if not is_floating(x.dtype):
        raise TypeError(f"{op}: input must be floating, got {np.dtype(x.dtype).name}")
    if x.ndim == 0:
        raise ValueError(f"{op}: input must have at least 1 dim, got shape {x.shape}")
    axis = normalize_axis(op, axis, x.ndim)
    if x.shape[axis] == 0:
        raise ValueError(f"{op}: input of shape {x.shape} has no classes on axis {axis}")
    return x, axis


def _check_hard_label(op: str, x: Tensor, label: Any, axis: int) -> Tensor:
    label = as_tensor(label)
    if np.dtype(label.dtype).kind not in "iu":
        raise TypeError(f"{op}: hard label must be an integer tensor, got "
                        f"{np.dtype(label.dtype).name} (use soft_label=True for probabilities)")
    batch = x.shape[:axis] + x.shape[axis + 1:]
    keep = list(_keep_shape(x.shape, axis))
    if label.shape != batch and label.shape != keep:
        raise ValueError(f"{op}: label shape {label.shape} must be {batch} or {keep} for input "
                         f"{x.shape} with class axis {axis}")
    return label


def _check_soft_label(op: str, x: Tensor, label: Any) -> Tensor:
    label = as_tensor(label, x)
    if label.shape != x.shape or not is_floating(label.dtype):
        raise ValueError(f"{op}: a soft label must be floating with the input's shape {x.shape}, "
                         f"got {np.dtype(label.dtype).name} {label.shape}")
    return label


def _soft_ce(logp: Tensor, soft: Tensor, axis: int) -> Tensor:
    """``-sum(soft * logp, axis, keepdim=True)``."""
    return neg(_sum(multiply(soft, logp), axis=axis, keepdim=True))


@public()
def softmax_with_cross_entropy(logits: Tensor, label: Tensor, soft_label: bool = False,
                               ignore_index: int = -100, numeric_stable_mode: bool = True,
                               return_softmax: bool = False, axis: int = -1
                               ) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax over ``axis`` then cross entropy with ``label`` (Paddle
    ``F.softmax_with_cross_entropy``).

    Hard labels are integers shaped like logits with the class axis removed or of size 1; a row
    labelled ``ignore_index`` gets loss 0. Soft labels are probabilities shaped like logits.
    The loss has the class axis of size 1; with ``return_softmax`` returns (loss, softmax).
    """
    op = "softmax_with_cross_entropy"
    logits, axis = _check_logits(op, logits, axis)
    if soft_label:
        label = _check_soft_label(op, logits, label)
        loss = _soft_ce(log_softmax(logits, axis), label, axis)
        return (loss, softmax(logits, axis)) if return_softmax else loss
    label = _check_hard_label(op, logits, label, axis)
    sm, loss = apply(OPS["cross_entropy"], (logits, label),
                     {"axis": axis, "ignore_index": int(ignore_index)})
    return (loss, sm) if return_softmax else loss


def _class_vector(weight: Tensor, ndim: int, axis: int) -> Tensor:
    """A [C] tensor reshaped to broadcast along ``axis`` of an ndim tensor."""
    shape = [1] * ndim
    shape[axis] = weight.shape[0]
    return reshape_to(weight, shape)


@public()
def cross_entropy(input: Tensor, label: Tensor, weight: Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean", soft_label: bool = False,
                  axis: int = -1, use_softmax: bool = True, label_smoothing: float = 0.0,
                  name: str | None = None) -> Tensor:
    """Paddle ``F.cross_entropy``.

    Hard integer labels (shape ``[*B]`` or ``[*B, 1]`` along ``axis``) or soft labels
    (``soft_label=True``, probabilities shaped like input). ``weight`` [C] rescales each class.
    ``use_softmax=False`` takes input as probabilities. ``label_smoothing`` mixes the one-hot
    label with the uniform distribution (ignore_index then does not apply, as in Paddle).
    Reduction "none" keeps per-sample losses (class axis of size 1, or removed when a hard label
    had no class axis); "sum" sums them; "mean" divides the sum by the number of non-ignored
    labels (hard, no weight; 0 labels give 0), by the summed per-sample weights (with weight),
    or by the number of samples (soft).
    """
    op = "cross_entropy"
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
    x, axis = _check_logits(op, input, axis)
    n_cls = x.shape[axis]
    if weight is not None and (not isinstance(weight, Tensor) or weight.shape != [n_cls]):
        got = weight.shape if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"{op}: weight must have shape [{n_cls}] (classes on axis {axis} of "
                         f"input {x.shape}), got {got}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")

    hard = not soft_label
    squeeze_back = False
    if hard:
        label = _check_hard_label(op, x, label, axis)
        squeeze_back = label.ndim == x.ndim - 1
        if label_smoothing > 0.0 or not use_softmax:
            # one-hot (class axis moved to ``axis``) and go through the soft path
            lab_b = label if squeeze_back else squeeze(label, [axis])
            valid_b = not_equal(lab_b, as_tensor(int(ignore_index), lab_b))
            safe = where(valid_b, lab_b, as_tensor(0, lab_b))
            soft = cast(one_hot(safe, n_cls), x.dtype)
            if axis != x.ndim - 1:
                perm = list(range(x.ndim - 1))
                perm.insert(axis, x.ndim - 1)
                soft = transpose(soft, perm)
            if label_smoothing > 0.0:
                soft = scale(soft, 1.0 - float(label_smoothing),
                             float(label_smoothing) / n_cls)
                hard = False  # Paddle: smoothed labels are soft labels (no ignore_index)
            else:
                soft = multiply(soft, cast(reshape_to(valid_b, list(_keep_shape(x.shape, axis))),
                                           x.dtype))
            label = soft
    else:
        label = _check_soft_label(op, x, label)

    if isinstance(label, Tensor) and np.dtype(label.dtype).kind in "iu":
        attrs = {"axis": axis, "ignore_index": int(ignore_index)}
        if reduction == "mean" and weight is None:  # the mean, its count and the label check
            return apply(OPS["cross_entropy_mean"], (x, label), attrs)[1]  # in one all-reduce
        loss = apply(OPS["cross_entropy"], (x, label), attrs)[1]
    else:
        logp = log_softmax(x, axis) if use_softmax else log(x)
        loss = _soft_ce(logp, label, axis)

    keep = list(_keep_shape(x.shape, axis))
    denom = None
    if hard:
        lab = label
        if is_floating(lab.dtype):  # one-hot of use_softmax=False: recover the mask
            valid = cast(_sum(lab, axis=axis, keepdim=True), x.dtype)
        else:
            lab = reshape_to(lab, keep) if lab.shape != keep else lab
            valid = cast(not_equal(lab, as_tensor(int(ignore_index), lab)), x.dtype)
        if weight is not None:
            if is_floating(label.dtype):
                w = _sum(multiply(label, _class_vector(weight, x.ndim, axis)), axis=axis,
                         keepdim=True)
            else:
                safe = where(not_equal(lab, as_tensor(int(ignore_index), lab)), lab,
                             as_tensor(0, lab))
                w = multiply(reshape_to(gather(weight, reshape(safe, [-1])), keep), valid)
            loss = multiply(loss, w)
            denom = _sum(w)
        elif reduction == "mean":  # (only the mean divides: a sharded batch's count is a
            denom = maximum(_sum(valid), as_tensor(1.0, x))  # collective)
    elif weight is not None:
        w = _sum(multiply(label, _class_vector(weight, x.ndim, axis)), axis=axis, keepdim=True)
        loss = multiply(loss, w)
        denom = _sum(w)

    if reduction == "sum":
        return _sum(loss)
    if reduction == "mean":
        return divide(_sum(loss), denom) if denom is not None else _mean(loss)
    return squeeze(loss, [axis]) if squeeze_back else loss


@public()
def mse_loss(input: Tensor, label: Tensor, reduction: str = "mean",
             name: str | None = None) -> Tensor:
    """``(input - label) ** 2`` reduced by "mean", "sum" or "none" (Paddle ``F.mse_loss``)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"mse_loss: reduction must be one of {list(_REDUCTIONS)}, got "
                         f"{reduction!r}")
    input = as_tensor(input)
    label = as_tensor(label, input)
    try:
        np.broadcast_shapes(tuple(input.shape), tuple(label.shape))
    except ValueError:
        raise ValueError(f"mse_loss: input shape {input.shape} and label shape {label.shape} "
                         "do not broadcast") from None
    d = subtract(input, label)
    sq = multiply(d, d)
    if reduction == "mean":
        return _mean(sq)
    return _sum(sq) if reduction == "sum" else sq
