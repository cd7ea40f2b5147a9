"""Ops along whole lines of an axis (rule ``along_axes``: the axis is gathered when sharded, the
other axes keep their shards): sort, argsort, topk, cumsum, flip, roll, repeat_interleave, and
unbind (rule ``unbind``). Sorting is stable: equal elements keep their order (descending too).
cumsum, flip, roll and repeat_interleave are linear, so a Partial input stays Partial."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dispatch import apply
from ..schema import OPS, fixed_dtype, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, normalize_axes, normalize_axis
from .creation import zeros
from .elementwise import cast
from .embedding import scatter_add
from .scatter import take_along_axis_grad
from .shape import reshape_to, stack


def _order(xp, x, axis: int, descending: bool):
    """Stable argsort along ``axis``; descending keeps equal elements in their order too."""
    kw = {"kind": "stable"} if xp is np else {}
    if not descending:
        return xp.argsort(x, axis=axis, **kw)
    idx = xp.flip(xp.argsort(xp.flip(x, axis), axis=axis, **kw), axis)
    return (x.shape[axis] - 1) - idx


def _sort_kernel(xp, x, axis, descending):
    idx = _order(xp, x, axis, descending)
    return xp.take_along_axis(x, idx, axis), idx.astype(np.int64)


def _topk_kernel(xp, x, k, axis, largest, sorted):
    idx = xp.take(_order(xp, x, axis, largest), xp.arange(k), axis=axis)
    return xp.take_along_axis(x, idx, axis), idx.astype(np.int64)


def _picked_bwd(node, g, _=None):
    """Gradient of (values, indices) = f(x): g scattered back to where each value came from."""
    return take_along_axis_grad(node.saved_tensor(0), g, node.attrs["axis"], node.in_shapes[0])


_PICK = dict(backward=_picked_bwd, rule="along_axes", n_out=2, save_outputs=(1,),
             nondiff_outputs=frozenset({1}), no_need_buffer=(0,),
             dtype=lambda dtypes, attrs: (np.dtype(dtypes[0]), np.dtype(np.int64)))
register("sort", _sort_kernel, rule_attrs={"num_outputs": 2}, **_PICK)
register("topk", _topk_kernel, rule_attrs=lambda a: {"num_outputs": 2, "out_size": a["k"]},
         **_PICK)
register("argsort", lambda xp, x, axis, descending: _order(xp, x, axis, descending).astype(
    np.int64), rule="along_axes", dtype=fixed_dtype(np.int64))


def _axis_of(op: str, x: Tensor, axis: int) -> int:
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have at least 1 dim, got shape {x.shape}")
    return normalize_axis(op, axis, x.ndim)


@public(methods=True)
def sort(x: Tensor, axis: int = -1, descending: bool = False, stable: bool = False,
         name: str | None = None) -> Tensor:
    """x sorted along ``axis`` (ascending unless ``descending``; always stable).
    Example: ``dt.sort(x, axis=0)``."""
    x = as_tensor(x)
    axis = _axis_of("sort", x, axis)
    return apply(OPS["sort"], (x,), {"axis": axis, "descending": bool(descending)})[0]


@public(methods=True)
def argsort(x: Tensor, axis: int = -1, descending: bool = False, stable: bool = False,
            name: str | None = None) -> Tensor:
    """int64 indices that sort x along ``axis`` (always stable)."""
    x = as_tensor(x)
    axis = _axis_of("argsort", x, axis)
    return apply(OPS["argsort"], (x,), {"axis": axis, "descending": bool(descending)})


@public(methods=True)
def topk(x: Tensor, k: int, axis: int = -1, largest: bool = True, sorted: bool = True,
         name: str | None = None) -> tuple[Tensor, Tensor]:
    """(values, int64 indices) of the ``k`` largest (or smallest) entries along ``axis``, in
    order (also when ``sorted`` is False); ties keep the lower index first.
    Example: ``v, i = dt.topk(logits[:, -1, :], k=5)``."""
    x = as_tensor(x)
    axis = _axis_of("topk", x, axis)
    if isinstance(k, Tensor):
        k = int(k.item())
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= x.shape[axis]:
        raise ValueError(f"topk: k={k!r} must be an int in [0, {x.shape[axis]}] (x shape "
                         f"{x.shape}, axis {axis})")
    values, indices = apply(OPS["topk"], (x,), {"k": int(k), "axis": axis,
                                                "largest": bool(largest), "sorted": True})
    return values, indices


# -- linear ops along axes --------------------------------------------------------------------

def _cumsum_kernel(xp, x, axis, reverse):
    if reverse:
        return xp.flip(xp.flip(x, axis).cumsum(axis=axis, dtype=x.dtype), axis).copy()
    return x.cumsum(axis=axis, dtype=x.dtype)


_LINEAR = dict(rule="along_axes", dtype=same_dtype(0), no_need_buffer=(0,))
register("cumsum", _cumsum_kernel, backward=lambda node, g: apply(
    OPS["cumsum"], (g,), {**node.attrs, "reverse": not node.attrs["reverse"]}),
         rule_attrs={"linear": True}, **_LINEAR)
register("flip", lambda xp, x, axes: xp.flip(x, axes).copy(),
         backward=lambda node, g: apply(OPS["flip"], (g,), node.attrs),
         rule_attrs={"linear": True}, **_LINEAR)
register("roll", lambda xp, x, shifts, axes: xp.roll(x, shifts, axes),
         backward=lambda node, g: apply(OPS["roll"], (g,), {
             "shifts": tuple(-s for s in node.attrs["shifts"]), "axes": node.attrs["axes"]}),
         rule_attrs={"linear": True}, **_LINEAR)


def _flat(x: Tensor) -> Tensor:
    return reshape_to(x, [x.size])


@public(methods=True)
def cumsum(x: Tensor, axis: int | None = None, dtype: Any = None,
           name: str | None = None) -> Tensor:
    """Running sums along ``axis`` (None: over the flattened x). ``dtype`` casts x first;
    integer and bool inputs sum in int64 when no dtype is given, as in Paddle."""
    x = as_tensor(x)
    if dtype is not None:
        x = cast(x, dtype)
    elif np.dtype(x.dtype).kind in "bui" and np.dtype(x.dtype) != np.int64:
        x = cast(x, np.int64)
    if axis is None or x.ndim == 0:
        x, axis = _flat(x), 0
    axis = normalize_axis("cumsum", axis, x.ndim)
    return apply(OPS["cumsum"], (x,), {"axis": axis, "reverse": False})


@public(methods=True)
def flip(x: Tensor, axis: int | Sequence[int], name: str | None = None) -> Tensor:
    """x with the order of elements reversed along each axis in ``axis``."""
    x = as_tensor(x)
    return apply(OPS["flip"], (x,), {"axes": normalize_axes("flip", axis, x.ndim)})


@public(methods=True)
def roll(x: Tensor, shifts: int | Sequence[int], axis: int | Sequence[int] | None = None,
         name: str | None = None) -> Tensor:
    """Elements shifted cyclically by ``shifts`` along ``axis`` (None: over the flattened x,
    shape restored). Example: ``dt.roll(x, 1, axis=0)``."""
    x = as_tensor(x)
    shifts = [int(shifts)] if isinstance(shifts, (int, np.integer)) else [int(s) for s in shifts]
    if axis is None:
        if len(shifts) != 1:
            raise ValueError(f"roll: shifts {shifts} needs axis (x shape {x.shape})")
        flat = apply(OPS["roll"], (_flat(x),), {"shifts": tuple(shifts), "axes": (0,)})
        return reshape_to(flat, x.shape)
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    if len(axes) != len(shifts):
        raise ValueError(f"roll: shifts {shifts} and axis {axes} differ in length")
    axes = [normalize_axis("roll", a, x.ndim) for a in axes]
    return apply(OPS["roll"], (x,), {"shifts": tuple(shifts), "axes": tuple(axes)})


# -- repeat_interleave -----------------------------------------------------------------------

def _repeat_grad_kernel(xp, g, repeats, axis):
    shape = list(g.shape)
    shape[axis] = len(repeats)
    dx = xp.zeros(shape, dtype=g.dtype)
    src = xp.repeat(xp.arange(len(repeats)), xp.asarray(repeats))
    scatter_add(xp, xp.moveaxis(dx, axis, 0), src, xp.moveaxis(g, axis, 0))
    return dx


register("repeat_interleave_grad", _repeat_grad_kernel, rule="along_axes",
         rule_attrs=lambda a: {"linear": True, "out_size": len(a["repeats"])}, dtype=same_dtype(0))
register("repeat_interleave", lambda xp, x, repeats, axis: xp.repeat(x, list(repeats), axis),
         backward=lambda node, g: apply(OPS["repeat_interleave_grad"], (g,), node.attrs),
         rule_attrs=lambda a: {"linear": True, "out_size": sum(a["repeats"])}, **_LINEAR)


@public(methods=True)
def repeat_interleave(x: Tensor, repeats: int | Sequence[int] | Tensor, axis: int | None = None,
                      name: str | None = None) -> Tensor:
    """Each element repeated ``repeats`` times along ``axis`` (None: over the flattened x);
    ``repeats`` is an int or one count per element of the axis.
    Example: ``dt.repeat_interleave(kv, 4, axis=2)`` repeats each key head 4 times."""
    x = as_tensor(x)
    if axis is None:
        x, axis = _flat(x), 0
    axis = _axis_of("repeat_interleave", x, axis)
    n = x.shape[axis]
    if isinstance(repeats, Tensor):
        repeats = repeats.tolist()
    reps = [repeats] * n if isinstance(repeats, (int, np.integer)) else list(repeats)
    if len(reps) != n or any(isinstance(r, bool) or not isinstance(r, (int, np.integer))
                             or r < 0 for r in reps):
        raise ValueError(f"repeat_interleave: repeats must be a non-negative int or {n} of them "
                         f"(x shape {x.shape}, axis {axis}), got {repeats!r}")
    return apply(OPS["repeat_interleave"], (x,), {"repeats": tuple(int(r) for r in reps),
                                                  "axis": axis})


# -- unbind ------------------------------------------------------------------------------------

def _unbind_bwd(node, *gs):
    axis = node.attrs["axis"]
    shape = list(node.in_shapes[0])
    del shape[axis]
    dtype = next(g for g in gs if g is not None).dtype
    return stack([zeros(shape, dtype=dtype) if g is None else g for g in gs], axis)


register("unbind", lambda xp, x, axis: tuple(x[(slice(None),) * axis + (i,)]
                                             for i in range(x.shape[axis])),
         backward=_unbind_bwd, rule="unbind", n_out=-1, view=((0, -1),), dtype=same_dtype(0),
         no_need_buffer=(0,))


@public(methods=True)
def unbind(input: Tensor, axis: int = 0) -> list[Tensor]:
    """The slices of ``input`` along ``axis`` as a list of views (the axis removed).
    Example: ``q, k, v = dt.unbind(qkv, axis=2)``."""
    x = as_tensor(input)
    axis = _axis_of("unbind", x, axis)
    if x.shape[axis] == 0:
        return []
    return list(apply(OPS["unbind"], (x,), {"axis": axis}))
