"""Halo exchange for spatially sharded convolution, pooling, resampling and padding.

When the rule keeps H (or W) of ``x [N, C, H, W]`` sharded by one mesh dim, each rank's
kernel first extends its piece with the rows its output rows read from its two neighbours
(:func:`extend`: two ``sendrecv`` ring shifts on the process group along that mesh dim, the
padding rows filled locally), runs the dense kernel on the extended piece with no padding on
that axis, and in the backward sends the gradients of the received rows back to their owners,
which add them (:func:`fold`). The geometry is :func:`spmd_rules.conv.halo_plan`, computed per
rank from metadata by :func:`halo_attrs` (the ops' ``local_attrs``).
"""
from __future__ import annotations

from typing import Any, Sequence

from spmd_rules.conv import halo_plan, pool2d_out_hw, sweep

from ..layout.mesh_groups import group_along

__all__ = ["halo_attrs", "extend", "fold", "out_size", "no_output", "extended_shapes"]


def halo_attrs(kernel_of, keep_global: bool = False):
    """``local_attrs`` for an op whose input 0 is x: attrs plus ``halo`` (per sharded spatial
    axis: (axis, mesh dim, :class:`~spmd_rules.conv.HaloPlan`)) and that axis' padding zeroed.
    ``kernel_of(attrs, in_metas)`` gives (kh, kw) (None for a resampling, attrs ``mode``);
    the output size comes from attrs (pooling, resampling), else from ``out_metas`` of the
    forward op or the dout input of a grad op. ``keep_global`` also passes the global
    ``global_hw`` and ``global_padding`` (average pooling's divisors and resampling's maps
    depend on them)."""
    def local(attrs: dict, in_metas, out_metas, coord) -> dict:
        x = in_metas[0]
        if coord is None:
            return attrs
        out_hw = pool2d_out_hw("halo", x.shape[2:], attrs) if "padding" not in attrs or \
            "kernel_size" in attrs else _conv_out_hw(in_metas, out_metas)
        kernel = kernel_of(attrs, in_metas)
        pads = list(attrs.get("padding", (0, 0, 0, 0)))
        halo = []
        for i in range(2):
            dims = x.dist_attr.dims_mapping[2 + i]
            if not dims or x.dist_attr.mesh_shape[dims[0]] == 1:  # whole on every rank
                continue
            m = dims[0]
            win = sweep(attrs, x.shape[2:], out_hw, kernel, i)
            halo.append((2 + i, m, halo_plan(win, x.dist_attr.mesh_shape[m], coord[m])))
            pads[2 * i] = pads[2 * i + 1] = 0
        if not halo:
            return attrs
        local = {**attrs, "halo": tuple(halo)}
        if "padding" in attrs:
            local["padding"] = tuple(pads)
        if keep_global:
            local["global_hw"] = tuple(x.shape[2:])
            if "padding" in attrs:
                local["global_padding"] = tuple(attrs["padding"])
        return local
    return local


def extended_shapes(shape: Sequence[int], halo: Sequence[Any]) -> tuple[tuple, list]:
    """The shape :func:`extend` gives a piece of ``shape``, and the shapes before each
    extension (what it returns besides the data), without exchanging anything."""
    shapes, shape = [], list(shape)
    for axis, _, plan in halo:
        shapes.append(tuple(shape))
        shape[axis] = plan.fill_before + plan.from_prev + plan.own[1] - plan.own[0] + \
            plan.from_next + plan.fill_after
    return tuple(shape), shapes


def no_output(halo: Sequence[Any]) -> bool:
    """Whether this rank's output piece is empty along a sharded spatial axis (it still takes
    part in the exchanges: its neighbours need its rows)."""
    return any(plan.out_rows == 0 for _, _, plan in halo)


def out_size(halo: Sequence[Any], axis: int, size: int) -> int:
    """The local output size along ``axis``: the halo plan's, else ``size``."""
    return next((plan.out_rows for a, _, plan in halo if a == axis), size)


def _conv_out_hw(in_metas, out_metas) -> Sequence[int]:
    if len(in_metas) == 3:  # conv2d_grad: (x, weight, dout)
        return in_metas[2].shape[2:]
    return out_metas[0].shape[2:]


def _take(x, axis: int, lo: int, hi: int):
    """The view of rows ``lo:hi`` of ``x`` along ``axis``."""
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(lo, hi)
    return x[tuple(idx)]


def _resized(shape: Sequence[int], axis: int, n: int) -> tuple[int, ...]:
    out = list(shape)
    out[axis] = n
    return tuple(out)


def _neighbours(group) -> tuple[int, int]:
    """(next, previous) group ranks on the ring."""
    return (group.rank + 1) % group.size, (group.rank - 1) % group.size


def extend(xp, x, halo: Sequence[Any], ctx, fill: float):
    """``(x_ext, shapes)``: x's piece extended, axis after axis, with its neighbours' rows and
    padding rows (``fill``) — exactly the input rows its output rows read — and the shape
    before each extension (for :func:`fold`)."""
    shapes = []
    for axis, mesh_dim, plan in halo:
        shapes.append(tuple(x.shape))
        group = group_along(ctx.mesh, mesh_dim)
        nxt, prev = _neighbours(group)
        from_prev = group.sendrecv(xp.ascontiguousarray(_take(x, axis, *plan.to_next)), nxt,
                                   prev, _resized(x.shape, axis, plan.from_prev))
        from_next = group.sendrecv(xp.ascontiguousarray(_take(x, axis, *plan.to_prev)), prev,
                                   nxt, _resized(x.shape, axis, plan.from_next))
        parts = [xp.full(_resized(x.shape, axis, plan.fill_before), fill, dtype=x.dtype),
                 from_prev, _take(x, axis, *plan.own), from_next,
                 xp.full(_resized(x.shape, axis, plan.fill_after), fill, dtype=x.dtype)]
        x = xp.concatenate(parts, axis=axis)
    return x, shapes


def fold(xp, dx, halo: Sequence[Any], ctx, piece_shapes: Sequence[tuple]):
    """The gradient of :func:`extend`: ``dx`` of the extended piece back to the piece of
    ``piece_shapes[k]`` (the shape before the k-th extension), the received rows' gradients
    sent back to their owners and added there, the padding rows' dropped."""
    for (axis, mesh_dim, plan), shape in zip(reversed(halo), reversed(piece_shapes)):
        group = group_along(ctx.mesh, mesh_dim)
        nxt, prev = _neighbours(group)
        prev_rows = (plan.fill_before, plan.fill_before + plan.from_prev)
        own = (prev_rows[1], prev_rows[1] + plan.own[1] - plan.own[0])
        next_rows = (own[1], own[1] + plan.from_next)
        got_next = group.sendrecv(xp.ascontiguousarray(_take(dx, axis, *prev_rows)), prev, nxt,
                                  _resized(shape, axis, plan.to_next[1] - plan.to_next[0]))
        got_prev = group.sendrecv(xp.ascontiguousarray(_take(dx, axis, *next_rows)), nxt, prev,
                                  _resized(shape, axis, plan.to_prev[1] - plan.to_prev[0]))
        out = xp.zeros(shape, dtype=dx.dtype)
        _take(out, axis, *plan.own)[...] += _take(dx, axis, *own)
        _take(out, axis, *plan.to_next)[...] += got_next
        _take(out, axis, *plan.to_prev)[...] += got_prev
        dx = out
    return dx
