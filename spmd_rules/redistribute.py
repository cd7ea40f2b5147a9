"""Reshard planning: pure metadata, no arrays, no communication.

A plan is a list of :class:`Step` computed from the shape, the item size, the meshes and the
source and target :class:`DistAttr`, and cached. On one mesh it works mesh dim by mesh dim, with
one collective per changed mesh dim:

1. partial mesh dims: P→S by reduce-scatter when the target shard can be cut from the current
   piece, P(sum)↔P(avg) by a local scale, otherwise P→R by all-reduce; then a tensor dim whose
   only sharding mesh dim a the target replaces by an unused mesh dim b of the same size moves
   by one pairwise exchange (``[S(0), R] -> [R, S(0)]``: rank (i, j) swaps with (j, i)), and a
   co-sharded dim whose split order the target permutes (mesh dims of one size) by one
   exchange per transposition;
2. sharded mesh dims that the target does not keep (it keeps the common prefix of each tensor
   dim's split order), innermost first: S→S' by all-to-all when the target shard can be cut
   from the current piece, S→P locally when the target makes that mesh dim Partial (the own
   block in place, the reduction's identity elsewhere), otherwise S→R by all-gather (uneven
   sizes known from metadata);
3. R→S by a local slice, outermost first (no communication);
4. R→P locally (the value on coordinate 0, the reduction's identity elsewhere).

Strided shards (``Shard(d, split_factor=k)``) are moved by composition: a strided mesh dim
the target does not keep as it is leaves by an all-gather followed by a local reorder (step 2,
never an all-to-all), and one the target adds is cut locally (step 3); a Partial becoming a
strided shard is all-reduced, then cut. Pairwise exchanges involve plain shards only.

Mesh dims of size 1 never need communication. Across meshes, disjoint meshes of the same shape
and layout move each piece point to point; otherwise the source gathers to Replicate and each
target rank receives exactly its piece from one source rank (or copies it, when it is one).

:func:`reshard_cost` gives the bytes a rank receives over a plan (:attr:`Step.traffic`): the
cost model the rules use to choose between layouts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from .dist_attr import DistAttr, split_range
from .mesh import ProcessMesh
from .placement import ReduceType

__all__ = ["Step", "ReshardPlan", "plan_reshard", "plan_same_mesh", "reshard_cost"]

_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "swap")


@dataclass(frozen=True)
class Step:
    """One step of a plan. ``kind`` is a collective name, ``swap`` (a pairwise exchange that
    renames mesh dims ``mesh_dim`` and ``split_dim``, of one size, in tensor dim ``tensor_dim``'s
    sharding), ``slice``, ``scale_partial``, ``to_partial``, ``shard_to_partial`` or ``send_recv``;
    ``bytes_per_rank`` is the largest local input it moves; ``split_factor`` > 1 marks the
    all-gather (then a local reorder) or the slice of a strided shard."""

    kind: str
    mesh_dim: int | None = None
    tensor_dim: int | None = None
    split_dim: int | None = None
    reduce_type: str | None = None
    bytes_per_rank: int = 0
    before: DistAttr | None = None
    after: DistAttr | None = None
    split_factor: int = 1

    @property
    def is_collective(self) -> bool:
        return self.kind in _COLLECTIVE_KINDS

    @property
    def traffic(self) -> int:
        """Bytes a rank receives in this step (ring algorithms; 0 for local steps): the cost
        model. n pieces on the mesh dim: all-gather and swap receive the other pieces
        ((n-1)·piece, piece), reduce-scatter and all-to-all (n-1)/n of the piece, all-reduce
        twice that (reduce-scatter + all-gather)."""
        if not self.is_collective and self.kind != "send_recv":
            return 0
        n = self.before.mesh_shape[self.mesh_dim] if self.mesh_dim is not None else 1
        b = self.bytes_per_rank
        return {"all_gather": b * (n - 1), "swap": b, "send_recv": b,
                "reduce_scatter": b * (n - 1) // n, "all_to_all": b * (n - 1) // n,
                "all_reduce": 2 * b * (n - 1) // n}[self.kind]

    def describe(self) -> str:
        where = f"mesh dim {self.mesh_dim}" if self.mesh_dim is not None else "across meshes"
        if self.kind == "swap":
            where = f"mesh dims {self.mesh_dim} and {self.split_dim}"
        strided = f" (split factor {self.split_factor})" if self.split_factor > 1 else ""
        what = {
            "all_reduce": f"all-reduce ({self.reduce_type})",
            "all_gather": f"all-gather tensor dim {self.tensor_dim}",
            "reduce_scatter": f"reduce-scatter ({self.reduce_type}) tensor dim {self.tensor_dim}",
            "all_to_all": f"all-to-all split dim {self.split_dim} -> concat dim {self.tensor_dim}",
            "swap": f"pairwise exchange (tensor dim {self.tensor_dim})",
            "slice": f"local slice of tensor dim {self.tensor_dim}",
            "scale_partial": f"local rescale Partial -> Partial({self.reduce_type})",
            "to_partial": f"local Replicate -> Partial({self.reduce_type})",
            "shard_to_partial": f"local Shard({self.tensor_dim}) -> Partial({self.reduce_type}) "
                                "(own block in place, identity elsewhere)",
            "send_recv": "point-to-point send/recv of local pieces",
        }[self.kind]
        return f"{what}{strided} on {where}, {self.bytes_per_rank} bytes per rank"


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
    """The largest local piece over all coordinates (nested ceil division, per section of a
    strided shard)."""
    n = 1
    for size, dm in zip(shape, attr.dims_mapping):
        for m in dm:
            k, parts = attr.factor_of(m), attr.mesh_shape[m]
            size = sum(-(-(b - a) // parts) for a, b in (split_range(size, k, s) for s in range(k)))
        n *= size
    return n


def _squeeze_unit_dims(attr: DistAttr) -> DistAttr:
    """Drop mesh dims of size 1 (they never need data movement)."""
    ms = attr.mesh_shape
    return DistAttr(ms, tuple(tuple(m for m in dm if ms[m] > 1) for dm in attr.dims_mapping),
                    tuple((m, r) for m, r in attr.partial if ms[m] > 1),
                    tuple((m, k) for m, k in attr.split_factors if ms[m] > 1))


class _State:
    """The layout while a plan is built: a mutable copy of a DistAttr."""

    def __init__(self, attr: DistAttr):
        self.mesh_shape = attr.mesh_shape
        self.dims = [list(dm) for dm in attr.dims_mapping]
        self.partial = dict(attr.partial)
        self.factors = dict(attr.split_factors)

    def freeze(self) -> DistAttr:
        return DistAttr(self.mesh_shape, tuple(tuple(d) for d in self.dims),
                        tuple(self.partial.items()), tuple(self.factors.items()))

    def same(self, m: int, dst: DistAttr) -> bool:
        """Mesh dim ``m`` splits with the same factor here and in ``dst``."""
        return self.factors.get(m, 1) == dst.factor_of(m)


def _target_shard_dim(dst: DistAttr, m: int) -> int | None:
    for d, dm in enumerate(dst.dims_mapping):
        if m in dm:
            return d
    return None


def _can_cut(state: _State, dst: DistAttr, d: int, m: int) -> bool:
    """True when splitting the current piece along ``d`` over ``m`` gives the target's piece."""
    target = list(dst.dims_mapping[d])
    k = target.index(m)
    return (state.dims[d] == target[:k] and dst.factor_of(m) == 1
            and all(state.same(t, dst) for t in target[:k]))


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

    # 1b. pairwise exchanges: renaming two mesh dims a, b of one size in the layout is the
    # exchange in which the rank at coordinate c takes the piece held at c with its a and b
    # coordinates swapped. Used (a) for a tensor dim sharded by a alone that the target shards
    # first by an unused b ([S(0), R] -> [R, S(0)]), (b) to reorder a co-sharded dim's split
    # order ([S(0), S(0)] -> the same with shard_order (1, 0)), one transposition at a time
    for d in range(len(shape)):
        cur, target = st.dims[d], dst_n.dims_mapping[d]
        in_use = {m for dm in st.dims for m in dm} | set(st.partial)
        if any(st.factors.get(m, 1) > 1 or dst_n.factor_of(m) > 1 for m in (*cur, *target)):
            continue
        if len(cur) == 1 and target and target[0] != cur[0] and cur[0] not in target \
                and target[0] not in in_use and st.mesh_shape[cur[0]] == st.mesh_shape[target[0]]:
            before = st.freeze()
            a, st.dims[d] = cur[0], [target[0]]
            done("swap", before, mesh_dim=a, tensor_dim=d, split_dim=target[0])
            continue
        if len(cur) < 2 or sorted(cur) != sorted(target[:len(cur)]):
            continue
        for k in range(len(cur)):
            a, b = cur[k], target[k]
            if a == b:
                continue
            if st.mesh_shape[a] != st.mesh_shape[b]:
                break
            before = st.freeze()
            j = cur.index(b)
            cur[k], cur[j] = b, a
            done("swap", before, mesh_dim=a, tensor_dim=d, split_dim=b)

    # 2. unshard what the target does not keep, innermost first
    changed = True
    while changed:
        changed = False
        for d in range(len(shape)):
            cur, target = st.dims[d], dst_n.dims_mapping[d]
            keep = 0
            while keep < min(len(cur), len(target)) and cur[keep] == target[keep] \
                    and st.same(cur[keep], dst_n):
                keep += 1
            if len(cur) == keep:
                continue
            before = st.freeze()
            m = cur.pop()
            factor = st.factors.pop(m, 1)
            d2 = _target_shard_dim(dst_n, m)
            if factor > 1:
                done("all_gather", before, mesh_dim=m, tensor_dim=d, split_factor=factor)
            elif d2 is not None and d2 != d and _can_cut(st, dst_n, d2, m):
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
            factor = dst_n.factor_of(m)
            if factor > 1:
                st.factors[m] = factor
            done("slice", before, mesh_dim=m, tensor_dim=d, split_factor=factor)

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


def reshard_cost(shape: tuple[int, ...], itemsize: int, src: DistAttr, dst: DistAttr) -> int:
    """Bytes a rank receives while moving ``src`` to ``dst`` on one mesh (0 when only local
    steps are needed): the sum of the plan's :attr:`Step.traffic`."""
    if src == dst:
        return 0
    return sum(s.traffic for s in plan_same_mesh(tuple(shape), itemsize, src, dst))
