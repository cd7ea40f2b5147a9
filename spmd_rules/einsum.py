"""Einsum-notation helpers shared by the rules.

A *notation* gives one label per tensor dim. Equal labels across tensors denote the same logical
axis; ``None`` marks a dim that takes part in no merge and must be replicated (a broadcast size-1
dim, a normalized axis, a tiled axis...). Labels are any hashable values (letters or ints).

1. :func:`merge_shardings` merges the shardings of equal labels across the inputs; a mesh dim
   may shard only one label. Given the inputs' shapes it picks the map whose reshards move the
   fewest bytes (cost-based, as PyTorch's sharding propagation), else the first input that
   shards a label decides it.
2. :func:`layout` gives a tensor's DistAttr from its notation and the merged map; inputs get
   this as their required layout, outputs as their produced layout.
3. :func:`contracted_partial` lists the mesh dims that shard labels absent from an output: the
   output is Partial on them (the local op only saw part of the contracted/reduced axis).
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence

from .dist_attr import DistAttr
from .placement import LINEAR_REDUCE_TYPES, ReduceType
from .redistribute import reshard_cost

__all__ = ["Notation", "merge_shardings", "layout", "contracted_partial", "broadcast_notations",
           "linear_partial", "keep_cheapest", "assignments"]

Notation = Sequence["Hashable | None"]


def merge_shardings(notations: Sequence[Notation | None], attrs: Sequence[DistAttr | None],
                    exclude: Iterable[int] = (),
                    shapes: Sequence[Sequence[int] | None] | None = None,
                    partials: Sequence[Iterable[tuple[int, ReduceType]]] | None = None,
                    free_labels: Iterable[Hashable] = ()) -> dict[Hashable, tuple[int, ...]]:
    """Label -> mesh dims sharding it (in split order). Mesh dims in ``exclude`` are never used
    (e.g. mesh dims on which a kept Partial lives).

    Without ``shapes``: the first input that shards a label decides it. With the inputs' global
    ``shapes``: the first-wins map when it moves nothing, else the map whose reshards move the
    fewest bytes (:func:`~spmd_rules.redistribute.reshard_cost`):

    1. every assignment of the mesh dims the inputs shard to the labels (or to none), in every
       split order: a mesh dim on a dim that cannot stay sharded moves to another dim by an
       all-to-all when that beats the all-gather (layer_norm of ``[S(0), S(1)]`` normalized
       from dim 1 co-shards dim 0);
    2. then each free mesh dim (no input uses it) innermost on each of ``free_labels`` (labels
       every output keeps), where that moves no more bytes: slicing is free, so ``[S(0),R] +
       [S(1),R]`` co-shards dim 0 over both mesh dims for the all-to-all it needs anyway. On a
       contracted label a free mesh dim would make the output Partial, a cost this input-side
       model does not see, hence the opt-in.

    Ties go to the map that shards more, then to the first-wins map, then to the first
    candidate (the inputs' own order). Mesh dims of a Partial input being resolved are not
    added. ``partials[i]``: the partial input i keeps (the rest of its Partial is resolved), so
    the cost counts the right steps (a Shard becoming a kept Partial is free)."""
    order = [i for i, (n, a) in enumerate(zip(notations, attrs)) if n is not None and a is not None]
    excluded = frozenset(exclude)
    first = _first_wins(notations, attrs, excluded, order)
    if shapes is None:
        return first
    kept = [()] * len(attrs) if partials is None else [tuple(p) for p in partials]
    first_cost = _cost(first, notations, attrs, shapes, order, kept)
    if not first_cost:  # nothing moves
        return first
    labels = list(dict.fromkeys(lab for i in order for lab in notations[i] if lab is not None))
    # the inputs' mesh dims in the order they split (so the first candidate keeps an input's
    # co-shard order); resolved Partials' mesh dims are never added
    sharded = [m for i in order for dm in attrs[i].dims_mapping for m in dm]
    used = set(sharded) | {m for i in order for m in attrs[i].partial_dims()}
    mesh_dims = [m for m in dict.fromkeys(sharded) if m not in excluded]
    best_key, best = (first_cost, -_n_used(first), 0), first
    for merged in assignments(mesh_dims, [[None] + labels] * len(mesh_dims)):
        key = (_cost(merged, notations, attrs, shapes, order, kept), -_n_used(merged), 1)
        if key < best_key:
            best_key, best = key, merged
    # then each free mesh dim, innermost on the free label where it moves no more bytes
    free_ok = [lab for lab in labels if lab in frozenset(free_labels)]
    for m in range(len(attrs[order[0]].mesh_shape)):
        if m in used or m in excluded:
            continue
        base = best
        for lab in free_ok:
            merged = {**base, lab: base.get(lab, ()) + (m,)}
            key = (_cost(merged, notations, attrs, shapes, order, kept), -_n_used(merged), 1)
            if key < best_key:
                best_key, best = key, merged
    return best


def assignments(mesh_dims: Sequence[int], options: Sequence[Sequence["Hashable | None"]]
                ) -> Iterator[dict[Hashable, tuple[int, ...]]]:
    """Every map label -> mesh dims (in split order) that gives ``mesh_dims[k]`` to one of
    ``options[k]`` (None: to no label), in every split order of the mesh dims one label gets
    (the order ``mesh_dims`` lists them first)."""
    for choice in itertools.product(*options):
        groups: dict[Hashable, list[int]] = {}
        for m, lab in zip(mesh_dims, choice):
            if lab is not None:
                groups.setdefault(lab, []).append(m)
        for orders in itertools.product(*(itertools.permutations(g) for g in groups.values())):
            yield dict(zip(groups, orders))


def _first_wins(notations, attrs, excluded, order) -> dict[Hashable, tuple[int, ...]]:
    merged: dict[Hashable, tuple[int, ...]] = {}
    used = set(excluded)
    for i in order:
        for label, dm in zip(notations[i], attrs[i].dims_mapping):
            if label is None or label in merged or not dm:
                continue
            keep = tuple(m for m in dm if m not in used)
            if keep:
                merged[label] = keep
                used.update(keep)
    return merged


def _n_used(merged) -> int:
    return sum(len(dm) for dm in merged.values())


def _cost(merged, notations, attrs, shapes, order, kept) -> int:
    """Elements the present inputs' reshards to ``merged`` (keeping ``kept`` partials)
    receive."""
    total = 0
    for i in order:
        a = attrs[i]
        want = layout(notations[i], merged, a.mesh_shape, kept[i])
        total += reshard_cost(tuple(shapes[i]), 1, a, want)
    return total


def keep_cheapest(meta, shardable: Sequence[bool]) -> DistAttr:
    """The layout of a one-input op whose dims may stay sharded only where ``shardable``: the
    input's layout with the other dims' mesh dims dropped or moved to a shardable dim, whichever
    moves fewer bytes; the input's Partial mesh dims are kept as they are."""
    a = meta.dist_attr
    notation = [d if ok else None for d, ok in enumerate(shardable)]
    merged = merge_shardings([notation], [a], a.partial_dims(), [meta.shape], [a.partial])
    return layout(notation, merged, a.mesh_shape, a.partial)


def layout(notation: Notation, merged: dict[Hashable, tuple[int, ...]], mesh_shape: Sequence[int],
           partial: Iterable[tuple[int, ReduceType]] = ()) -> DistAttr:
    """DistAttr of a tensor with this notation under the merged map."""
    dims = tuple(() if label is None else merged.get(label, ()) for label in notation)
    return DistAttr(tuple(mesh_shape), dims, tuple(partial))


def contracted_partial(merged: dict[Hashable, tuple[int, ...]], out_notation: Notation,
                       reduce_type: ReduceType = ReduceType.SUM) -> list[tuple[int, ReduceType]]:
    """(mesh dim, reduce_type) for every mesh dim sharding a label that ``out_notation`` lacks."""
    present = set(out_notation)
    return [(m, reduce_type) for label, dm in merged.items() if label not in present for m in dm]


def broadcast_notations(op: str, shapes: Sequence[Sequence[int]], names: Sequence[str],
                        first_label: int = 0) -> tuple[tuple[int, ...], list[list[int | None]]]:
    """Numpy broadcasting of ``shapes``: the broadcast shape and each input's notation (output axis
    i has label ``first_label + i``; an input's size-1 dim broadcast to a larger size gets None)."""
    ndim = max((len(s) for s in shapes), default=0)
    out: list[int] = []
    for i in range(ndim):
        sizes = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0}
        non_one = sizes - {1}
        if len(non_one) > 1:
            desc = ", ".join(f"{n}={tuple(s)}" for n, s in zip(names, shapes))
            raise ValueError(f"{op}: shapes cannot be broadcast together: {desc}")
        out.append(non_one.pop() if non_one else 1)
    notations = []
    for s in shapes:
        lead = ndim - len(s)
        notations.append([None if size == 1 and out[lead + j] != 1 else first_label + lead + j
                          for j, size in enumerate(s)])
    return tuple(out), notations


def linear_partial(attr: DistAttr) -> bool:
    """True when ``attr`` is Partial and every pending reduction is linear (sum/avg)."""
    return attr.is_partial() and all(r in LINEAR_REDUCE_TYPES for _, r in attr.partial)
