"""Leaf gradients after backward: their layout policy and the bucketed data-parallel sync.

* **Layout policy.** A distributed leaf's gradient takes the leaf's own mesh and placements,
  unless :func:`set_grad_layout` gave the leaf another layout (ZeRO stage 2 keeps a replicated
  weight's gradient sharded over the data-parallel dim: its Partial gradient is
  reduce-scattered instead of all-reduced). A dense leaf gets a dense gradient.
* **Buckets, overlapped with backward.** The autograd engine hands each leaf gradient to a
  :class:`LeafGradSync` as soon as it is final (every grad node feeding the leaf has run).
  Gradients whose move to their target layout is an all-reduce of their Partial(sum) mesh dims
  followed by slices at most (a weight under data parallelism: one all-reduce each) are packed,
  per (mesh, Partial mesh dims, dtype), into flat buckets; a bucket is started the moment it
  holds :func:`set_bucket_bytes` bytes (25 MB by default, as DDP's ``bucket_cap_mb``): the op
  ``grad_bucket_start`` packs it and starts a nonblocking all-reduce
  (``ProcessGroup.iall_reduce``) while the backward goes on; partly filled buckets start when
  the backward's last node has run, and ``grad_bucket_wait`` then completes every bucket (under
  the collectives' watchdog) and hands each gradient back as a view of its part, before the
  engine stores ``.grad`` (so before any optimizer reads it). Other gradients are resharded
  when final, blocking. Both ops go through the seam like every other op, so captured programs
  record and replay the same start/wait pairs at the same points of the backward.
  :func:`set_overlap` (False) starts every bucket only after the backward (for comparisons).
* **Accumulation without sync.** Inside :func:`no_sync` (``with dt.no_sync(model):``) the
  gradients of the model's parameters skip the data-parallel sync: each keeps its Partial mesh
  dims (the leaf's layout otherwise), and backwards accumulate into ``.grad`` without
  communication. The first backward outside adds the held Partial gradient to its own before
  the sync, so an accumulation of N micro-batches costs one sync: one all-reduce (in a bucket)
  under data parallelism, one reduce-scatter under ZeRO-2. ``.grad`` always holds the right
  values (a Partial gradient reads as its sum).
"""
from __future__ import annotations

import weakref
from collections import deque
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, local_shape, plan_reshard

from .dispatch import run
from .distributed.api import _to_local, reshard_to
from .layout.dist_tensor import DistTensor, canonical, canonical_mesh
from .layout.mesh_groups import coord_of, group_over
from .ops import cast
from .plan import Instr, OutSpec, Plan
from .schema import OPS, register
from .tensor import Tensor

__all__ = ["set_grad_layout", "grad_layout", "to_leaf_layout", "set_bucket_bytes",
           "bucket_bytes", "set_overlap", "LeafGradSync", "no_sync", "keeps_partial_grad"]

# id(leaf) -> (weak reference to the leaf, mesh, DistAttr of its gradient); an entry goes when
# its leaf dies (Tensor's == is elementwise, so no WeakKeyDictionary)
_GRAD_LAYOUTS: dict[int, tuple[weakref.ref, ProcessMesh, DistAttr]] = {}
_BUCKET_BYTES = [25 * 2 ** 20]
_OVERLAP = [True]
_NO_SYNC: list[set[int]] = []    # ids of the leaves of each open no_sync context


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


@contextmanager
def no_sync(model: Any) -> Iterator[None]:
    """Backwards inside skip the data-parallel gradient sync of ``model``'s parameters (a
    Layer, or an iterable of parameters); the first backward after the context syncs the
    accumulated gradients once (see the module notes).

    Example::

        for i, (x, y) in enumerate(micro_batches):
            ctx = dt.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext()
            with ctx:
                (loss_fn(model(x), y) / len(micro_batches)).backward()
        opt.step(); opt.clear_grad(set_to_zero=False)
    """
    params = model.parameters() if hasattr(model, "parameters") else model
    if isinstance(params, Tensor):
        params = [params]
    ids = set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"no_sync: model must be a Layer or an iterable of Tensors; item "
                            f"{i} is a {type(p).__name__}")
        ids.add(id(p))
    _NO_SYNC.append(ids)
    try:
        yield
    finally:
        _NO_SYNC.remove(ids)


def _deferred(leaf: Tensor) -> bool:
    return any(id(leaf) in ids for ids in _NO_SYNC)


def keeps_partial_grad(leaf: Tensor) -> bool:
    """Whether ``leaf``'s gradient is held Partial (``no_sync``) or given its own layout
    (:func:`set_grad_layout`, e.g. ZeRO-2's reduce-scatter) rather than all-reduced."""
    return _deferred(leaf) or id(leaf) in _GRAD_LAYOUTS


def _held_layout(attr: DistAttr, g_attr: DistAttr) -> DistAttr:
    """``attr`` with the Partial mesh dims of ``g_attr`` kept Partial (not sharded on)."""
    pending = dict(g_attr.partial)
    dims = tuple(tuple(m for m in dm if m not in pending) for dm in attr.dims_mapping)
    return DistAttr(attr.mesh_shape, dims, tuple(pending.items()))


def to_leaf_layout(leaf: Tensor, g: Tensor) -> Tensor:
    """``g`` in the layout :func:`grad_layout` gives ``leaf`` (dense for a dense leaf) and in
    the leaf's dtype; inside :func:`no_sync`, with ``g``'s Partial dims kept."""
    target = grad_layout(leaf)
    if target is not None:
        mesh, attr = target
        gv = g._value
        if _deferred(leaf) and type(gv) is DistTensor and gv.mesh == mesh:
            attr = _held_layout(attr, gv.dist_attr)
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
    """The bytes at which a gradient bucket is started (0: no buckets, one blocking
    all-reduce per gradient); a bucket holds less than ``nbytes`` plus its last gradient.

    Example::

        dt.grad_sync.set_bucket_bytes(4 * 2 ** 20)   # 4 MB buckets
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"set_bucket_bytes: nbytes must be an int >= 0, got {nbytes!r}")
    _BUCKET_BYTES[0] = int(nbytes)


def bucket_bytes() -> int:
    """The current bucket size in bytes (see :func:`set_bucket_bytes`)."""
    return _BUCKET_BYTES[0]


def set_overlap(on: bool) -> None:
    """Whether buckets start during backward as they fill (True, the default) or all after
    it (False); the values are the same."""
    _OVERLAP[0] = bool(on)


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
    dims = gv.dist_attr.partial_dims()
    if all(gv.mesh.shape[m] == 1 for m in dims) \
            or not _all_reduces(tuple(gv.shape), gv.mesh, gv.dist_attr, target[1]):
        return None  # (a Partial over mesh dims of size 1 is resolved locally)
    return gv.mesh, dims, np.dtype(g.dtype)


def _address(a: np.ndarray) -> int:
    """The address of a numpy array's first element."""
    return a.__array_interface__["data"][0]


_PLANS: dict = {}
_LAST: list = [None]  # the latest started all-reduce (collectives.PendingAllReduce)
_ABANDONED: list = []  # started all-reduces of backwards that raised, until complete


def _bucket_plans(mesh: ProcessMesh, dims: tuple[int, ...], dtype: np.dtype,
                  metas: tuple[tuple[tuple[int, ...], DistAttr], ...]
                  ) -> tuple[Plan, Plan, deque]:
    """(start, wait) of one bucket: start packs the local pieces into a flat buffer (``out=``,
    when a memory plan gives one; a piece the plan already placed at its part of that buffer
    is not copied) and starts its all-reduce over the Partial mesh dims in
    place, returning the buffer (a 1-D tensor of this rank's bucket length, Partial, read by
    nothing but wait); wait completes the all-reduce, writing the buffer (its output 0 is the
    buffer itself, reduced), and returns each gradient as a view of its (disjoint) part of the
    buffer. The pair's started all-reduces wait in a queue (the third value): wait takes the
    one of its buffer, else the oldest (a program whose memory plan copied the buffer between
    start and wait gets the reduced values copied in)."""
    key = (mesh, dims, dtype, metas)
    plans = _PLANS.get(key)
    if plans is not None:
        return plans
    coord = coord_of(mesh)
    shapes = [local_shape(s, a, coord) for s, a in metas]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    bounds = np.cumsum([0] + sizes).tolist()
    n = len(metas)
    group = group_over(mesh, dims)
    nbytes = bounds[-1] * dtype.itemsize
    started: deque = deque()

    def pack_and_start(xp, *arrays, out=None):
        flat = xp.empty(bounds[-1], dtype=dtype) if out is None else out
        at = _address(flat) if out is not None and xp is np else None
        for a, lo, hi in zip(arrays, bounds, bounds[1:]):
            if at is None or _address(a) != at + lo * dtype.itemsize \
                    or not a.flags.c_contiguous:  # (else a memory plan wrote it in place)
                flat[lo:hi] = a.reshape(-1)
        if _LAST[0] is not None:  # progress for the previous bucket (replays too)
            _LAST[0].test()
        started.append(group.iall_reduce(flat, "sum"))
        _LAST[0] = started[-1]
        return flat

    def wait_and_unpack(xp, flat):
        if not started:
            raise RuntimeError("grad_bucket_wait: the bucket's all-reduce was never started "
                               f"(a {nbytes}-byte bucket of {n} gradients)")
        pending = next((p for p in started if p.x is flat), started[0])
        started.remove(pending)
        if _LAST[0] is pending:
            _LAST[0] = None
        reduced = pending.wait()
        if reduced is not flat:
            flat[...] = reduced
        return (flat, *(flat[lo:hi].reshape(s) for s, lo, hi in zip(shapes, bounds, bounds[1:])))

    label = f"all_reduce(sum) over mesh dims {list(dims)} of a {nbytes}-byte bucket"
    cmesh = canonical_mesh(mesh)
    attrs = tuple(a for _, a in metas)
    bucket = canonical(DistAttr.replicated(1, mesh.shape).with_partial(attrs[0].partial))
    start = Plan(OPS["grad_bucket_start"], "dist", n, (Instr(
        "kernel", pack_and_start, tuple(range(n)), (n,), label=f"bucket of {n} gradients",
        nbytes=nbytes, collectives=(label + ", started",), accepts_out=True,
        packs=tuple(bounds[:-1])),),
        (OutSpec(n, (bounds[-1],), dtype, bucket),), mesh=cmesh, in_layouts=attrs)
    wait = Plan(OPS["grad_bucket_wait"], "dist", 1, (Instr(
        "kernel", wait_and_unpack, (0,), tuple(range(1, n + 2)), writes=(0,),
        label=f"wait: {label}", nbytes=nbytes),),
        (OutSpec(1, (bounds[-1],), dtype, bucket, is_input=0),
         *(OutSpec(2 + i, tuple(s), dtype, canonical(a.without_partial()), view_of=0)
           for i, (s, a) in enumerate(metas))), writes=(0,), mesh=cmesh, in_layouts=(bucket,))
    if len(_PLANS) >= 1024:
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = start, wait, started
    return start, wait, started


register("grad_bucket_start", None, rule=None)
register("grad_bucket_wait", None, rule=None, n_out=-1)


class LeafGradSync:
    """The leaf gradients of one backward pass (see the module notes): :meth:`ready` takes
    each as it becomes final, :meth:`finish` returns (leaf, gradient in its layout) for all.

    Buckets fill in the order the backward finishes the gradients, which is the same on every
    rank (the same graph, walked the same way), so every rank starts the same buckets in the
    same order."""

    def __init__(self) -> None:
        self.limit = _BUCKET_BYTES[0]
        self.overlap = _OVERLAP[0]
        self.open: dict = {}                 # bucket key -> ([(leaf, grad)], bytes)
        self.full: list = []                 # filled buckets not started (overlap off)
        self.started: list = []              # (leaves, bucket tensor, wait plan, queue)
        self.done: list[tuple[Tensor, Tensor]] = []
        self.merged: list[Tensor] = []       # leaves whose held .grad is inside their sync

    def ready(self, leaf: Tensor, g: Tensor) -> None:
        """``g`` is ``leaf``'s final gradient of this backward."""
        if _deferred(leaf):
            self.done.append((leaf, to_leaf_layout(leaf, g)))
            return
        held = leaf.grad
        if held is not None and held.is_dist() and held._value.dist_attr.partial:
            g = g + held                  # the held Partial gradient joins this sync
            self.merged.append(leaf)
        key = _bucket_key(leaf, g) if self.limit else None
        if key is None:
            self.done.append((leaf, to_leaf_layout(leaf, g)))
            return
        items, size = self.open.pop(key, ([], 0))
        items.append((leaf, g))
        size += g._value.local.array.nbytes
        if size < self.limit:
            self.open[key] = (items, size)
        elif self.overlap:
            self._start(items)
        else:
            self.full.append(items)
        if _LAST[0] is not None:  # MPI progresses nonblocking collectives only inside calls
            _LAST[0].test()

    def _start(self, items: list) -> None:
        grads = [g for _, g in items]
        v = grads[0]._value
        metas = tuple((tuple(g._value.shape), g._value.dist_attr) for g in grads)
        start, wait, queue = _bucket_plans(v.mesh, v.dist_attr.partial_dims(),
                                           np.dtype(grads[0].dtype), metas)
        bucket = run(start, tuple(grads), {"mesh": v.mesh}, needs_grad=False)
        self.started.append(([leaf for leaf, _ in items], bucket, wait, queue))

    def finish(self) -> list[tuple[Tensor, Tensor]]:
        """Start the partly filled buckets, wait for every bucket; every gradient in its
        leaf's layout."""
        for items in self.full + [items for items, _ in self.open.values()]:
            self._start(items)
        self.open, self.full = {}, []
        while self.started:
            leaves, bucket, wait, _ = self.started.pop(0)
            out = run(wait, (bucket,), {"mesh": bucket._value.mesh}, needs_grad=False)
            self.done.extend((leaf, to_leaf_layout(leaf, g)) for leaf, g in zip(leaves, out[1:]))
        for leaf in self.merged:          # the synced gradient replaces the held one
            leaf.grad = None
        return self.done

    def abandon(self) -> None:
        """Forget the buckets started and not waited for (a backward that raised), so that no
        later wait takes their all-reduces. Those may stay incomplete (the ranks are then out
        of step, as after any interrupted sequence of collectives): they are kept, buffers
        included, until MPI has completed them, since MPI may still write into the buffers."""
        for _, bucket, _, queue in self.started:
            flat = bucket._local_array()
            for p in [p for p in queue if p.x is flat]:
                queue.remove(p)
                _ABANDONED.append(p)
        _ABANDONED[:] = [p for p in _ABANDONED if not p.test()]
        self.started = []
        _LAST[0] = None
