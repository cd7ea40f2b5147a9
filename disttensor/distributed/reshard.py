"""Reshard execution: run a :class:`spmd_rules.ReshardPlan` (planned from metadata in
:mod:`spmd_rules.redistribute`) on this rank's piece, with the collectives of the mesh groups."""
from __future__ import annotations

from typing import Any

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, ReshardPlan, Step, local_slices, split_range

from .mesh_groups import coord_of, get_rank, group_along, world

# -- execution ---------------------------------------------------------------------------------

def _extent(shape, attr: DistAttr, coord, d: int, without: int | None = None) -> int:
    """Local extent of tensor dim ``d`` under ``attr`` (optionally ignoring mesh dim ``without``)."""
    start, stop = 0, shape[d]
    for m in attr.dims_mapping[d]:
        if m == without:
            continue
        a, b = split_range(stop - start, attr.mesh_shape[m], coord[m])
        start, stop = start + a, start + b
    return stop - start


def _sizes(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _run_step(step: Step, arr, shape, mesh: ProcessMesh, coord):
    k, m = step.kind, step.mesh_dim
    if k == "all_reduce":
        return group_along(mesh, m).all_reduce(arr, step.reduce_type)
    n = mesh.shape[m] if m is not None else 1
    if k == "all_gather":
        parent = _extent(shape, step.before, coord, step.tensor_dim, without=m)
        return group_along(mesh, m).all_gather(arr, axis=step.tensor_dim, sizes=_sizes(parent, n))
    if k == "reduce_scatter":
        return group_along(mesh, m).reduce_scatter(arr, step.reduce_type, axis=step.tensor_dim)
    if k == "all_to_all":
        parent = _extent(shape, step.before, coord, step.tensor_dim, without=m)
        return group_along(mesh, m).all_to_all(arr, step.split_dim, step.tensor_dim,
                                               recv_sizes=_sizes(parent, n))
    if k == "slice":
        a, b = split_range(arr.shape[step.tensor_dim], n, coord[m])
        idx = [slice(None)] * arr.ndim
        idx[step.tensor_dim] = slice(a, b)
        return arr[tuple(idx)].copy()
    if k == "scale_partial":  # sum -> avg multiplies by n; avg -> sum divides
        return arr * n if step.reduce_type == "avg" else arr / n
    if k == "shard_to_partial":
        d = step.tensor_dim
        parent = _extent(shape, step.before, coord, d, without=m)
        a, b = split_range(parent, n, coord[m])
        out_shape = list(arr.shape)
        out_shape[d] = parent
        xp = np if isinstance(arr, np.ndarray) else __import__("cupy")
        out = xp.full(out_shape, _identity(step.reduce_type, arr.dtype), dtype=arr.dtype)
        idx = [slice(None)] * arr.ndim
        idx[d] = slice(a, b)
        out[tuple(idx)] = arr * n if step.reduce_type == "avg" else arr
        return out
    if k == "to_partial":
        r = step.reduce_type
        if r in ("sum", "prod") and coord[m] != 0:
            return np.zeros_like(arr) + (1 if r == "prod" else 0) if isinstance(arr, np.ndarray) \
                else arr * 0 + (1 if r == "prod" else 0)
        return arr.copy()
    raise AssertionError(k)


def _identity(reduce_type: str, dtype):
    """The value that does not change a ``reduce_type`` reduction."""
    dt = np.dtype(dtype)
    if reduce_type in ("sum", "avg"):
        return 0
    if reduce_type == "prod":
        return 1
    if dt.kind == "b":
        return reduce_type == "min"
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if reduce_type == "max" else info.max
    return -np.inf if reduce_type == "max" else np.inf


def execute_same_mesh(steps: tuple[Step, ...], arr, shape, mesh: ProcessMesh):
    """Run ``steps`` on this rank's piece ``arr`` (a member of ``mesh``)."""
    coord = coord_of(mesh)
    for step in steps:
        arr = _run_step(step, arr, shape, mesh, coord)
    return arr


def execute(plan: ReshardPlan, arr, dtype) -> Any:
    """This rank's piece after ``plan`` (an empty array on ranks outside the target mesh)."""
    from .dist_tensor import empty_piece

    shape = plan.shape
    src_mesh, dst_mesh = plan.src_mesh, plan.dst_mesh
    if src_mesh == dst_mesh:
        if coord_of(src_mesh) is None:
            return arr
        out = execute_same_mesh(plan.steps, arr, shape, src_mesh)
        return out if out is not arr else arr.copy()
    me = get_rank()
    src_coord, dst_coord = coord_of(src_mesh), coord_of(dst_mesh)
    i = 0
    if src_coord is not None and plan.steps[0].kind != "send_recv":
        while plan.steps[i].kind != "send_recv":
            arr = _run_step(plan.steps[i], arr, shape, src_mesh, src_coord)
            i += 1
    elif plan.steps[0].kind != "send_recv":
        while plan.steps[i].kind != "send_recv":
            i += 1
    p2p = plan.steps[i]
    recv = _cross_mesh_move(plan, p2p, arr, dtype, me, src_coord, dst_coord)
    if dst_coord is None:
        return empty_piece(shape, dtype, arr)
    for step in plan.steps[i + 1:]:
        recv = _run_step(step, recv, shape, dst_mesh, dst_coord)
    return recv


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
        sl = local_slices(plan.shape, target, rc)
        if me == s:
            piece = arr if direct else arr[sl]
            if s == r:
                received = piece.copy()
            else:
                w.send(np.ascontiguousarray(piece) if isinstance(piece, np.ndarray) else piece, r)
        if me == r and s != r:
            received = w.recv(tuple(x.stop - x.start for x in sl), dtype, s,
                              like=arr if not isinstance(arr, np.ndarray) else None)
    return received
