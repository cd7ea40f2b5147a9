"""Shape ops. Views (output shares the input's buffer and version counter): transpose, basic
slicing, split/chunk, detach, and reshape (with flatten, squeeze, unsqueeze) whenever the strides
allow — decided before the kernel runs, as numpy does; otherwise reshape copies. Copies: expand,
tile, concat, stack. Inplace: ``__setitem__`` (``set_value``), ``zero_``, ``fill_``, ``copy_``."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from spmd_rules import local_shape

from ..dispatch import apply, apply_inplace
from ..schema import OPS, equal_dtypes, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, normalize_axes, normalize_axis, reduce_sum, sum_to_shape
from .creation import zeros

_VIEW = ((0, 0),)
_SAME = same_dtype(0)


def reshape_is_view(shape: tuple[int, ...], strides: tuple[int, ...], attrs: dict) -> bool:
    """Whether ``reshape`` of an array of ``shape``/``strides`` to ``attrs["shape"]`` can be a
    view (numpy's no-copy reshape rule, C order): every group of old dims merged or split into
    new dims must be contiguous within itself."""
    new = attrs["shape"]
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n in shape) or not old:
        return True
    new_dims = [n for n in new if n != 1]
    oi = ni = 0
    while oi < len(old) and ni < len(new_dims):
        oj, nj = oi + 1, ni + 1
        op, np_ = old[oi][0], new_dims[ni]
        while op != np_:
            if np_ < op:
                np_ *= new_dims[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the old group must be contiguous
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return False
        oi, ni = oj, nj
    return True


def _local_out_shape(attrs, in_metas, out_metas, coord):
    """reshape / expand: the target shape becomes this rank's output piece shape."""
    meta = out_metas[0]
    return {**attrs, "shape": local_shape(meta.shape, meta.dist_attr, coord)}

# -- reshape family ------------------------------------------------------------------------------


def _reshape_bwd(node, g):
    return reshape_to(g, node.in_shapes[0])


def _reshape_kernel(xp, x, shape, out=None):
    """``x.reshape(shape)``; with ``out=`` (a reshape that copies, planned in an arena) the
    elements are copied straight into ``out``, without a temporary."""
    if out is None:
        return x.reshape(shape)
    xp.copyto(out.reshape(x.shape), x)
    return out


register("reshape", _reshape_kernel, backward=_reshape_bwd, rule="reshape", view=_VIEW,
         view_if=reshape_is_view, dtype=_SAME, no_need_buffer=(0,), local_attrs=_local_out_shape,
         accepts_out=True)
register("transpose", lambda xp, x, perm: xp.transpose(x, perm),
         backward=lambda node, g: transpose(g, list(np.argsort(node.attrs["perm"]))),
         rule="transpose", view=_VIEW, dtype=_SAME, no_need_buffer=(0,))


def _target_shape(op: str, shape: Any, x_shape: Sequence[int]) -> tuple[int, ...]:
    """Resolve Paddle's reshape conventions: 0 copies the input dim, one -1 is inferred."""
    if isinstance(shape, Tensor):
        shape = shape.tolist()
    if isinstance(shape, (int, np.integer)):
        shape = [shape]
    shape = [int(s.item()) if isinstance(s, Tensor) else int(s) for s in shape]
    total = math.prod(x_shape)
    out = []
    for i, s in enumerate(shape):
        if s == 0:
            if i >= len(x_shape):
                raise ValueError(f"{op}: shape[{i}] = 0 copies input dim {i}, but x has shape "
                                 f"{list(x_shape)}")
            s = x_shape[i]
        elif s < -1:
            raise ValueError(f"{op}: shape {shape} has a negative entry {s}")
        out.append(s)
    if -1 in out:
        if out.count(-1) > 1:
            raise ValueError(f"{op}: shape {shape} has more than one -1")
        known = -math.prod(out)
        if known == 0 or total % known:
            raise ValueError(f"{op}: cannot reshape x of shape {list(x_shape)} ({total} elements) "
                             f"to {shape}")
        out[out.index(-1)] = total // known
    elif math.prod(out) != total:
        raise ValueError(f"{op}: cannot reshape x of shape {list(x_shape)} ({total} elements) to "
                         f"{shape} ({math.prod(out)} elements)")
    return tuple(out)


@public(methods=True)
def reshape(x: Tensor, shape: Sequence[int], name: str | None = None) -> Tensor:
    """A view of ``x`` with the given shape (0 keeps the input dim, one -1 is inferred); a copy
    only when the layout does not allow a view."""
    x = as_tensor(x)
    return apply(OPS["reshape"], (x,), {"shape": _target_shape("reshape", shape, x.shape)})


def reshape_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """A view of ``x`` with exactly ``shape`` (no 0 / -1 conventions, so shapes holding size-0
    dims are taken literally); used by the other shape ops and by backward functions."""
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) != x.size or any(s < 0 for s in shape):
        raise ValueError(f"reshape: cannot reshape x of shape {x.shape} ({x.size} elements) to "
                         f"{list(shape)}")
    return apply(OPS["reshape"], (x,), {"shape": shape})


@public(methods=True)
def flatten(x: Tensor, start_axis: int = 0, stop_axis: int = -1, name: str | None = None) -> Tensor:
    """Merge axes start_axis..stop_axis into one (a view)."""
    x = as_tensor(x)
    if x.ndim == 0:
        return reshape_to(x, [1])
    s = normalize_axis("flatten", start_axis, x.ndim, "start_axis")
    e = normalize_axis("flatten", stop_axis, x.ndim, "stop_axis")
    if s > e:
        raise ValueError(f"flatten: start_axis {start_axis} is after stop_axis {stop_axis} for "
                         f"shape {x.shape}")
    shp = x.shape
    return reshape_to(x, shp[:s] + [int(np.prod(shp[s:e + 1], dtype=np.int64))] + shp[e + 1:])


@public(methods=True)
def squeeze(x: Tensor, axis: Any = None, name: str | None = None) -> Tensor:
    """Remove size-1 axes (all of them, or those in ``axis`` that have size 1) — a view."""
    x = as_tensor(x)
    axes = normalize_axes("squeeze", axis, x.ndim) if axis is not None else None
    shape = [n for i, n in enumerate(x.shape) if not (n == 1 and (axes is None or i in axes))]
    return reshape_to(x, shape)


@public(methods=True)
def unsqueeze(x: Tensor, axis: Any, name: str | None = None) -> Tensor:
    """Insert size-1 axes at the positions ``axis`` of the output — a view."""
    x = as_tensor(x)
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    shape = list(x.shape)
    for a in axes:
        a = normalize_axis("unsqueeze", a, len(shape) + 1)
        shape.insert(a, 1)
    return reshape_to(x, shape)


@public(methods=True)
def transpose(x: Tensor, perm: Sequence[int], name: str | None = None) -> Tensor:
    """Permute the axes (a view)."""
    x = as_tensor(x)
    if isinstance(perm, Tensor):
        perm = perm.tolist()
    if not isinstance(perm, (list, tuple)):
        raise TypeError(f"transpose: argument 'perm' must be a list of ints (a permutation of "
                        f"the {x.ndim} axes of shape {x.shape}), got {type(perm).__name__} "
                        f"{perm!r}")
    perm = [normalize_axis("transpose", p, x.ndim, "perm") for p in perm]
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: argument 'perm' {perm} is not a permutation of the "
                         f"{x.ndim} axes of shape {x.shape}")
    return apply(OPS["transpose"], (x,), {"perm": tuple(perm)})


# -- slicing -------------------------------------------------------------------------------------

def normalize_index(op: str, index: Any, shape: Sequence[int]) -> tuple:
    """Basic index -> a tuple of int / concrete slice / None covering every input axis."""
    if not isinstance(index, tuple):
        index = (index,)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError(f"{op}: an index can have only one Ellipsis")
    if n_real > len(shape):
        raise IndexError(f"{op}: too many indices ({n_real}) for a tensor of shape {list(shape)}")
    out: list = []
    axis = 0
    for item in index:
        if item is Ellipsis:
            for _ in range(len(shape) - n_real):
                out.append(slice(0, shape[axis], 1))
                axis += 1
        elif item is None:
            out.append(None)
        elif isinstance(item, slice):
            start, stop, step = item.indices(shape[axis])
            if step <= 0:
                raise IndexError(f"{op}: slice step must be positive, got {item.step}")
            out.append(slice(start, max(start, stop), step))
            axis += 1
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            n = shape[axis]
            if not -n <= item < n:
                raise IndexError(f"{op}: index {item} is out of bounds for axis {axis} with size "
                                 f"{n}")
            out.append(int(item) % n)
            axis += 1
        else:
            raise TypeError(f"{op}: only basic indexing (ints, slices, None, ...) is supported, "
                            f"got {type(item).__name__}")
    while axis < len(shape):
        out.append(slice(0, shape[axis], 1))
        axis += 1
    return tuple(out)


def _localize_index(index: tuple, attr) -> tuple:
    """A slice index over a sharded piece: sharded axes (full-range by the rule) take it all."""
    out, axis = [], 0
    for item in index:
        if item is None:
            out.append(None)
            continue
        out.append(slice(None) if attr.dims_mapping[axis] else item)
        axis += 1
    return tuple(out)


def _slice_local(attrs, in_metas, out_metas, coord):
    return {"index": _localize_index(attrs["index"], in_metas[0].dist_attr)}


def _slice_grad_local(attrs, in_metas, out_metas, coord):
    meta = out_metas[0]
    return {"index": _localize_index(attrs["index"], meta.dist_attr),
            "input_shape": local_shape(meta.shape, meta.dist_attr, coord)}


def _slice_grad_kernel(xp, g, index, input_shape):
    out = xp.zeros(input_shape, dtype=g.dtype)
    out[index] = g
    return out


register("slice", lambda xp, x, index: x[index],
         backward=lambda node, g: apply(OPS["slice_grad"], (g,), {
             "index": node.attrs["index"], "input_shape": tuple(node.in_shapes[0])}),
         rule="slice", view=_VIEW, dtype=_SAME, no_need_buffer=(0,), local_attrs=_slice_local)
register("slice_grad", _slice_grad_kernel, rule="slice_grad", dtype=_SAME,
         local_attrs=_slice_grad_local)


def getitem(x: Tensor, index: Any) -> Tensor:
    """Basic slicing ``x[index]`` (a view)."""
    return apply(OPS["slice"], (x,), {"index": normalize_index("slice", index, x.shape)})


def _set_value_kernel(xp, x, v, index, out=None):
    """x with ``x[index] = v`` (into ``out`` when given: the inplace variant writes x itself)."""
    if out is None:
        out = x.copy()
    elif out is not x:
        out[...] = x
    out[index] = v
    return out


def _set_value_bwd(node, g):
    index = node.attrs["index"]
    gx = apply(OPS["set_value"], (g, zeros_scalar(g)), {"index": index}) \
        if node.needs_grad(0) else None
    gv = sum_to_shape(getitem_normalized(g, index), node.in_shapes[1]) \
        if node.needs_grad(1) else None
    return gx, gv


register("set_value", _set_value_kernel, backward=_set_value_bwd, rule="set_value",
         inplace=_VIEW, accepts_out=True, dtype=_SAME, local_attrs=_slice_local)


def zeros_scalar(like: Tensor) -> Tensor:
    return as_tensor(0.0, like)


def getitem_normalized(x: Tensor, index: tuple) -> Tensor:
    return apply(OPS["slice"], (x,), {"index": index})


def setitem(x: Tensor, index: Any, value: Any) -> Tensor:
    """``x[index] = value`` inplace (value broadcast to the indexed region)."""
    index = normalize_index("__setitem__", index, x.shape)
    value = as_tensor(value, x)
    region = np.empty(x.shape, dtype=np.bool_)[index].shape
    try:
        np.broadcast_shapes(tuple(value.shape), region)
    except ValueError:
        raise ValueError(f"__setitem__: value of shape {value.shape} cannot be broadcast to the "
                         f"indexed region of shape {list(region)}") from None
    apply_inplace(OPS["set_value"], (x, value), {"index": index})
    return x


@public(methods=True)
def zero_(x: Tensor, name: str | None = None) -> Tensor:
    """Set every element of ``x`` to 0 inplace (NaN/inf included) and return x."""
    return setitem(x, Ellipsis, 0)


@public(methods=True)
def fill_(x: Tensor, value: Any, name: str | None = None) -> Tensor:
    """Set every element of ``x`` to ``value`` inplace and return x."""
    return setitem(x, Ellipsis, value)


@public(methods=True)
def copy_(x: Tensor, src: Any, blocking: bool = True) -> Tensor:
    """Copy ``src`` (broadcast to x's shape) into ``x`` inplace and return x."""
    return setitem(x, Ellipsis, src)


# -- split / concat / stack ------------------------------------------------------------------

def _split_kernel(xp, x, sections, axis):
    bounds = np.cumsum(sections)[:-1]
    return tuple(xp.split(x, bounds, axis=axis))


def _split_bwd(node, *gs):
    axis = node.attrs["axis"]
    shape = list(node.in_shapes[0])
    dtype = next(g for g in gs if g is not None).dtype
    parts = []
    for g, n in zip(gs, node.attrs["sections"]):
        if g is None:  # an unused piece: a dense zero block (joins a dist concat as Replicate)
            g = zeros(shape[:axis] + [n] + shape[axis + 1:], dtype=dtype)
        parts.append(g)
    return concat(parts, axis)


def _local_sections(attrs, in_metas, out_metas, coord):
    """split: each section's local size (a strided split axis holds a piece of every one)."""
    axis = attrs["axis"]
    return {**attrs, "sections": tuple(local_shape(o.shape, o.dist_attr, coord)[axis]
                                       for o in out_metas)}


register("split", _split_kernel, backward=_split_bwd, rule="split", n_out=-1, view=((0, -1),),
         dtype=_SAME, no_need_buffer=(0,), local_attrs=_local_sections)


@public(methods=True)
def split(x: Tensor, num_or_sections: Any, axis: int = 0, name: str | None = None) -> list[Tensor]:
    """Split along ``axis`` into equal parts (an int) or parts of the given sizes (one may be
    -1); the outputs are views."""
    x = as_tensor(x)
    axis = normalize_axis("split", axis, x.ndim)
    n = x.shape[axis]
    if isinstance(num_or_sections, (int, np.integer)):
        k = int(num_or_sections)
        if k <= 0 or n % k:
            raise ValueError(f"split: axis {axis} of shape {x.shape} (size {n}) cannot be split "
                             f"into {k} equal parts")
        sections = [n // k] * k
    else:
        sections = [int(s) for s in num_or_sections]
        if sections.count(-1) > 1:
            raise ValueError(f"split: sections {sections} has more than one -1")
        if -1 in sections:
            sections[sections.index(-1)] = n - (sum(sections) + 1)
        if any(s < 0 for s in sections) or sum(sections) != n:
            raise ValueError(f"split: sections {list(num_or_sections)} do not add up to the size "
                             f"{n} of axis {axis} of shape {x.shape}")
    outs = apply(OPS["split"], (x,), {"sections": tuple(sections), "axis": axis})
    return list(outs)


@public(methods=True)
def chunk(x: Tensor, chunks: int, axis: int = 0, name: str | None = None) -> list[Tensor]:
    """Split into ``chunks`` equal parts along ``axis``."""
    return split(x, chunks, axis)


def _concat_bwd(node, g):
    axis = node.attrs["axis"]
    sections = [s[axis] for s in node.in_shapes]
    return tuple(split(g, sections, axis))


register("concat", lambda xp, *xs, axis: xp.concatenate(xs, axis=axis), backward=_concat_bwd,
         rule="concat", no_need_buffer=(0,), dtype=equal_dtypes)


def _check_same(op: str, xs: Sequence[Tensor], skip_axis: int | None) -> None:
    ref = xs[0].shape
    for i, t in enumerate(xs):
        s = t.shape
        if len(s) != len(ref) or any(a != b for j, (a, b) in enumerate(zip(s, ref))
                                     if j != skip_axis):
            raise ValueError(f"{op}: input {i} has shape {s}, incompatible with input 0 shape "
                             f"{ref}" + (f" outside axis {skip_axis}" if skip_axis is not None
                                         else ""))


@public()
def concat(x: Sequence[Tensor], axis: int = 0, name: str | None = None) -> Tensor:
    """Join tensors along an existing axis."""
    xs = [as_tensor(t) for t in x]
    if not xs:
        raise ValueError("concat: x is an empty list")
    axis = normalize_axis("concat", axis, xs[0].ndim)
    _check_same("concat", xs, axis)
    return apply(OPS["concat"], tuple(xs), {"axis": axis})


def _stack_bwd(node, g):
    axis = node.attrs["axis"]
    return tuple(squeeze(p, [axis]) for p in split(g, len(node.in_shapes), axis))


register("stack", lambda xp, *xs, axis: xp.stack(xs, axis=axis), backward=_stack_bwd,
         rule="stack", no_need_buffer=(0,), dtype=equal_dtypes)


@public()
def stack(x: Sequence[Tensor], axis: int = 0, name: str | None = None) -> Tensor:
    """Join same-shaped tensors along a new axis."""
    xs = [as_tensor(t) for t in x]
    if not xs:
        raise ValueError("stack: x is an empty list")
    axis = normalize_axis("stack", axis, xs[0].ndim + 1)
    _check_same("stack", xs, None)
    return apply(OPS["stack"], tuple(xs), {"axis": axis})


# -- expand / tile / detach ------------------------------------------------------------------

register("expand", lambda xp, x, shape: xp.array(xp.broadcast_to(x, shape)),
         backward=lambda node, g: sum_to_shape(g, node.in_shapes[0]), rule="expand",
         dtype=_SAME, no_need_buffer=(0,), local_attrs=_local_out_shape)


@public(methods=True)
def expand(x: Tensor, shape: Sequence[int], name: str | None = None) -> Tensor:
    """Broadcast ``x`` to ``shape`` (-1 keeps a dim) as a new tensor."""
    x = as_tensor(x)
    shape = [int(s) for s in shape]
    lead = len(shape) - x.ndim
    if lead < 0:
        raise ValueError(f"expand: shape {shape} has fewer dims than x {x.shape}")
    shape = [x.shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(shape)]
    if any(s < 0 for s in shape):
        raise ValueError(f"expand: shape {shape} has a negative size (-1 only keeps an existing "
                         f"dim of x {x.shape})")
    for i, n in enumerate(x.shape):
        if n != 1 and n != shape[lead + i]:
            raise ValueError(f"expand: x of shape {x.shape} cannot be broadcast to {shape}")
    return apply(OPS["expand"], (x,), {"shape": tuple(shape)})


@public(methods=True)
def broadcast_to(x: Tensor, shape: Sequence[int], name: str | None = None) -> Tensor:
    return expand(x, shape)


def _tile_bwd(node, g):
    (shape,) = node.in_shapes
    reps = node.attrs["repeat_times"]
    shape = [1] * (len(reps) - len(shape)) + list(shape)
    reps = [1] * (len(shape) - len(reps)) + list(reps)
    inter = []
    for r, n in zip(reps, shape):
        inter += [r, n]
    gs = reduce_sum(reshape_to(g, inter), range(0, len(inter), 2))
    return reshape_to(gs, node.in_shapes[0])


register("tile", lambda xp, x, repeat_times: xp.tile(x, repeat_times), backward=_tile_bwd,
         rule="tile", dtype=_SAME, no_need_buffer=(0,))


@public(methods=True)
def tile(x: Tensor, repeat_times: Sequence[int], name: str | None = None) -> Tensor:
    """Repeat ``x`` ``repeat_times[i]`` times along each axis (numpy.tile)."""
    x = as_tensor(x)
    reps = tuple(int(r) for r in repeat_times)
    if any(r < 0 for r in reps):
        raise ValueError(f"tile: repeat_times {list(reps)} has a negative entry")
    return apply(OPS["tile"], (x,), {"repeat_times": reps})


register("detach", lambda xp, x: x.view(), rule="elementwise", view=_VIEW, dtype=_SAME,
         rule_attrs={"linear": "unary"})


@public(methods=True)
def detach(x: Tensor) -> Tensor:
    """A view of ``x`` cut from the graph (stop_gradient=True, shares the buffer)."""
    return apply(OPS["detach"], (x,), {})
