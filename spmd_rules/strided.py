"""Rules that use strided shards (``Shard(d, split_factor=k)``) instead of moving data.

Every other rule sees a strided input as the plain shard of the same mesh dims (see
:func:`~spmd_rules.base.register_rule`): it requires plain layouts, so the runtime reshards the
input first. The fronts here answer where a strided layout makes the op local:

- ``split``/``chunk`` into the k sections (numpy.array_split sizes) of a dim sharded by one
  mesh dim with split factor k: each output is that section as a plain ``Shard``;
- ``concat`` of k inputs of one layout sharded plainly by one mesh dim along the concat axis,
  whose sizes there are the array_split sizes of the total: the strided shard with factor k
  (split's backward);
- the view ops (reshape, flatten, squeeze, unsqueeze, transpose): a mesh dim alone on a source
  dim that a view merges behind leading dims (``[b, s, h]`` as ``S(1)`` -> ``[b*s, h]``) gives
  the strided shard whose factor is the product of the leading dims (times its own); a strided
  source dim that a view splits so that the factor is the product of the leading target dims
  gives a plain shard (``[b*s, h]`` strided by b -> ``[b, s, h]`` as ``S(1)``); a strided dim
  kept whole (a permutation, a size-1 dim added or removed) stays strided.

A piece is the same as the one the local kernel makes only where the sections split evenly
over the pieces it is cut into; the conditions below check exactly that, and everything else
takes the plain rule.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

from .base import Rule, SpmdResult, TensorMeta, prod, register_strided
from .dist_attr import DistAttr, split_range
from .redistribute import reshard_cost
from .reshape import Flatten, InputDim, Split, make_reshape_dim_trans

__all__ = ["split", "concat", "view", "labels"]


def _sections(size: int, k: int) -> tuple[int, ...]:
    """The numpy.array_split section sizes of ``size`` into ``k``."""
    return tuple(b - a for a, b in (split_range(size, k, s) for s in range(k)))


def _alone(attr: DistAttr, d: int) -> int | None:
    """The mesh dim sharding tensor dim ``d`` when it is the only one, else None."""
    dm = attr.dims_mapping[d]
    return dm[0] if len(dm) == 1 else None


@register_strided("split")
def split(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], plain: Rule
          ) -> SpmdResult:
    """Sections of a strided dim are plain shards of the sections: no communication."""
    res = plain(metas, attrs)
    x = metas[0]
    a = x.dist_attr
    axis = attrs.get("axis", 0)
    m = _alone(a, axis)
    sections = tuple(attrs["sections"])
    if m is None or len(sections) < 2 or a.factor_of(m) != len(sections) \
            or sections != _sections(x.shape[axis], len(sections)):
        return res
    out = a.with_split_factors((d, k) for d, k in a.split_factors if d != m)
    return SpmdResult((a,), tuple(TensorMeta(o.shape, out) for o in res.outputs))


@register_strided("concat")
def concat(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], plain: Rule
           ) -> SpmdResult:
    """k same-layout pieces sharded plainly along the axis join into a strided shard."""
    res = plain(metas, attrs)
    a = metas[0].dist_attr
    axis = attrs.get("axis", 0)
    m = _alone(a, axis)
    k = len(metas)
    if k < 2 or m is None or a.factor_of(m) != 1 or any(t.dist_attr != a for t in metas):
        return res
    (out,) = res.outputs
    if tuple(t.shape[axis] for t in metas) != _sections(out.shape[axis], k):
        return res
    return SpmdResult(tuple(a for _ in metas),
                      (TensorMeta(out.shape, a.with_split_factors({**dict(a.split_factors),
                                                                   m: k})),))


def _destination(trans: Sequence, src: tuple[int, ...], i: int, k: int, parts: int
                 ) -> tuple[int, int] | None:
    """(target dim, split factor) that a mesh dim of ``parts`` coordinates alone on source dim
    ``i`` with split factor ``k`` takes through the view ``trans``, or None when its pieces
    are not the view of a sharded target dim's pieces."""
    for j, t in enumerate(trans):
        if t == InputDim(i):
            return j, k
        if isinstance(t, Flatten) and InputDim(i) in t.inputs:
            dims = [u.dim for u in t.inputs]
            p = dims.index(i)
            lead, rest = prod([src[d] for d in dims[:p]]), prod([src[d] for d in dims[p + 1:]])
            if src[i] % k or (rest != 1 and (src[i] // k) % parts):
                return None
            return j, lead * k
        if isinstance(t, Split) and t.input == InputDim(i):
            p = next((q for q in range(len(t.shape) + 1) if prod(t.shape[:q]) >= k), None)
            if p is None or p == len(t.shape) or prod(t.shape[:p]) != k or t.index != p:
                continue
            if prod(t.shape[p + 1:]) != 1 and t.shape[p] % parts:
                return None
            return j, 1
    return None


def _kept(x: TensorMeta, attrs: Mapping[str, Any], plain: Rule, trans: Sequence,
          res: SpmdResult) -> TensorMeta | None:
    """The view's output when x keeps its layout (strided shards carried, see the module doc),
    or None when some mesh dim would have to move."""
    a = x.dist_attr
    moves: dict[int, tuple[int, tuple[int, ...], dict[int, int]]] = {}  # i -> j, dims, factors
    for i, dm in enumerate(a.dims_mapping):
        m = _alone(a, i)
        if m is not None and (a.factor_of(m) > 1 or res.inputs[0].dims_mapping[i] != (m,)):
            dest = _destination(trans, x.shape, i, a.factor_of(m), a.mesh_shape[m])
            if dest is not None:
                moves[i] = (dest[0], (m,), {m: dest[1]})
        elif a.is_strided(i) and InputDim(i) in trans:  # a co-sharded dim kept whole
            moves[i] = (trans.index(InputDim(i)), dm, {m: a.factor_of(m) for m in dm})
    targets = [j for j, _, _ in moves.values()]
    if not moves or len(set(targets)) != len(targets):
        return None
    moved = {m for _, dm, _ in moves.values() for m in dm}
    rest = DistAttr(a.mesh_shape, tuple(() if i in moves else dm
                                        for i, dm in enumerate(a.dims_mapping)), a.partial,
                    tuple((m, k) for m, k in a.split_factors if m not in moved))
    res2 = plain((TensorMeta(x.shape, rest),), attrs)
    o = res2.outputs[0].dist_attr
    if res2.inputs[0] != rest or any(o.dims_mapping[j] for j in targets):
        return None
    dims = list(o.dims_mapping)
    factors = dict(o.split_factors)
    for j, dm, fs in moves.values():
        dims[j] = dm
        factors.update(fs)
    return TensorMeta(res2.outputs[0].shape, DistAttr(o.mesh_shape, tuple(dims), o.partial,
                                                      tuple(factors.items())))


def view(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], plain: Rule
         ) -> SpmdResult:
    """The view ops' front (see the module doc): x's layout, or x's layout with some of its
    sharding mesh dims gathered, when the view then keeps it (strided shards carried to
    their target dims), and that moves fewer bytes than the plain rule's answer."""
    res = plain(metas, attrs)
    x = metas[0]
    a = x.dist_attr
    if (not a.split_factors and res.inputs[0] == a) or not prod(x.shape):
        return res
    if attrs.get("perm") is not None:
        trans = [InputDim(p) for p in attrs["perm"]]
    else:
        trans = make_reshape_dim_trans(x.shape, res.outputs[0].shape)
    src = a.without_partial()
    best, cost = res, reshard_cost(x.shape, 1, src, res.inputs[0].without_partial())
    sharding = [m for dm in a.dims_mapping for m in dm]
    for r in range(len(sharding)):
        for dropped in combinations(sharding, r):
            cand = DistAttr(a.mesh_shape, tuple(tuple(m for m in dm if m not in dropped)
                                                for dm in a.dims_mapping), a.partial,
                            tuple((m, k) for m, k in a.split_factors if m not in dropped))
            c = reshard_cost(x.shape, 1, src, cand.without_partial())
            if c < cost or (c == cost == 0 and best is res):
                out = _kept(TensorMeta(x.shape, cand), attrs, plain, trans,
                            plain((TensorMeta(x.shape, cand),), attrs))
                if out is not None:
                    best, cost = SpmdResult((cand,), (out,)), c
    return best


for _name in ("reshape", "flatten", "squeeze", "unsqueeze", "transpose"):
    register_strided(_name)(view)


#: ops of the label rules whose kernels read their global position (dropout's mask, the
#: diagonal of tril/triu, an empty piece of max/min, argmax's index): the plain rule only
_POSITIONAL = frozenset({"dropout", "tril", "triu", "max", "min", "argmax", "argmin"})


def labels(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any], plain: Rule
           ) -> SpmdResult:
    """The front of the rules that give each mesh dim one label (elementwise, matmul, sum,
    softmax, layer_norm): the plain rule's answer, with each strided mesh dim kept strided
    wherever it shards a dim of that size (the same label: the same index subsets), when
    every strided input keeps it where it is and all agree on its factor."""
    res = plain(metas, attrs)
    if attrs.get("op") in _POSITIONAL or not any(t is not None and t.dist_attr.split_factors
                                                 for t in metas):
        return res
    strided: dict[int, tuple[int, int]] = {}  # mesh dim -> (factor, size of the dims it splits)
    for t, req in zip(metas, res.inputs):
        if t is None:
            continue
        for m, k in t.dist_attr.split_factors:
            d = next(d for d, dm in enumerate(t.dist_attr.dims_mapping) if m in dm)
            if strided.setdefault(m, (k, t.shape[d])) != (k, t.shape[d]) \
                    or t.dist_attr.dims_mapping[d] != (m,) or req.dims_mapping[d] != (m,):
                return res

    def restride(shape, attr: DistAttr) -> DistAttr | None:
        factors = dict(attr.split_factors)
        for d, dm in enumerate(attr.dims_mapping):
            for m in dm:
                if m in strided:
                    k, size = strided[m]
                    if dm != (m,) or shape[d] != size:
                        return None
                    factors[m] = k
        return attr.with_split_factors(factors)

    inputs = [None if t is None else restride(t.shape, req) for t, req in zip(metas, res.inputs)]
    outputs = [restride(o.shape, o.dist_attr) for o in res.outputs]
    if any(a is None for t, a in zip(metas, inputs) if t is not None) or None in outputs:
        return res
    return SpmdResult(tuple(inputs), tuple(TensorMeta(o.shape, a)
                                           for o, a in zip(res.outputs, outputs)))


for _name in ("elementwise", "matmul", "reduction", "softmax", "layer_norm"):
    register_strided(_name)(labels)
