"""Einsum-notation helpers shared by the rules.

A *notation* gives one label per tensor dim. Equal labels across tensors denote the same logical
axis; ``None`` marks a dim that takes part in no merge and must be replicated (a broadcast size-1
dim, a normalized axis, a tiled axis...). Labels are any hashable values (letters or ints).

1. :func:`merge_shardings` merges the shardings of equal labels across the inputs: the first
   input (in order) that shards a label decides it; a mesh dim may shard only one label, so later
   uses of an already-claimed mesh dim are dropped.
2. :func:`layout` gives a tensor's DistAttr from its notation and the merged map; inputs get
   this as their required layout, outputs as their produced layout.
3. :func:`contracted_partial` lists the mesh dims that shard labels absent from an output: the
   output is Partial on them (the local op only saw part of the contracted/reduced axis).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from .dist_attr import DistAttr
from .placement import LINEAR_REDUCE_TYPES, ReduceType

__all__ = ["Notation", "merge_shardings", "layout", "contracted_partial", "broadcast_notations",
           "linear_partial"]

Notation = Sequence["Hashable | None"]


def merge_shardings(notations: Sequence[Notation | None], attrs: Sequence[DistAttr | None],
                    exclude: Iterable[int] = ()) -> dict[Hashable, tuple[int, ...]]:
    """Label -> mesh dims sharding it (split order). Mesh dims in ``exclude`` are never used
    (e.g. mesh dims on which a kept Partial lives)."""
    merged: dict[Hashable, tuple[int, ...]] = {}
    used = set(exclude)
    for notation, attr in zip(notations, attrs):
        if notation is None or attr is None:
            continue
        for label, dm in zip(notation, attr.dims_mapping):
            if label is None or label in merged or not dm:
                continue
            keep = tuple(m for m in dm if m not in used)
            if keep:
                merged[label] = keep
                used.update(keep)
    return merged


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
