"""Reshard execution: a :class:`spmd_rules.ReshardPlan` (planned from metadata in
:mod:`spmd_rules.redistribute`) prepared for this rank — each step a function of the local piece
with its group and sizes resolved — and run."""
from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable

import numpy as np

import collectives
from spmd_rules import (
    DistAttr,
    ProcessMesh,
    ReshardPlan,
    Step,
    local_ranges,
    local_shape,
    piece_length,
    split_range,
    strided_ranges,
)

from ..tensor import array_module
from .dist_tensor import empty_piece
from .mesh_groups import coord_of, get_rank, group_along, world

__all__ = ["PreparedStep", "prepare", "execute", "cut"]


def _extent(shape, attr: DistAttr, coord, d: int, without: int | None = None) -> int:
    """Local extent of tensor dim ``d`` under ``attr`` (optionally ignoring mesh dim
    ``without``)."""
    n = shape[d]
    for m in attr.dims_mapping[d]:
        if m != without:
            n = piece_length(n, attr.factor_of(m), attr.mesh_shape[m], coord[m])
    return n


def _sizes(total: int, parts: int, factor: int = 1) -> list[int]:
    """The piece lengths of every coordinate (numpy.array_split; per section when strided)."""
    return [piece_length(total, factor, parts, c) for c in range(parts)]


def _take(arr, axis: int, ranges) -> Any:
    """The ``[start, stop)`` ranges of ``arr`` along ``axis``, concatenated (a new array)."""
    idx = [slice(None)] * arr.ndim
    if len(ranges) == 1:
        idx[axis] = slice(*ranges[0])
        return arr[tuple(idx)].copy()
    parts = []
    for a, b in ranges:
        idx[axis] = slice(a, b)
        parts.append(arr[tuple(idx)])
    if not parts:
        idx[axis] = slice(0, 0)
        return arr[tuple(idx)].copy()
    return array_module(arr).concatenate(parts, axis=axis)


def cut(arr, shape, attr: DistAttr, coord) -> Any:
    """The piece of the global array ``arr`` held at ``coord`` under ``attr`` (strided shards
    included; a view where every dim's piece is one slice)."""
    ranges = local_ranges(shape, attr, coord)
    if all(len(r) <= 1 for r in ranges):
        return arr[tuple(slice(*r[0]) if r else slice(0, 0) for r in ranges)]
    for d, r in enumerate(ranges):
        if len(r) > 1 or r != ((0, shape[d]),):
            arr = _take(arr, d, r)
    return arr


def _unstride(axis: int, length: int, factor: int, parts: int) -> Callable:
    """The reorder after the all-gather of a strided shard: the gathered pieces (coordinate
    order, each its sections in order) become the sections in order."""
    held = [strided_ranges(length, factor, parts, c) for c in range(parts)]
    pos, where = 0, []
    for c in range(parts):
        for a, b in held[c]:
            where.append((a, pos, pos + b - a))
            pos += b - a
    order = tuple((p, q) for _, p, q in sorted(where))
    return lambda arr: _take(arr, axis, order)


#: the collective op that reduces a Partial of each reduce type (any/all: bool max/min)
_COLLECTIVE_OP = {"any": "max", "all": "min"}


def _prepare_step(step: Step, shape, mesh: ProcessMesh, coord, dtype: np.dtype) -> Callable:
    """``step`` as a function of this rank's piece, with its group, sizes and (for numpy
    pieces) the collective's arguments resolved."""
    k, m = step.kind, step.mesh_dim
    n = mesh.shape[m] if m is not None else 1
    d = step.tensor_dim
    if k in _RECEIVES_INTO:
        op = _COLLECTIVE_OP.get(step.reduce_type, step.reduce_type)
        if k == "all_reduce":
            args = {"op": op}
        elif k == "reduce_scatter":
            args = {"op": op, "axis": d}
        else:
            parent = _extent(shape, step.before, coord, d, without=m)
            sizes = _sizes(parent, n, step.split_factor)
            args = ({"axis": d, "sizes": sizes} if k == "all_gather" else
                    {"split_axis": step.split_dim, "concat_axis": d, "recv_sizes": sizes})
        group = group_along(mesh, m)
        if not isinstance(group, collectives.ProcessGroup):  # a mesh dim of size 1
            run = partial(getattr(group, k), **args)
        else:
            run = group.prepare(k, local_shape(shape, step.before, coord), dtype, **args)
        if step.split_factor > 1:  # a strided shard's all-gather: then the local reorder
            reorder = _unstride(d, parent, step.split_factor, n)
            return lambda arr: reorder(run(arr))
        return run
    if k == "swap":
        return _swap(step, shape, mesh, coord, dtype)
    if k == "slice":
        factor = step.split_factor
        return lambda arr: _take(arr, d, strided_ranges(arr.shape[d], factor, n, coord[m]))
    if k == "scale_partial":  # sum -> avg multiplies by n; avg -> sum divides
        return (lambda arr: arr * n) if step.reduce_type == "avg" else (lambda arr: arr / n)
    if k == "shard_to_partial":
        parent = _extent(shape, step.before, coord, d, without=m)
        a, b = split_range(parent, n, coord[m])

        def place(arr):
            out_shape = list(arr.shape)
            out_shape[d] = parent
            xp = array_module(arr)
            out = xp.full(out_shape, _identity(step.reduce_type, arr.dtype), dtype=arr.dtype)
            idx = [slice(None)] * arr.ndim
            idx[d] = slice(a, b)
            out[tuple(idx)] = arr * n if step.reduce_type == "avg" else arr
            return out
        return place
    if k == "to_partial":
        r = step.reduce_type
        if r in ("sum", "prod") and coord[m] != 0:
            fill = 1 if r == "prod" else 0
            return lambda arr: arr * 0 + fill if not isinstance(arr, np.ndarray) \
                else np.full_like(arr, fill)
        return lambda arr: arr.copy()
    raise AssertionError(k)


def _swap(step: Step, shape, mesh: ProcessMesh, coord, dtype: np.dtype) -> Callable:
    """One ``sendrecv`` with the rank whose coordinates along the two mesh dims are swapped,
    on the group of the two."""
    a, b = step.mesh_dim, step.split_dim
    other = list(coord)
    other[a], other[b] = coord[b], coord[a]
    if other == list(coord):
        # already holds its target piece; still a new array, as every collective step returns
        # one (a captured program's buffer plan reuses the input's block after the step)
        return lambda arr: arr.copy()
    peer, me = mesh.rank_at(other), get_rank()
    out_shape = local_shape(shape, step.after, coord)
    pair = collectives.new_group(sorted((me, peer)))
    return pair.prepare("sendrecv", local_shape(shape, step.before, coord), dtype,
                        dst=1 - pair.rank, recv_shape=out_shape)


def _identity(reduce_type: str, dtype):
    """The value that does not change a ``reduce_type`` reduction."""
    dt = np.dtype(dtype)
    if reduce_type in ("sum", "avg"):
        return 0
    if reduce_type == "prod":
        return 1
    if reduce_type in ("any", "all"):
        return reduce_type == "all"
    if dt.kind == "b":
        return reduce_type == "min"
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if reduce_type == "max" else info.max
    return -np.inf if reduce_type == "max" else np.inf


#: collectives whose prepared function takes ``out=`` (the sizes it needs are bound)
_RECEIVES_INTO = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})


class PreparedStep:
    """One step of a reshard plan prepared for this rank: ``fn(piece) -> piece``;
    ``accepts_out``: ``fn(piece, out=buffer)`` receives into a given buffer; ``grows``: the
    result piece may be larger than the input piece (an all-gather, a move across meshes),
    known from the plan alike on every rank."""

    __slots__ = ("kind", "fn", "label", "nbytes", "accepts_out", "grows")

    def __init__(self, kind: str, fn: Callable, label: str, nbytes: int,
                 accepts_out: bool = False, grows: bool = False):
        self.kind, self.fn, self.label, self.nbytes = kind, fn, label, nbytes
        self.accepts_out, self.grows = accepts_out, grows


def _prepared(step: Step, shape, mesh: ProcessMesh, coord, dtype) -> PreparedStep:
    kind = "collective" if step.is_collective else "local"
    return PreparedStep(kind, _prepare_step(step, shape, mesh, coord, dtype), step.describe(),
                        step.bytes_per_rank,
                        step.kind in _RECEIVES_INTO and step.split_factor == 1,
                        step.kind == "all_gather")


@lru_cache(maxsize=4096)
def prepare(plan: ReshardPlan, dtype: np.dtype) -> tuple[PreparedStep, ...]:
    """The steps of ``plan`` this rank runs, prepared (cached per plan and dtype). A rank
    outside the target mesh ends with an empty piece; one outside both meshes does nothing."""
    shape, src_mesh, dst_mesh = plan.shape, plan.src_mesh, plan.dst_mesh
    src_coord = coord_of(src_mesh)
    if src_mesh == dst_mesh:
        if src_coord is None:
            return ()
        return tuple(_prepared(s, shape, src_mesh, src_coord, dtype) for s in plan.steps)
    dst_coord = coord_of(dst_mesh)
    k = next(i for i, s in enumerate(plan.steps) if s.kind == "send_recv")
    out = []
    if src_coord is not None:
        out += [_prepared(s, shape, src_mesh, src_coord, dtype) for s in plan.steps[:k]]
    p2p = plan.steps[k]
    me = get_rank()

    def move(arr):
        recv = _cross_mesh_move(plan, p2p, arr, dtype, me, src_coord, dst_coord)
        if dst_coord is None:
            return empty_piece(shape, dtype, arr)
        return recv
    out.append(PreparedStep("collective", move, p2p.describe(), p2p.bytes_per_rank,
                            grows=True))
    if dst_coord is not None:
        out += [_prepared(s, shape, dst_mesh, dst_coord, dtype) for s in plan.steps[k + 1:]]
    return tuple(out)


def execute(plan: ReshardPlan, arr, dtype) -> Any:
    """This rank's piece after ``plan``: always a new array (an empty one on ranks outside the
    target mesh; ``arr`` itself on ranks outside both meshes)."""
    steps = prepare(plan, np.dtype(dtype))
    if not steps and coord_of(plan.src_mesh) is None:
        return arr
    out = arr
    for s in steps:
        out = s.fn(out)
    return out if out is not arr else arr.copy()


def _cross_mesh_move(plan: ReshardPlan, p2p: Step, arr, dtype, me, src_coord, dst_coord):
    """Each target rank gets its piece from one source rank (itself when it is one)."""
    w = world()
    src_ids = plan.src_mesh.process_ids
    direct = p2p.before == p2p.after  # same layout on disjoint meshes of one shape
    target = p2p.after
    received = None
    for j, r in enumerate(plan.dst_mesh.process_ids):
        rc = plan.dst_mesh.get_coord(r)
        if direct:
            s = plan.src_mesh.rank_at(rc)
        else:
            s = r if r in src_ids else src_ids[j % len(src_ids)]
        if me != s and me != r:
            continue
        if me == s:
            piece = arr if direct else cut(arr, plan.shape, target, rc)
            if s == r:
                received = piece.copy()
            else:
                w.send(np.ascontiguousarray(piece) if isinstance(piece, np.ndarray) else piece, r)
        if me == r and s != r:
            received = w.recv(local_shape(plan.shape, target, rc), dtype, s,
                              like=arr if not isinstance(arr, np.ndarray) else None)
    return received
