"""Padding (Paddle ``F.pad``): constant, reflect and replicate modes over any axes, through
``numpy.pad``; its gradient adds each padded element's gradient to the element it copied.

Layouts come from the ``pad`` rules of :mod:`spmd_rules.conv`: unpadded axes keep their
sharding, and a padded axis x already shards by one mesh dim stays sharded where each output
piece copies only rows of its own and its neighbours' input pieces — each rank extends its
piece with those rows (:func:`~.halo.extend`, two ``sendrecv`` ring shifts) and copies its
output rows from it; the backward adds the gradients to the copied rows and sends the halo
rows' back (:func:`~.halo.fold`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from spmd_rules.base import TensorMeta
from spmd_rules.conv import halo_plan, pad_spans, pad_sweep, spatial_pad_axes
from spmd_rules.dist_attr import local_shape

from ..dispatch import apply
from ..schema import DENSE_CTX, OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor
from .halo import extend, extended_shapes, fold

__all__ = ["pad"]

_SAME = same_dtype(0)

# -- padding ---------------------------------------------------------------------------------

_NP_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def _pad_local(attrs: dict, in_metas, out_metas, coord) -> dict:
    """``local_attrs`` of pad and pad_grad: each padded axis the rule keeps sharded
    (:func:`~spmd_rules.conv.spatial_pad_axes`) leaves ``pads`` for ``halo`` ((axis, mesh
    dim, :class:`~spmd_rules.conv.HaloPlan`)) and ``halo_pads`` ((size, before, after) of
    that axis)."""
    meta = in_metas[0]
    if coord is None:
        return attrs
    if "value" not in attrs:  # pad_grad: the layout of the unpadded x
        shape = tuple(s - a - b for s, (a, b) in zip(meta.shape, attrs["pads"]))
        meta = TensorMeta(shape, meta.dist_attr)
    kept = {d: m for d, m in spatial_pad_axes("pad", meta, attrs).items()
            if meta.dist_attr.mesh_shape[m] > 1}
    if not kept:
        return attrs
    pads, halo, sizes = list(attrs["pads"]), [], []
    for d, m in kept.items():
        (a, b), n = pads[d], meta.shape[d]
        halo.append((d, m, halo_plan(pad_sweep(attrs["mode"], n, a, b),
                                     meta.dist_attr.mesh_shape[m], coord[m])))
        sizes.append((n, a, b))
        pads[d] = (0, 0)
    return {**attrs, "pads": tuple(pads), "halo": tuple(halo), "halo_pads": tuple(sizes),
            "piece_shape": local_shape(meta.shape, meta.dist_attr, coord)}


def _rows(halo, halo_pads, mode):
    """Per halo axis: (axis, source row in the extended piece of each local output row, its
    validity mask)."""
    out = []
    for (axis, _, plan), (n, a, b) in zip(halo, halo_pads):
        oa, ob = plan.out_start, plan.out_start + plan.out_rows
        spans = pad_spans(mode, n, a, b)[oa:ob]
        first = (pad_sweep(mode, n, a, b).rows(oa, ob) or (0, 0))[0]
        valid = np.array([hi > lo for lo, hi in spans], dtype=bool)
        src = np.array([lo - first if hi > lo else 0 for lo, hi in spans], dtype=np.int64)
        out.append((axis, src, valid))
    return out


def _pad_kernel(xp, x, pads, mode, value, halo=(), halo_pads=(), piece_shape=None,
                ctx=DENSE_CTX):
    if halo:  # padded axes kept sharded: the rows this rank's output rows copy
        x = extend(xp, x, halo, ctx, 0.0)[0]
        for axis, src, valid in _rows(halo, halo_pads, mode):
            if not valid.any():  # only constant rows here
                shape = list(x.shape)
                shape[axis] = len(valid)
                x = xp.full(shape, value, dtype=x.dtype)
                continue
            x = xp.take(x, xp.asarray(src), axis=axis)
            if not valid.all():
                shape = [1] * x.ndim
                shape[axis] = len(valid)
                x = xp.where(xp.asarray(valid.reshape(shape)), x, xp.asarray(value, x.dtype))
    if mode == "constant":
        return xp.pad(x, pads, mode="constant", constant_values=value)
    return xp.pad(x, pads, mode=_NP_MODES[mode])


def _pad_grad_kernel(xp, dout, pads, mode, halo=(), halo_pads=(), piece_shape=None,
                     ctx=DENSE_CTX):
    """Each axis in turn: the centre, plus (reflect) the mirrored borders or (replicate) the
    border sums added where they were copied from; along an axis kept sharded, each output
    row's gradient added to the row of the extended piece it copied, the halo rows' sent
    back (:func:`~.halo.fold`)."""
    g = _pad_grad_axes(xp, dout, pads, mode)
    if not halo:
        return g
    shape, shapes = extended_shapes(piece_shape, halo)
    for axis, src, valid in reversed(_rows(halo, halo_pads, mode)):
        rows = list(g.shape)
        rows[axis] = shape[axis]
        acc = xp.zeros(rows, dtype=g.dtype)
        moved, out = xp.moveaxis(g, axis, 0), xp.moveaxis(acc, axis, 0)
        for t in np.flatnonzero(valid):
            out[src[t]] += moved[t]
        g = acc
    return xp.ascontiguousarray(fold(xp, g, halo, ctx, shapes))


def _pad_grad_axes(xp, dout, pads, mode):
    g = dout
    for axis, (lo, hi) in enumerate(pads):
        if not (lo or hi):
            continue
        g = xp.moveaxis(g, axis, 0)
        n = g.shape[0] - lo - hi
        out = g[lo:lo + n].copy()
        if mode == "reflect":
            if lo:
                out[1:lo + 1] += g[:lo][::-1]
            if hi:
                out[n - 1 - hi:n - 1] += g[lo + n:][::-1]
        elif mode == "replicate":
            out[0] += g[:lo].sum(axis=0)
            out[n - 1] += g[lo + n:].sum(axis=0)
        g = xp.moveaxis(out, 0, axis)
    return xp.ascontiguousarray(g)


def _pad_bwd(node, g):
    return apply(OPS["pad_grad"], (g,), {"pads": node.attrs["pads"], "mode": node.attrs["mode"]})


register("pad_grad", _pad_grad_kernel, rule="pad_grad", dtype=_SAME, needs_ctx=True,
         local_attrs=_pad_local)
register("pad", _pad_kernel, backward=_pad_bwd, rule="pad", no_need_buffer=(0,), dtype=_SAME,
         needs_ctx=True, local_attrs=_pad_local)



# -- public function ---------------------------------------------------------------------------

def _pad_pairs(x: Tensor, pad: Sequence[int], mode: str) -> tuple[tuple[int, int], ...]:
    nd = x.ndim
    vals = [int(v) for v in pad]
    if any(v < 0 for v in vals) or len(vals) % 2:
        raise ValueError(f"pad: pad {list(pad)} must be an even number of non-negative ints")
    pairs = [(0, 0)] * nd
    if len(vals) == 2 * nd:  # every axis, from the first (Paddle)
        pairs = [(vals[2 * d], vals[2 * d + 1]) for d in range(nd)]
    elif len(vals) <= 2 * (nd - 2):  # the last axes, from the last (W first: left, right, ...)
        for k in range(len(vals) // 2):
            pairs[nd - 1 - k] = (vals[2 * k], vals[2 * k + 1])
    else:
        raise ValueError(f"pad: pad {list(pad)} must give {2 * nd} ints (every axis) or up to "
                         f"{2 * (nd - 2)} (the spatial axes) for x of shape {x.shape}")
    if mode == "reflect":
        for d, (lo, hi) in enumerate(pairs):
            if max(lo, hi) >= x.shape[d] and (lo or hi):
                raise ValueError(f"pad: reflect padding {[lo, hi]} of axis {d} must be smaller "
                                 f"than its size {x.shape[d]} (x {x.shape})")
    if mode == "replicate":
        for d, (lo, hi) in enumerate(pairs):
            if (lo or hi) and x.shape[d] == 0:
                raise ValueError(f"pad: cannot replicate-pad the empty axis {d} of x {x.shape}")
    return tuple(pairs)


@public()
def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0,
        data_format: str = "NCHW", name: str | None = None) -> Tensor:
    """Pad ``x``: ``pad`` gives (before, after) for every axis from the first (2 * ndim ints),
    or for the trailing spatial axes from the last (``[left, right, top, bottom]`` for NCHW).
    ``mode``: ``"constant"`` (``value``), ``"reflect"`` (mirror without the edge) or
    ``"replicate"`` (repeat the edge).

    >>> dt.nn.functional.pad(dt.ones([1, 1, 2, 2]), [1, 1, 0, 2]).shape
    [1, 1, 4, 4]
    """
    x = as_tensor(x)
    if mode not in _NP_MODES:
        raise ValueError(f"pad: mode must be one of {list(_NP_MODES)}, got {mode!r}")
    if data_format not in ("NCL", "NCHW", "NCDHW"):
        raise ValueError(f"pad: data_format {data_format!r} is not supported (channels first)")
    pairs = _pad_pairs(x, pad, mode)
    return apply(OPS["pad"], (x,), {"pads": pairs, "mode": mode, "value": float(value)})
