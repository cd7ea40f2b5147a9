"""Distributed op dispatch (DESIGN §4, steps 2–5).

``dist_apply(op, inputs, attrs)`` for any op with a distributed input:

1. dense inputs join as Replicate on the mesh of the distributed ones;
2. the op's SPMD rule gives the layouts the inputs must have and the outputs' global shapes and
   layouts — a :class:`_Decision`, cached by (op, input layouts, shapes, attrs), which also holds
   the reshard plans and the attrs converted to this rank's local terms;
3. inputs whose layout differs are resharded (each into a temporary);
4. the op's kernel runs on the local pieces (ops that need their global place get a ctx);
5. outputs are wrapped as DistTensors — view outputs share the buffer and version counter of the
   piece the kernel read (the temporary when the input was resharded) — and the grad node is
   recorded with the original inputs, so backward dispatches the same way.

Inplace ops compute on the temporary and reshard the result back into the target's own buffer,
so the target keeps its mesh, placements and object identity. Inputs a kernel writes into
(``mutates``, e.g. batch_norm's running statistics) are written back the same way.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from spmd_rules import FALLBACK_RULE, DistAttr, ProcessMesh, TensorMeta, get_rule, local_offset

from ..autograd import _GradMode, record
from ..ops.registry import DENSE_CTX, KernelCtx, OpDef, commit_inplace
from ..tensor import DenseTensor, Tensor
from .api import _replicated_value, reshard_value
from .dist_tensor import DistTensor, canonical, empty_piece
from .mesh_groups import coord_of, group_over
from spmd_rules import plan_reshard

from .reshard import execute

__all__ = ["dist_apply", "dist_apply_inplace", "grad_to_leaf_layout", "coverage_report"]


def _xp_of(arrays: list):
    """numpy or cupy, from the first array present."""
    first = next(a for a in arrays if a is not None)
    return np if isinstance(first, np.ndarray) else __import__("cupy")


class DistKernelCtx(KernelCtx):
    """KernelCtx for this rank's pieces: offsets and global shapes from the required layouts,
    all-reduces over the mesh dims that shard the named axes."""

    __slots__ = ("metas", "mesh", "coord")

    def __init__(self, metas, mesh: ProcessMesh, coord):
        self.metas, self.mesh, self.coord = metas, mesh, coord

    def allreduce(self, arr, op: str, input_index: int, axes):
        attr = self.metas[input_index].dist_attr
        dims = tuple(sorted(m for a in axes for m in attr.dims_mapping[a]))
        if not dims:
            return arr
        return group_over(self.mesh, dims).all_reduce(arr, op)

    def offset(self, input_index: int, axis: int) -> int:
        meta = self.metas[input_index]
        return local_offset(meta.shape, meta.dist_attr, self.coord)[axis]

    def global_shape(self, input_index: int, local_shape_: tuple[int, ...]) -> tuple[int, ...]:
        return self.metas[input_index].shape


class _Decision:
    """Everything about one (op, input layouts, shapes, attrs) that does not depend on data."""

    __slots__ = ("in_attrs", "in_metas", "out_metas", "plans", "local_attrs", "ctx", "coord",
                 "views", "keep", "out_dtypes")


_DECISIONS: dict = {}
_WARNED: set = set()  # ops whose fallback warning was given


def _freeze(v: Any):
    if isinstance(v, dict):
        return tuple((k, _freeze(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    return v


def _describe(inputs: tuple, mesh: ProcessMesh | None = None) -> str:
    """Shapes and placements of an op's inputs, for error messages."""
    parts = []
    for t in inputs:
        if t is None:
            parts.append("None")
        elif t.is_dist():
            parts.append(f"shape {list(t.shape)} {t.placements} on mesh {list(t.process_mesh.shape)}"
                         f" {t.process_mesh.process_ids}")
        else:
            parts.append(f"shape {list(t.shape)} dense (joins as Replicate)")
    return "; ".join(f"input {i}: {p}" for i, p in enumerate(parts))


def _mesh_of(op: OpDef, inputs: tuple) -> ProcessMesh:
    mesh = None
    for t in inputs:
        if t is not None and t.is_dist():
            m = t._value.mesh
            if mesh is None:
                mesh = m
            elif m is not mesh and m != mesh:
                raise ValueError(
                    f"{op.name}: inputs live on different meshes {mesh} and {m}; reshard them "
                    f"onto one mesh first ({_describe(inputs)})")
    return mesh


def _decide(op: OpDef, inputs: tuple, attrs: dict, mesh: ProcessMesh, key) -> _Decision:
    metas = []
    for t in inputs:
        if t is None:
            metas.append(None)
        elif t.is_dist():
            metas.append(TensorMeta(t._value.shape, t._value.dist_attr))
        else:
            metas.append(TensorMeta(tuple(t._value.shape),
                                    DistAttr.replicated(t.ndim, mesh.shape)))
    dec = _Decision()
    extra = op.rule_attrs(attrs) if callable(op.rule_attrs) else op.rule_attrs
    rule_attrs = {**extra, **attrs, "op": op.name}
    if op.rule == FALLBACK_RULE:
        if op.name not in _WARNED:
            _WARNED.add(op.name)
            warnings.warn(f"{op.name} has no SPMD rule yet: its inputs are gathered to Replicate "
                          "(see disttensor.coverage_report())", stacklevel=4)
        dec.in_attrs = tuple(None if m is None else DistAttr.replicated(len(m.shape), mesh.shape)
                             for m in metas)
        dec.out_metas = None
    else:
        try:
            res = get_rule(op.rule)(tuple(metas), rule_attrs)
        except (ValueError, TypeError, IndexError) as e:  # same metadata, same error everywhere
            msg = str(e) if str(e).startswith(op.name) else f"{op.name}: {e}"
            raise type(e)(f"{msg} (distributed inputs: {_describe(inputs, mesh)})") from e
        dec.in_attrs = res.inputs
        dec.out_metas = tuple(TensorMeta(m.shape, canonical(m.dist_attr)) for m in res.outputs)
    dec.in_metas = tuple(None if m is None else TensorMeta(m.shape, a)
                         for m, a in zip(metas, dec.in_attrs))
    plans = []
    for t, m, want in zip(inputs, metas, dec.in_attrs):
        if m is None or want is None or m.dist_attr == want:
            plans.append(None)
        else:
            itemsize = np.dtype(t.dtype).itemsize
            plan = plan_reshard(m.shape, itemsize, mesh, m.dist_attr, mesh, want)
            plans.append(plan if plan.steps else None)  # e.g. only size-1 mesh dims change
    dec.plans = tuple(plans)
    coord = dec.coord = coord_of(mesh)
    n_out = len(dec.out_metas) if dec.out_metas is not None else 1
    # (input, -1) makes every output a view of that input (split)
    dec.views = {o2: i for i, o in op.view for o2 in (range(n_out) if o == -1 else (o,))}
    dec.ctx = DistKernelCtx(dec.in_metas, mesh, coord) if op.needs_ctx and coord else None
    dec.local_attrs = attrs
    if op.local_attrs is not None and coord is not None and dec.out_metas is not None:
        dec.local_attrs = op.local_attrs(attrs, dec.in_metas, dec.out_metas, coord)
    dec.keep = key  # keeps the objects whose ids are in the key alive
    dec.out_dtypes = None
    if coord is None:
        _probe_outside(op, dec, inputs, metas, attrs, mesh)
    return dec


_PROBE_LIMIT = 1 << 20  # elements: above it, outputs outside the mesh take the inputs' dtype


def _probe_outside(op: OpDef, dec: _Decision, inputs: tuple, metas, attrs: dict,
                   mesh: ProcessMesh) -> None:
    """On a rank outside the mesh (no piece to compute on), the outputs' dtypes — and for the
    fallback rule their shapes — come from running the kernel once on zeros of the global
    shapes (once per decision); large inputs fall back to the first floating input's dtype."""
    like = [t for t in inputs if t is not None]
    dtypes = [np.dtype(t.dtype) for t in like]
    guess = next((d for d in dtypes if d.kind in "fc"), dtypes[0])
    res = None
    if sum(int(np.prod(m.shape)) for m in metas if m is not None) <= _PROBE_LIMIT:
        arrays = [None if m is None else np.zeros(m.shape, dtype=t.dtype)
                  for t, m in zip(inputs, metas)]
        try:
            with np.errstate(all="ignore"):
                res = op.kernel(np, *arrays, ctx=DENSE_CTX, **attrs) if op.needs_ctx else \
                    op.kernel(np, *arrays, **attrs)
            res = (res,) if op.n_out == 1 else tuple(res)
        except Exception:  # noqa: BLE001 - data the zeros do not satisfy: keep the guess
            res = None
    if res is not None:
        dec.out_dtypes = tuple(np.asarray(r).dtype for r in res)
        if dec.out_metas is None:
            dec.out_metas = tuple(TensorMeta(np.shape(r), canonical(DistAttr.replicated(
                np.ndim(r), mesh.shape))) for r in res)
    elif dec.out_metas is not None:
        dec.out_dtypes = (guess,) * len(dec.out_metas)
    else:
        raise ValueError(f"{op.name}: cannot tell the outputs of this op (no SPMD rule) on a "
                         f"rank outside {mesh}; give it a rule ({_describe(inputs, mesh)})")


def _decision(op: OpDef, inputs: tuple, attrs: dict) -> tuple[_Decision, ProcessMesh]:
    """The cached decision for this call; one pass over the inputs builds the key."""
    mesh = None
    parts = []
    for t in inputs:
        if t is None:
            parts.append(None)
            continue
        v = t._value
        if type(v) is DistTensor:
            if mesh is None:
                mesh = v.mesh
            elif v.mesh is not mesh:
                mesh = _mesh_of(op, inputs)  # equal meshes pass; different ones raise
            parts.append((v.shape, id(v.dist_attr)))
        else:
            parts.append(v.shape)
    key = (op, id(mesh), tuple(parts), tuple(attrs.items()) if attrs else ())
    try:
        dec = _DECISIONS.get(key)
    except TypeError:  # unhashable attrs (slices, lists)
        key = key[:3] + (_freeze(attrs),)
        dec = _DECISIONS.get(key)
    if dec is None:
        dec = _decide(op, inputs, attrs, mesh, (mesh, [t._value.dist_attr for t in inputs
                                                      if t is not None and t.is_dist()]))
        _DECISIONS[key] = dec
    return dec, mesh


def _local_inputs(dec: _Decision, inputs: tuple) -> list:
    """Each input's local DenseTensor in its required layout (resharded into a temporary)."""
    locs = []
    for t, plan in zip(inputs, dec.plans):
        if t is None:
            locs.append(None)
            continue
        v = t._value
        d = v if type(v) is DenseTensor else v.local  # a dense input is the same on every rank
        if plan is not None:
            d = DenseTensor(execute(plan, d.array, d.array.dtype))
        locs.append(d)
    return locs


def _compute(op: OpDef, dec: _Decision, inputs: tuple, mesh: ProcessMesh) -> tuple:
    """Reshard, run the kernel and write back mutated inputs: (output arrays, local inputs)."""
    locs = _local_inputs(dec, inputs)
    arrays = [None if d is None else d.array for d in locs]
    xp = np if type(arrays[0]) is np.ndarray else _xp_of(arrays)
    if op.needs_ctx:
        res = op.kernel(xp, *arrays, ctx=dec.ctx, **dec.local_attrs)
    else:
        res = op.kernel(xp, *arrays, **dec.local_attrs)
    if op.n_out == 1:
        res = (res,)
    for i in op.mutates:
        _write_back(inputs[i], locs[i], dec.in_attrs[i], mesh)
    return res, locs


def _out_metas(dec: _Decision, res: tuple, mesh: ProcessMesh) -> tuple:
    if dec.out_metas is not None:
        return dec.out_metas
    # the fallback rule: everything replicated
    return tuple(TensorMeta(np.shape(r), canonical(DistAttr.replicated(np.ndim(r), mesh.shape)))
                 for r in res)


def _run(op: OpDef, dec: _Decision, inputs: tuple, mesh: ProcessMesh) -> list[Tensor]:
    """Compute, then wrap the outputs (views share the piece the kernel read)."""
    res, locs = _compute(op, dec, inputs, mesh)
    out_metas = _out_metas(dec, res, mesh)
    views = dec.views
    outs = []
    for slot, arr in enumerate(res):
        meta = out_metas[slot]
        if type(arr) is not np.ndarray and isinstance(arr, np.generic):
            arr = np.asarray(arr)
        src = views.get(slot) if views else None
        if src is not None and (type(arr) is not np.ndarray
                                or np.may_share_memory(arr, locs[src].array)):
            t = Tensor(DistTensor(DenseTensor(arr, locs[src].holder), mesh, meta.dist_attr,
                                  meta.shape))
            t._is_view = True
        else:
            t = Tensor(DistTensor(DenseTensor(arr), mesh, meta.dist_attr, meta.shape))
        outs.append(t)
    return outs


def _store_into(t: Tensor, src: DistTensor) -> None:
    """Write ``src``'s value into ``t``'s own buffer in ``t``'s own layout (a dense ``t`` takes
    the replicated value)."""
    v = t._value
    if type(v) is DistTensor:
        target, attr = v.local, v.dist_attr
    else:
        target, attr = v, DistAttr.replicated(len(src.shape), src.mesh.shape)
    target.array[...] = reshard_value(src, src.mesh, attr).local.array


def _write_back(t: Tensor, local: DenseTensor, attr: DistAttr, mesh: ProcessMesh) -> None:
    """After a kernel wrote into ``local`` (``t``'s piece, possibly a resharded temporary),
    make ``t`` hold the new value in its own layout and bump its version."""
    own = t._local_dense()
    if local is not own:
        local.holder.version += 1
        _store_into(t, DistTensor(local, mesh, attr, tuple(t._value.shape)))
    own.holder.version += 1


def _empty_outputs(op: OpDef, dec: _Decision, inputs: tuple, mesh: ProcessMesh):
    """Outputs on a rank outside the mesh: right global shapes and layouts, empty pieces."""
    like = next(t for t in inputs if t is not None)._local_array()
    return [Tensor(DistTensor(DenseTensor(empty_piece(m.shape, d, like)), mesh, m.dist_attr,
                              m.shape)) for m, d in zip(dec.out_metas, dec.out_dtypes)]


def dist_apply(op: OpDef, inputs: tuple, attrs: dict) -> Any:
    """Run ``op`` with at least one distributed input (see the module docstring)."""
    dec, mesh = _decision(op, inputs, attrs)
    outs = _run(op, dec, inputs, mesh) if dec.coord is not None else \
        _empty_outputs(op, dec, inputs, mesh)
    if _GradMode.enabled and op.backward is not None:
        for t in inputs:
            if t is not None and not t.stop_gradient:
                record(op, attrs, inputs, outs)
                break
    return outs[0] if op.n_out == 1 else tuple(outs)


def dist_apply_inplace(op: OpDef, inputs: tuple, attrs: dict, needs_grad: bool) -> Tensor:
    """The inplace variant on distributed tensors: the target keeps its layout and identity
    (``apply_inplace`` has checked the target and decided whether to record a grad node)."""
    ti, to = op.inplace
    x = inputs[ti]
    dec, mesh = _decision(op, inputs, attrs)
    out_meta = dec.out_metas[to] if dec.out_metas is not None else None
    if out_meta is not None and tuple(out_meta.shape) != tuple(x.shape):
        raise ValueError(f"{op.name}_: the result shape {list(out_meta.shape)} differs from the "
                         f"shape {list(x.shape)} of the tensor modified inplace "
                         f"({_describe(inputs)})")
    node = record(op, attrs, inputs, [None] * len(dec.out_metas or (None,))) if needs_grad \
        else None
    if dec.coord is not None:
        res, _ = _compute(op, dec, inputs, mesh)
        meta = _out_metas(dec, res, mesh)[to]
        xv = x._value
        if type(xv) is DistTensor and meta.dist_attr is xv.dist_attr:
            xv.local.array[...] = res[to]  # already in the target's layout
        else:
            _store_into(x, DistTensor(DenseTensor(res[to]), mesh, meta.dist_attr, meta.shape))
    commit_inplace(op, x, node)
    return x


def grad_to_leaf_layout(leaf: Tensor, g: Tensor) -> Tensor:
    """A gradient in its leaf's layout: the leaf's mesh and placements (a Partial gradient of a
    replicated weight becomes an all-reduce — data-parallel gradient sync), or dense for a
    dense leaf."""
    if leaf.is_dist():
        lv = leaf._value
        gv = g._value if g.is_dist() else _replicated_value(g, lv.mesh)
        out = Tensor(reshard_value(gv, lv.mesh, lv.dist_attr))
    else:
        gv = g._value
        rep = reshard_value(gv, gv.mesh, DistAttr.replicated(len(gv.shape), gv.mesh.shape))
        out = Tensor(DenseTensor(rep.local.array))
    if out.dtype != leaf.dtype:
        from ..ops import cast

        out = cast(out, leaf.dtype)
    return out


def coverage_report() -> dict[str, list[str]]:
    """Which registered ops have a real SPMD rule and which use the replicated fallback."""
    from spmd_rules import rule_coverage

    from ..ops.registry import OPS

    return rule_coverage({name: op.rule for name, op in OPS.items()})
