"""Halo exchange for spatially sharded convolution and max pooling.

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

from spmd_rules.conv import Window, halo_plan, pool2d_out_hw

from ..distributed.mesh_groups import group_along

__all__ = ["halo_attrs", "extend", "fold", "out_size", "no_output"]


def halo_attrs(kernel_of):
    """``local_attrs`` for an op whose input 0 is x: attrs plus ``halo`` (per sharded spatial
    axis: (axis, mesh dim, :class:`~spmd_rules.conv.HaloPlan`)) and that axis' padding zeroed.
    ``kernel_of(attrs, in_metas)`` gives (kh, kw); the output size comes from ``out_metas``
    of the forward op or the dout input of a grad op."""
    def local(attrs: dict, in_metas, out_metas, coord) -> dict:
        x = in_metas[0]
        if coord is None:
            return attrs
        out_hw = pool2d_out_hw("halo", x.shape[2:], attrs) if "kernel_size" in attrs else \
            _conv_out_hw(in_metas, out_metas)
        kernel = kernel_of(attrs, in_metas)
        pads = list(attrs["padding"])
        dil = attrs.get("dilation", (1, 1))
        halo = []
        for i in range(2):
            dims = x.dist_attr.dims_mapping[2 + i]
            if not dims or x.dist_attr.mesh_shape[dims[0]] == 1:  # whole on every rank
                continue
            m = dims[0]
            win = Window(x.shape[2 + i], out_hw[i], kernel[i], attrs["stride"][i], pads[2 * i],
                         dil[i])
            halo.append((2 + i, m, halo_plan(win, x.dist_attr.mesh_shape[m], coord[m])))
            pads[2 * i] = pads[2 * i + 1] = 0
        if not halo:
            return attrs
        return {**attrs, "padding": tuple(pads), "halo": tuple(halo)}
    return local


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


def _take(xp, x, axis: int, lo: int, hi: int):
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(lo, hi)
    return x[tuple(idx)]


def _shifts(group, xp, axis: int, plan, x, fill_shape):
    """The rows received from the previous and the next rank (two ring shifts)."""
    size, r = group.size, group.rank
    nxt, prev = (r + 1) % size, (r - 1) % size
    send = xp.ascontiguousarray(_take(xp, x, axis, *plan.to_next))
    from_prev = group.sendrecv(send, nxt, prev, fill_shape(plan.from_prev))
    send = xp.ascontiguousarray(_take(xp, x, axis, *plan.to_prev))
    from_next = group.sendrecv(send, prev, nxt, fill_shape(plan.from_next))
    return from_prev, from_next


def extend(xp, x, halo: Sequence[Any], ctx, fill: float):
    """``(x_ext, shapes)``: x's piece extended, axis after axis, with its neighbours' rows and
    padding rows (``fill``) — exactly the input rows its output rows read — and the shape
    before each extension (for :func:`fold`)."""
    shapes = []
    for axis, mesh_dim, plan in halo:
        def shape(rows, x=x, axis=axis):
            s = list(x.shape)
            s[axis] = rows
            return tuple(s)
        shapes.append(tuple(x.shape))
        group = group_along(ctx.mesh, mesh_dim)
        from_prev, from_next = _shifts(group, xp, axis, plan, x, shape)
        parts = [xp.full(shape(plan.fill_before), fill, dtype=x.dtype), from_prev,
                 _take(xp, x, axis, *plan.own), from_next,
                 xp.full(shape(plan.fill_after), fill, dtype=x.dtype)]
        x = xp.concatenate(parts, axis=axis)
    return x, shapes


def fold(xp, dx, halo: Sequence[Any], ctx, piece_shapes: Sequence[tuple]):
    """The gradient of :func:`extend`: ``dx`` of the extended piece back to the piece of
    ``piece_shapes[k]`` (the shape before the k-th extension), the received rows' gradients
    sent back to their owners and added there, the padding rows' dropped."""
    for (axis, mesh_dim, plan), shape in zip(reversed(halo), reversed(piece_shapes)):
        group = group_along(ctx.mesh, mesh_dim)
        size, r = group.size, group.rank
        nxt, prev = (r + 1) % size, (r - 1) % size
        prev_rows = (plan.fill_before, plan.fill_before + plan.from_prev)
        own = (prev_rows[1], prev_rows[1] + plan.own[1] - plan.own[0])
        next_rows = (own[1], own[1] + plan.from_next)

        def rows(n, shape=shape, axis=axis):
            s = list(shape)
            s[axis] = n
            return tuple(s)
        back_prev = xp.ascontiguousarray(_take(xp, dx, axis, *prev_rows))
        got_next = group.sendrecv(back_prev, prev, nxt,
                                  rows(plan.to_next[1] - plan.to_next[0]))
        back_next = xp.ascontiguousarray(_take(xp, dx, axis, *next_rows))
        got_prev = group.sendrecv(back_next, nxt, prev,
                                  rows(plan.to_prev[1] - plan.to_prev[0]))
        out = xp.zeros(shape, dtype=dx.dtype)
        _take(xp, out, axis, *plan.own)[...] += _take(xp, dx, axis, *own)
        _take(xp, out, axis, *plan.to_next)[...] += got_next
        _take(xp, out, axis, *plan.to_prev)[...] += got_prev
        dx = out
    return dx
