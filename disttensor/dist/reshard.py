"""Reshard planning and execution (DESIGN §5).

A plan is a list of :class:`Step` computed from metadata only (shape, dtype size, meshes, source
and target DistAttr) and cached. On one mesh it works mesh dim by mesh dim, with one collective
per changed mesh dim:

1. partial mesh dims: P→S by reduce-scatter when the target shard can be cut from the current
   piece, P(sum)↔P(avg) by a local scale, otherwise P→R by all-reduce;
2. sharded mesh dims that the target does not keep (it keeps the common prefix of each tensor
   dim's split order), innermost first: S→S' by all-to-all when the target shard can be cut
   from the current piece, S→P locally when the target makes that mesh dim Partial (the own
   block in place, the reduction's identity elsewhere), otherwise S→R by all-gather (uneven
   sizes known from metadata);
3. R→S by a local slice, outermost first (no communication);
4. R→P locally (the value on coordinate 0, the reduction's identity elsewhere).

Mesh dims of size 1 never need communication. Across meshes, disjoint meshes of the same shape
and layout move each piece point to point; otherwise the source gathers to Replicate and each
target rank receives exactly its piece from one source rank (or copies it, when it is one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, ReduceType, local_slices, split_range

from .mesh_groups import coord_of, get_rank, group_along, world

_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Step:
    """One step of a plan. ``kind`` is a collective name, ``slice``, ``scale_partial``,
    ``to_partial``, ``shard_to_partial`` or ``send_recv``; ``bytes_per_rank`` is the largest local input it moves."""

    kind: str
    mesh_dim: int | None = None
    tensor_dim: int | None = None
    split_dim: int | None = None
    reduce_type: str | None = None
    bytes_per_rank: int = 0
    before: DistAttr | None = None
    after: DistAttr | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in _COLLECTIVE_KINDS

    def describe(self) -> str:
        where = f"mesh dim {self.mesh_dim}" if self.mesh_dim is not None else "across meshes"
        what = {
            "all_reduce": f"all-reduce ({self.reduce_type})",
            "all_gather": f"all-gather tensor dim {self.tensor_dim}",
            "reduce_scatter": f"reduce-scatter ({self.reduce_type}) tensor dim {self.tensor_dim}",
            "all_to_all": f"all-to-all split dim {self.split_dim} -> concat dim {self.tensor_dim}",
            "slice": f"local slice of tensor dim {self.tensor_dim}",
            "scale_partial": f"local rescale Partial -> Partial({self.reduce_type})",
            "to_partial": f"local Replicate -> Partial({self.reduce_type})",
            "shard_to_partial": f"local Shard({self.tensor_dim}) -> Partial({self.reduce_type}) "
                                "(own block in place, identity elsewhere)",
            "send_recv": "point-to-point send/recv of local pieces",
        }[self.kind]
        return f"{what} on {where}, {self.bytes_per_rank} bytes per rank"


@dataclass(frozen=True)
class ReshardPlan:
    """What ``reshard`` will do; ``str(plan)`` prints it."""

    shape: tuple[int, ...]
    src_mesh: ProcessMesh
    src: DistAttr
    dst_mesh: ProcessMesh
    dst: DistAttr
    steps: tuple[Step, ...] = field(default=())

    @property
    def num_collectives(self) -> int:
        return sum(1 for s in self.steps if s.is_collective)

    @property
    def bytes_per_rank(self) -> int:
        return sum(s.bytes_per_rank for s in self.steps if s.kind != "slice")

    def __str__(self) -> str:
        head = (f"reshard {list(self.shape)}: {self.src.to_placements()} on {self.src_mesh} -> "
                f"{self.dst.to_placements()} on {self.dst_mesh}: "
                f"{self.num_collectives} collective(s)")
        if not self.steps:
            return head + ", nothing to do"
        head += f", {self.bytes_per_rank} bytes per rank moved"
        return head + "".join(f"\n  {i + 1}. {s.describe()}" for i, s in enumerate(self.steps))


# -- planning --------------------------------------------------------------------------------------

def _max_piece_numel(shape, attr: DistAttr) -> int:
    """The largest local piece over all coordinates (nested ceil division)."""
    n = 1
    for size, dm in zip(shape, attr.dims_mapping):
        for m in dm:
            size = -(-size // attr.mesh_shape[m])
        n *= size
    return n


def _squeeze_unit_dims(attr: DistAttr) -> DistAttr:
    """Drop mesh dims of size 1 (they never need data movement)."""
    ms = attr.mesh_shape
    return DistAttr(ms, tuple(tuple(m for m in dm if ms[m] > 1) for dm in attr.dims_mapping),
                    tuple((m, r) for m, r in attr.partial if ms[m] > 1))


class _State:
    """The layout while a plan is built: a mutable copy of a DistAttr."""

    def __init__(self, attr: DistAttr):
        self.mesh_shape = attr.mesh_shape
        self.dims = [list(dm) for dm in attr.dims_mapping]
        self.partial = dict(attr.partial)

    def freeze(self) -> DistAttr:
        return DistAttr(self.mesh_shape, tuple(tuple(d) for d in self.dims),
                        tuple(self.partial.items()))


def _target_shard_dim(dst: DistAttr, m: int) -> int | None:
    for d, dm in enumerate(dst.dims_mapping):
        if m in dm:
            return d
    return None


def _can_cut(state: _State, dst: DistAttr, d: int, m: int) -> bool:
    """True when splitting the current piece along ``d`` over ``m`` gives the target's piece."""
    target = list(dst.dims_mapping[d])
    k = target.index(m)
    return state.dims[d] == target[:k]


@lru_cache(maxsize=4096)
def plan_same_mesh(shape: tuple[int, ...], itemsize: int, src: DistAttr, dst: DistAttr
                   ) -> tuple[Step, ...]:
    """The steps that turn layout ``src`` into ``dst`` on one mesh (see the module docstring)."""
    src_n, dst_n = _squeeze_unit_dims(src), _squeeze_unit_dims(dst)
    st = _State(src_n)
    steps: list[Step] = []
    dst_partial = dict(dst_n.partial)

    def done(kind: str, before: DistAttr, **kw) -> None:
        """Record a step whose change has just been applied to ``st``."""
        steps.append(Step(kind, bytes_per_rank=_max_piece_numel(shape, before) * itemsize,
                          before=before, after=st.freeze(), **kw))

    # 1. partial mesh dims
    for m, r in sorted(st.partial.items()):
        want = dst_partial.get(m)
        if want == r:
            continue
        d = _target_shard_dim(dst_n, m)
        before = st.freeze()
        del st.partial[m]
        if want is None and d is not None and _can_cut(st, dst_n, d, m):
            st.dims[d].append(m)
            done("reduce_scatter", before, mesh_dim=m, tensor_dim=d, reduce_type=r.value)
        elif want is not None and {r, want} == {ReduceType.SUM, ReduceType.AVG}:
            st.partial[m] = want
            done("scale_partial", before, mesh_dim=m, reduce_type=want.value)
        else:
            done("all_reduce", before, mesh_dim=m, reduce_type=r.value)

    # 2. unshard what the target does not keep, innermost first
    changed = True
    while changed:
        changed = False
        for d in range(len(shape)):
            cur, target = st.dims[d], dst_n.dims_mapping[d]
            keep = 0
            while keep < min(len(cur), len(target)) and cur[keep] == target[keep]:
                keep += 1
            if len(cur) == keep:
                continue
            before = st.freeze()
            m = cur.pop()
            d2 = _target_shard_dim(dst_n, m)
            if d2 is not None and d2 != d and _can_cut(st, dst_n, d2, m):
                st.dims[d2].append(m)
                done("all_to_all", before, mesh_dim=m, tensor_dim=d, split_dim=d2)
            elif m in dst_partial:
                st.partial[m] = dst_partial[m]
                done("shard_to_partial", before, mesh_dim=m, tensor_dim=d,
                     reduce_type=dst_partial[m].value)
            else:
                done("all_gather", before, mesh_dim=m, tensor_dim=d)
            changed = True

    # 3. local slices, outermost first
    for d in range(len(shape)):
        for m in dst_n.dims_mapping[d][len(st.dims[d]):]:
            before = st.freeze()
            st.dims[d].append(m)
            done("slice", before, mesh_dim=m, tensor_dim=d)

    # 4. Replicate -> Partial
    for m, r in sorted(dst_partial.items()):
        if st.partial.get(m) != r:
            before = st.freeze()
            st.partial[m] = r
            done("to_partial", before, mesh_dim=m, reduce_type=r.value)
    return tuple(steps)


@lru_cache(maxsize=4096)
def plan_reshard(shape: tuple[int, ...], itemsize: int, src_mesh: ProcessMesh, src: DistAttr,
                 dst_mesh: ProcessMesh, dst: DistAttr) -> ReshardPlan:
    """The cached plan for moving a tensor between two layouts (and meshes)."""
    if src_mesh == dst_mesh:
        steps = plan_same_mesh(shape, itemsize, src, dst)
    elif (src_mesh.shape == dst_mesh.shape and src == dst
          and not set(src_mesh.process_ids) & set(dst_mesh.process_ids)):
        steps = (Step("send_recv", bytes_per_rank=_max_piece_numel(shape, src) * itemsize,
                      before=src, after=dst),)
    else:
        rep = DistAttr.replicated(len(shape), src.mesh_shape)
        dst_plain = dst.without_partial()
        steps = plan_same_mesh(shape, itemsize, src, rep) + (
            Step("send_recv", bytes_per_rank=_max_piece_numel(shape, dst_plain) * itemsize,
                 before=rep, after=dst_plain),)
        if dst.partial:
            steps += plan_same_mesh(shape, itemsize, dst_plain, dst)
    return ReshardPlan(shape, src_mesh, src, dst_mesh, dst, steps)


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
