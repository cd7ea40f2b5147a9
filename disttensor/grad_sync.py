"""Leaf gradients after backward: their layout policy and the bucketed data-parallel sync.

* **Layout policy.** A distributed leaf's gradient takes the leaf's own mesh and placements,
  unless :func:`set_grad_layout` gave the leaf another layout (ZeRO stage 2 keeps a replicated
  weight's gradient sharded over the data-parallel dim: its Partial gradient is
  reduce-scattered instead of all-reduced). A dense leaf gets a dense gradient.
* **Buckets.** Gradients whose move to their target layout is an all-reduce of their
  Partial(sum) mesh dims followed by slices at most (a weight under data parallelism: one
  all-reduce each) are packed, per (mesh,
  Partial mesh dims, dtype), into flat buffers of at most :func:`set_bucket_bytes` bytes (25 MB
  by default, as DDP) and reduced with one all-reduce per bucket: the op ``grad_bucket_sync``,
  a plan of one instruction (pack, all-reduce, unpack) that goes through the seam like every
  other op (the gradients it returns are views of disjoint parts of the bucket). The
  collectives layer is blocking, so the buckets are reduced after the whole backward rather
  than overlapped with it.
"""
from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Sequence

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, local_shape, plan_reshard

from .dispatch import run
from .distributed.api import _to_local, reshard_to
from .distributed.dist_tensor import DistTensor, canonical, canonical_mesh
from .distributed.mesh_groups import coord_of, group_over
from .ops import cast
from .plan import Instr, OutSpec, Plan
from .schema import OPS, register
from .tensor import Tensor

__all__ = ["set_grad_layout", "grad_layout", "to_leaf_layout", "set_bucket_bytes",
           "bucket_bytes", "sync_leaf_grads"]

# id(leaf) -> (weak reference to the leaf, mesh, DistAttr of its gradient); an entry goes when
# its leaf dies (Tensor's == is elementwise, so no WeakKeyDictionary)
_GRAD_LAYOUTS: dict[int, tuple[weakref.ref, ProcessMesh, DistAttr]] = {}
_BUCKET_BYTES = [25 * 2 ** 20]


def set_grad_layout(leaf: Tensor, mesh: ProcessMesh | None, attr: DistAttr | None) -> None:
    """The gradient placement policy of one leaf: its ``.grad`` is laid out as ``attr`` on
    ``mesh``; ``attr=None`` restores the default (the leaf's own layout)."""
    k = id(leaf)
    if attr is None:
        _GRAD_LAYOUTS.pop(k, None)
        return
    ref = weakref.ref(leaf, lambda _r, k=k: _GRAD_LAYOUTS.pop(k, None))
    _GRAD_LAYOUTS[k] = (ref, mesh, attr)


def grad_layout(leaf: Tensor) -> tuple[ProcessMesh, DistAttr] | None:
    """(mesh, DistAttr) a leaf's gradient takes (None: dense)."""
    policy = _GRAD_LAYOUTS.get(id(leaf))
    if policy is not None and policy[0]() is leaf:
        return policy[1], policy[2]
    lv = leaf._value
    return (lv.mesh, lv.dist_attr) if type(lv) is DistTensor else None


def to_leaf_layout(leaf: Tensor, g: Tensor) -> Tensor:
    """``g`` in the layout :func:`grad_layout` gives ``leaf`` (dense for a dense leaf) and in
    the leaf's dtype."""
    target = grad_layout(leaf)
    if target is not None:
        mesh, attr = target
        if type(g._value) is not DistTensor or g._value.mesh != mesh \
                or g._value.dist_attr != attr:
            g = reshard_to(g, mesh, attr)
    elif g.is_dist():
        gv = g._value
        g = _to_local(reshard_to(g, gv.mesh, DistAttr.replicated(g.ndim, gv.mesh.shape)))
    if g.dtype != leaf.dtype:
        g = cast(g, leaf.dtype)
    return g


def set_bucket_bytes(nbytes: int) -> None:
    """The most bytes one gradient bucket holds (0: no buckets, one all-reduce per gradient).

    Example::

        dt.grad_sync.set_bucket_bytes(4 * 2 ** 20)   # 4 MB buckets
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"set_bucket_bytes: nbytes must be an int >= 0, got {nbytes!r}")
    _BUCKET_BYTES[0] = int(nbytes)


def bucket_bytes() -> int:
    """The current bucket size in bytes (see :func:`set_bucket_bytes`)."""
    return _BUCKET_BYTES[0]


@lru_cache(maxsize=4096)
def _all_reduces(shape: tuple[int, ...], mesh: ProcessMesh, src: DistAttr,
                 dst: DistAttr) -> bool:
    """True when the planned move from ``src`` to ``dst`` communicates by all-reduces only and
    the move from ``src`` without its Partial dims to ``dst`` not at all (slices)."""
    plan = plan_reshard(shape, 1, mesh, src, mesh, dst)
    if any(s.is_collective and s.kind != "all_reduce" for s in plan.steps):
        return False
    rest = plan_reshard(shape, 1, mesh, src.without_partial(), mesh, dst)
    return not any(s.is_collective for s in rest.steps)


def _bucket_key(leaf: Tensor, g: Tensor):
    """(mesh, Partial mesh dims, dtype) when ``g`` would reach its leaf's gradient layout by
    all-reduces of its Partial(sum) dims and slices (not, say, by a reduce-scatter), else
    None."""
    gv = g._value
    if type(gv) is not DistTensor or g.dtype != leaf.dtype or not gv.dist_attr.partial:
        return None
    target = grad_layout(leaf)
    if target is None or target[0] != gv.mesh or coord_of(gv.mesh) is None \
            or any(r.value != "sum" for _, r in gv.dist_attr.partial):
        return None
    if not _all_reduces(tuple(gv.shape), gv.mesh, gv.dist_attr, target[1]):
        return None
    return gv.mesh, gv.dist_attr.partial_dims(), np.dtype(g.dtype)


_PLANS: dict = {}


def _bucket_plan(mesh: ProcessMesh, dims: tuple[int, ...], dtype: np.dtype,
                 metas: tuple[tuple[tuple[int, ...], DistAttr], ...]) -> Plan:
    """One instruction: pack the local pieces into a flat buffer, all-reduce it over the
    Partial mesh dims, hand each gradient back as a view of its (disjoint) part of the
    buffer."""
    key = (mesh, dims, dtype, metas)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    coord = coord_of(mesh)
    shapes = [local_shape(s, a, coord) for s, a in metas]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    bounds = np.cumsum([0] + sizes).tolist()
    n = len(metas)

    group = group_over(mesh, dims)
    nbytes = bounds[-1] * dtype.itemsize

    def pack_reduce_unpack(xp, *arrays):
        flat = xp.empty(bounds[-1], dtype=dtype)
        for a, lo, hi in zip(arrays, bounds, bounds[1:]):
            flat[lo:hi] = a.reshape(-1)
        flat = group.all_reduce(flat, op="sum")
        return tuple(flat[lo:hi].reshape(s) for s, lo, hi in zip(shapes, bounds, bounds[1:]))

    label = f"all_reduce(sum) over mesh dims {list(dims)} of a {nbytes}-byte bucket"
    instrs = (Instr("kernel", pack_reduce_unpack, tuple(range(n)), tuple(range(n, 2 * n)),
                    label=f"bucket of {n} gradients", nbytes=nbytes, collectives=(label,)),)
    outs = tuple(OutSpec(n + i, tuple(s), dtype, canonical(a.without_partial()))
                 for i, (s, a) in enumerate(metas))
    plan = Plan(OPS["grad_bucket_sync"], "dist", n, instrs, outs, mesh=canonical_mesh(mesh),
                in_layouts=tuple(a for _, a in metas))
    if len(_PLANS) >= 1024:
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan
    return plan


register("grad_bucket_sync", None, rule=None, n_out=-1)


def _sync_bucket(grads: Sequence[Tensor]) -> list[Tensor]:
    v = grads[0]._value
    metas = tuple((tuple(g._value.shape), g._value.dist_attr) for g in grads)
    plan = _bucket_plan(v.mesh, v.dist_attr.partial_dims(), np.dtype(grads[0].dtype), metas)
    out = run(plan, tuple(grads), {"mesh": v.mesh}, needs_grad=False)
    return list(out) if isinstance(out, tuple) else [out]


def sync_leaf_grads(leaves: Sequence[Tensor], grads: Sequence[Tensor]) -> list[Tensor]:
    """Each leaf's gradient in its gradient layout (:func:`to_leaf_layout`), the all-reduces of
    data-parallel gradients packed into buckets (see the module notes)."""
    out: list[Tensor | None] = [None] * len(grads)
    limit = _BUCKET_BYTES[0]
    open_buckets: dict = {}   # key -> (indices, bytes)
    ready: list[list[int]] = []
    for i, (leaf, g) in enumerate(zip(leaves, grads)):
        key = _bucket_key(leaf, g) if limit else None
        if key is None:
            out[i] = to_leaf_layout(leaf, g)
            continue
        nbytes = g._value.local.array.nbytes
        idx, size = open_buckets.get(key, ([], 0))
        if idx and size + nbytes > limit:
            ready.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_buckets[key] = (idx, size + nbytes)
    ready.extend(idx for idx, _ in open_buckets.values())
    for idx in ready:
        if len(idx) == 1:
            out[idx[0]] = to_leaf_layout(leaves[idx[0]], grads[idx[0]])
            continue
        for i, g in zip(idx, _sync_bucket([grads[i] for i in idx])):
            out[i] = to_leaf_layout(leaves[i], g)
    return out
