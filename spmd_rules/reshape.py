"""reshape and every view-like op expressed in the same dim-trans algebra (squeeze, unsqueeze,
flatten, transpose, expand, tile: one rule function, as PyTorch's ``_view_ops``).

:func:`make_reshape_dim_trans` pairs source and target dims into groups of equal product
(size-1 dims are left out of the groups: a size-1 target dim is a :class:`Singleton`, a size-1
source dim is dropped) and writes each target dim as

- ``InputDim(i)``: the target dim is source dim i;
- ``Flatten(InputDim(i), InputDim(j), ...)``: several source dims merged into one;
- ``Split(inner, shape, index)``: piece ``index`` of ``inner`` (an InputDim or a Flatten)
  viewed as ``shape`` (row-major);
- ``Singleton()``: a new size-1 dim;
- ``Broadcast(size)``: a dim not taken from the source (expand's new or expanded dims);
- ``Repeat(InputDim(i), times)``: source dim i tiled ``times`` times (tile);
- a permutation (transpose) is the InputDims in permuted order.

Which shardings survive (the rest are required Replicate before the local reshape):

- on an ``InputDim``: all of its mesh dims (uneven included);
- on a ``Flatten``: those of its leftmost source dim, as the longest prefix (in split order)
  of its mesh dims whose product divides that dim's size;
- on ``Split(..., index=0)``: those surviving on ``inner``, shortened to the longest prefix
  whose product also divides ``shape[0]``; other pieces get none;
- on ``Repeat`` with ``times == 1``: as on its InputDim; on ``Broadcast``/``Singleton``: none.

When the surviving shardings differ from the input's layout, the rule also tries every placement
of the input's mesh dims that the dim trans keeps as it is and takes the cheapest reshard
(an all-to-all instead of an all-gather).

These conditions make every rank's local piece a contiguous block of the flattened group that
is exactly its block of the output, so ``local.reshape(local_shape(out_shape, out_attr,
coord))`` is the output's local piece. A tensor with no elements is replicated.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import (
    SpmdResult,
    TensorMeta,
    check_axis,
    mesh_shape_of,
    op_name,
    prod,
    register_rule,
    require,
)
from .dist_attr import DistAttr
from .einsum import assignments
from .redistribute import reshard_cost

__all__ = ["Broadcast", "Repeat", "DimTrans", "InputDim", "Singleton", "Flatten", "Split",
           "make_reshape_dim_trans",
           "infer_dim_trans", "reshape", "squeeze", "unsqueeze", "flatten", "transpose", "tile",
           "expand"]


class DimTrans:
    """How one target dim is formed from source dims."""


@dataclass(frozen=True)
class InputDim(DimTrans):
    dim: int


@dataclass(frozen=True)
class Singleton(DimTrans):
    pass


@dataclass(frozen=True, init=False)
class Flatten(DimTrans):
    inputs: tuple[InputDim, ...]

    def __init__(self, *inputs: InputDim) -> None:
        object.__setattr__(self, "inputs", tuple(inputs))

    def __repr__(self) -> str:
        return f"Flatten({', '.join(map(repr, self.inputs))})"


@dataclass(frozen=True)
class Broadcast(DimTrans):
    size: int


@dataclass(frozen=True)
class Repeat(DimTrans):
    input: InputDim
    times: int


@dataclass(frozen=True)
class Split(DimTrans):
    input: InputDim | Flatten
    shape: tuple[int, ...]
    index: int


def make_reshape_dim_trans(src_shape: Sequence[int], tgt_shape: Sequence[int]) -> list[DimTrans]:
    """One DimTrans per target dim (products of the shapes must be equal)."""
    src, tgt = tuple(src_shape), tuple(tgt_shape)
    if prod(src) != prod(tgt):
        raise ValueError(f"cannot reshape {src} to {tgt}: sizes {prod(src)} and {prod(tgt)} differ")

    def group_input(dims: list[int]) -> InputDim | Flatten:
        return InputDim(dims[0]) if len(dims) == 1 else Flatten(*(InputDim(d) for d in dims))

    out: list[DimTrans] = [Singleton() for _ in tgt]
    if prod(src) == 0:
        whole = group_input(list(range(len(src))))
        for j in range(len(tgt)):
            out[j] = whole if len(tgt) == 1 else Split(whole, tgt, j)
        return out
    src_nz = [i for i, s in enumerate(src) if s != 1]
    tgt_nz = [j for j, t in enumerate(tgt) if t != 1]
    i = j = 0
    while i < len(src_nz):
        s_dims, t_dims = [src_nz[i]], [tgt_nz[j]]
        s, t = src[src_nz[i]], tgt[tgt_nz[j]]
        i, j = i + 1, j + 1
        while s != t:
            if s < t:
                s *= src[src_nz[i]]
                s_dims.append(src_nz[i])
                i += 1
            else:
                t *= tgt[tgt_nz[j]]
                t_dims.append(tgt_nz[j])
                j += 1
        inner = group_input(s_dims)
        if len(t_dims) == 1:
            out[t_dims[0]] = inner
        else:
            shape = tuple(tgt[d] for d in t_dims)
            for k, d in enumerate(t_dims):
                out[d] = Split(inner, shape, k)
    _pair_unit_dims(src, tgt, out)
    return out


def _pair_unit_dims(src: tuple[int, ...], tgt: tuple[int, ...], out: list[DimTrans]) -> None:
    """Size-1 target dims take a size-1 source dim of the same gap between the grouped dims
    (in order), so a sharding on a size-1 dim (one piece holds it, the others are empty)
    survives the reshape; the rest stay Singleton."""
    def gaps(shape: tuple[int, ...], is_group_start) -> list[list[int]]:
        res: list[list[int]] = [[]]
        for d, n in enumerate(shape):
            if n == 1:
                res[-1].append(d)
            elif is_group_start(d):
                res.append([])
        return res

    src_starts = {t.dim if isinstance(t, InputDim) else
                  (t.inputs[0].dim if isinstance(t, Flatten) else None)
                  for t in out if not isinstance(t, (Singleton, Split))}
    src_starts |= {(t.input.dim if isinstance(t.input, InputDim) else t.input.inputs[0].dim)
                   for t in out if isinstance(t, Split) and t.index == 0}
    tgt_starts = {j for j, t in enumerate(out)
                  if not isinstance(t, Singleton) and not (isinstance(t, Split) and t.index)}
    for s_gap, t_gap in zip(gaps(src, src_starts.__contains__), gaps(tgt, tgt_starts.__contains__)):
        for i, j in zip(s_gap, t_gap):
            out[j] = InputDim(i)


def _divisible_prefix(dims: tuple[int, ...], size: int,
                      mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Longest prefix of ``dims`` whose mesh sizes multiply to a divisor of ``size``."""
    count = 1
    for k, m in enumerate(dims):
        count *= mesh_shape[m]
        if size % count:
            return dims[:k]
    return dims


def _surviving(trans: DimTrans, src: Sequence[int],
               attr: DistAttr) -> tuple[int | None, tuple[int, ...]]:
    """(source dim, mesh dims) whose sharding survives into a target dim (None: no sharding)."""
    if isinstance(trans, InputDim):
        return trans.dim, attr.dims_mapping[trans.dim]
    if isinstance(trans, Flatten):
        d = trans.inputs[0].dim
        return d, _divisible_prefix(attr.dims_mapping[d], src[d], attr.mesh_shape)
    if isinstance(trans, Split) and trans.index == 0:
        d, dims = _surviving(trans.input, src, attr)
        return d, _divisible_prefix(dims, trans.shape[0], attr.mesh_shape)
    if isinstance(trans, Repeat) and trans.times == 1:
        return _surviving(trans.input, src, attr)
    return None, ()


def infer_dim_trans(src_shape: Sequence[int], attr: DistAttr, trans: Sequence[DimTrans]
                    ) -> tuple[DistAttr, DistAttr]:
    """(required input layout, output layout) for a reshape described by ``trans``.
    Partial is kept on both (reshape moves elements, it commutes with any reduction)."""
    src = tuple(src_shape)
    in_map: list[tuple[int, ...]] = [() for _ in src]
    out_map: list[tuple[int, ...]] = []
    for t in trans:
        d, dims = _surviving(t, src, attr) if prod(src) or isinstance(t, (InputDim, Repeat)) \
            else (None, ())
        if d is not None and dims:
            in_map[d] = dims
        out_map.append(dims)
    return attr.with_dims_mapping(in_map), attr.with_dims_mapping(out_map)


def _reshape_result(x: TensorMeta, target: tuple[int, ...]) -> SpmdResult:
    return _view_result(x, make_reshape_dim_trans(x.shape, target), target)


def _view_result(x: TensorMeta, trans: Sequence[DimTrans], target: tuple[int, ...]
                 ) -> SpmdResult:
    """The dim-trans answer, or when that moves data, the cheapest layout the dim trans keeps
    as it is (x's sharding mesh dims placed on other dims: an all-to-all instead of an
    all-gather, e.g. [2, 3, 2] as S(1) -> [12] moves mesh dim 0 onto dim 0)."""
    required, out = infer_dim_trans(x.shape, x.dist_attr, trans)
    plain = x.dist_attr.without_partial()
    cost = reshard_cost(x.shape, 1, plain, required.without_partial())
    if cost:
        mesh_dims = [m for dm in plain.dims_mapping for m in dm]  # x's split order first
        for placed in assignments(mesh_dims, [[None, *range(x.ndim)]] * len(mesh_dims)):
            cand = x.dist_attr.with_dims_mapping([placed.get(d, ()) for d in range(x.ndim)])
            c = reshard_cost(x.shape, 1, plain, cand.without_partial())
            if c < cost:
                req, o = infer_dim_trans(x.shape, cand, trans)
                if req == cand:
                    cost, required, out = c, req, o
    return SpmdResult((required,), (TensorMeta(target, out),))


def _check_one(op: str, metas: Sequence[TensorMeta | None]) -> TensorMeta:
    require(metas, op, 1)
    mesh_shape_of(op, metas)
    return metas[0]


@register_rule("reshape")
def reshape(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs shape (global target, concrete non-negative ints). See the module doc.
    The runtime's local target shape is ``local_shape(shape, out_attr, coord)``."""
    op = op_name(attrs, "reshape")
    x = _check_one(op, metas)
    target = attrs.get("shape")
    if target is None or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                             for s in target):
        raise ValueError(f"{op}: shape must be a tuple of non-negative ints, got {target!r}")
    target = tuple(target)
    if prod(target) != prod(x.shape):
        raise ValueError(f"{op}: cannot reshape x of shape {x.shape} ({prod(x.shape)} elements) "
                         f"to {target} ({prod(target)} elements)")
    return _reshape_result(x, target)


def _axes(op: str, attrs: Mapping[str, Any], ndim: int) -> tuple[int, ...]:
    axis = attrs.get("axis")
    axes = () if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        check_axis(op, "axis", a, ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: duplicate axes in axis={axes}")
    return axes


@register_rule("squeeze")
def squeeze(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs axis (tuple; empty/None = every size-1 axis). Paddle semantics: listed
    axes whose size is not 1 are kept. Removed axes are required Replicate; Partial kept."""
    op = op_name(attrs, "squeeze")
    x = _check_one(op, metas)
    axes = _axes(op, attrs, x.ndim) or tuple(range(x.ndim))
    target = tuple(s for d, s in enumerate(x.shape) if not (d in axes and s == 1))
    return _reshape_result(x, target)


@register_rule("unsqueeze")
def unsqueeze(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs axis (positions of the new size-1 axes in the output). New axes are
    replicated, the others keep their sharding; Partial kept."""
    op = op_name(attrs, "unsqueeze")
    x = _check_one(op, metas)
    axis = attrs.get("axis")
    count = 0 if axis is None else 1 if isinstance(axis, int) else len(tuple(axis))
    axes = _axes(op, attrs, x.ndim + count)
    rest = iter(x.shape)
    target = tuple(1 if d in axes else next(rest) for d in range(x.ndim + len(axes)))
    return _reshape_result(x, target)


@register_rule("flatten")
def flatten(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs start_axis, stop_axis (inclusive, non-negative); a 0-d x gives shape (1,).
    Axes start..stop become one (a Flatten dim trans); Partial kept."""
    op = op_name(attrs, "flatten")
    x = _check_one(op, metas)
    if x.ndim == 0:
        return _reshape_result(x, (1,))
    start = check_axis(op, "start_axis", attrs.get("start_axis", 0), x.ndim)
    stop = check_axis(op, "stop_axis", attrs.get("stop_axis", x.ndim - 1), x.ndim)
    if start > stop:
        raise ValueError(f"{op}: start_axis={start} > stop_axis={stop} for x of shape {x.shape}")
    target = x.shape[:start] + (prod(x.shape[start:stop + 1]),) + x.shape[stop + 1:]
    return _reshape_result(x, target)


@register_rule("transpose")
def transpose(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs perm (a permutation of range(ndim)). Output dim i is ``InputDim(perm[i])``
    with its sharding; nothing is resharded; Partial kept."""
    op = op_name(attrs, "transpose")
    x = _check_one(op, metas)
    perm = tuple(attrs.get("perm", ()))
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"{op}: perm={perm} is not a permutation of the {x.ndim} dims of x "
                         f"{x.shape}")
    return _view_result(x, [InputDim(p) for p in perm], tuple(x.shape[p] for p in perm))


def _int_tuple(op: str, name: str, value: Any) -> tuple[int, ...]:
    if value is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ValueError(f"{op}: {name} must be a tuple of non-negative ints, got {value!r}")
    return tuple(value)


@register_rule("tile")
def tile(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs repeat_times (numpy.tile: shorter reps are padded with leading 1s,
    longer ones add leading axes: ``Broadcast``). Each x dim is ``Repeat(InputDim(d), times)``:
    only ``times == 1`` keeps its sharding; Partial kept."""
    op = op_name(attrs, "tile")
    x = _check_one(op, metas)
    reps = _int_tuple(op, "repeat_times", attrs.get("repeat_times"))
    ndim = max(x.ndim, len(reps))
    reps = (1,) * (ndim - len(reps)) + reps
    lead = ndim - x.ndim
    out_shape = tuple(((1,) * lead + x.shape)[d] * reps[d] for d in range(ndim))
    trans = [Broadcast(out_shape[d]) for d in range(lead)] + \
        [Repeat(InputDim(d), reps[lead + d]) for d in range(x.ndim)]
    return _view_result(x, trans, out_shape)


@register_rule("expand")
def expand(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs shape (global target, numpy broadcast_to rules). New leading dims and
    expanded size-1 dims are ``Broadcast`` (replicated), the others ``InputDim`` (keep their
    sharding); Partial kept."""
    op = op_name(attrs, "expand")
    x = _check_one(op, metas)
    shape = _int_tuple(op, "shape", attrs.get("shape"))
    lead = len(shape) - x.ndim
    if lead < 0 or any(s != t and s != 1 for s, t in zip(x.shape, shape[lead:])):
        raise ValueError(f"{op}: cannot expand x of shape {x.shape} to {shape}")
    trans = [Broadcast(t) for t in shape[:lead]] + \
        [InputDim(d) if s == t else Broadcast(t) for d,
         (s, t) in enumerate(zip(x.shape, shape[lead:]))]
    return _view_result(x, trans, shape)
