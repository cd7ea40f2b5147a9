"""Plans for calls with a distributed input: rule, reshard steps, kernel, write-backs.

:func:`plan_call` turns (op, input layouts and shapes, attrs) into a :class:`~disttensor.plan.Plan`:

1. dense inputs join as Replicate on the mesh of the distributed ones;
2. the op's SPMD rule gives the layouts the inputs must have and the outputs' global shapes and
   layouts; the schema gives the output dtypes;
3. every input whose layout differs gets its reshard steps as instructions (one per collective
   or local step) into a temporary slot;
4. the kernel instruction reads the argument slots, with attributes converted to this rank's
   local terms and a :class:`DistKernelCtx` for ops that need their global place;
5. mutated inputs that were resharded are written back into the caller's buffer in its own
   layout (reshard instructions, then a ``store``); inplace variants store the result into the
   target the same way (or have the kernel write into it when the layouts match);
6. outputs: a view output shares the buffer of the slot the kernel read (the post-reshard
   temporary when there was one); a mutated output is the input tensor itself.

On a rank outside the mesh the plan is one ``empty`` instruction: right global shapes, layouts
and dtypes, empty pieces, no kernel. Plans depend only on metadata, so the dispatcher caches them.
"""
from __future__ import annotations

import warnings
from functools import partial

import numpy as np

from spmd_rules import (
    FALLBACK_RULE,
    DistAttr,
    ProcessMesh,
    TensorMeta,
    get_rule,
    local_offset,
    plan_reshard,
)

from ..generator import default_generator
from ..plan import Instr, OutSpec, Plan
from ..schema import KernelCtx, OpDef
from .dist_tensor import canonical, empty_piece
from .mesh_groups import coord_of, group_over
from .reshard import prepare

__all__ = ["DistKernelCtx", "plan_call", "describe_inputs", "reshard_instrs"]


class DistKernelCtx(KernelCtx):
    """KernelCtx for this rank's pieces: offsets and global shapes from the required layouts,
    all-reduces over the mesh dims that shard the named axes."""

    __slots__ = ("metas", "mesh", "coord", "_offsets", "_groups")

    def __init__(self, metas, mesh: ProcessMesh, coord):
        self.metas, self.mesh, self.coord = metas, mesh, coord
        self._offsets: dict = {}  # input index -> this rank's offsets (plans are cached)
        # (input index, axes, op, shape, dtype) -> the prepared all-reduce, or None (no dims)
        self._groups: dict = {}

    def allreduce(self, arr, op: str, input_index: int, axes):
        key = (input_index, axes, op, arr.shape, arr.dtype)
        run = self._groups.get(key, self)
        if run is self:
            attr = self.metas[input_index].dist_attr
            dims = tuple(sorted(m for a in axes for m in attr.dims_mapping[a]))
            run = None
            if dims:
                group = group_over(self.mesh, dims)
                prepare = getattr(group, "prepare", None)  # a one-rank group has none
                run = prepare("all_reduce", arr.shape, arr.dtype, op=op) if prepare else \
                    partial(group.all_reduce, op=op)
            self._groups[key] = run
        return arr if run is None else run(arr)

    def offset(self, input_index: int, axis: int) -> int:
        offsets = self._offsets.get(input_index)
        if offsets is None:
            meta = self.metas[input_index]
            offsets = self._offsets[input_index] = local_offset(meta.shape, meta.dist_attr,
                                                                self.coord)
        return offsets[axis]

    def global_shape(self, input_index: int, local_shape_: tuple[int, ...]) -> tuple[int, ...]:
        return self.metas[input_index].shape

    def is_split(self, input_index: int, axis: int) -> bool:
        return bool(self.metas[input_index].dist_attr.dims_mapping[axis])

    def collectives(self) -> list[str]:
        dims = sorted({m for meta in self.metas if meta is not None
                       for dm in meta.dist_attr.dims_mapping for m in dm})
        return [f"all-reduce of partial statistics over mesh dims {dims}"] if dims else []


_WARNED: set = set()  # ops whose fallback warning was given


def describe_inputs(inputs: tuple, mesh: ProcessMesh | None = None) -> str:
    """Shapes and placements of an op's inputs, for error messages."""
    parts = []
    for t in inputs:
        if t is None:
            parts.append("None")
        elif t.is_dist():
            m = t._value.mesh
            parts.append(f"shape {list(t.shape)} {t.placements} on mesh {list(m.shape)} "
                         f"{m.process_ids}")
        else:
            parts.append(f"shape {list(t.shape)} dense (joins as Replicate)")
    return "; ".join(f"input {i}: {p}" for i, p in enumerate(parts))


def _metas(inputs: tuple, mesh: ProcessMesh) -> list:
    metas = []
    for t in inputs:
        if t is None:
            metas.append(None)
        elif t.is_dist():
            metas.append(TensorMeta(t._value.shape, t._value.dist_attr))
        else:
            metas.append(TensorMeta(tuple(t._value.shape), DistAttr.replicated(t.ndim,
                                                                                mesh.shape)))
    return metas


def _rule_result(op: OpDef, inputs: tuple, metas: list, attrs: dict, mesh: ProcessMesh):
    """(required input layouts, output metas) from the op's rule, or the replicated fallback
    (which cannot know output shapes: those come from the local outputs)."""
    if op.rule == FALLBACK_RULE:
        if op.name not in _WARNED:
            _WARNED.add(op.name)
            warnings.warn(f"{op.name} has no SPMD rule yet: its inputs are gathered to Replicate "
                          "(see disttensor.coverage_report())", stacklevel=5)
        return tuple(None if m is None else DistAttr.replicated(len(m.shape), mesh.shape)
                     for m in metas), None
    extra = op.rule_attrs(attrs) if callable(op.rule_attrs) else op.rule_attrs
    try:
        res = get_rule(op.rule)(tuple(metas), {**extra, **attrs, "op": op.name})
    except (ValueError, TypeError, IndexError) as e:  # same metadata, same error everywhere
        msg = str(e) if str(e).startswith(op.name) else f"{op.name}: {e}"
        raise type(e)(f"{msg} (distributed inputs: {describe_inputs(inputs, mesh)})") from e
    return res.inputs, tuple(TensorMeta(m.shape, canonical(m.dist_attr)) for m in res.outputs)


def reshard_instrs(plan, dtype, src: int, next_slot: int) -> tuple[list[Instr], int, int]:
    """Instructions running reshard ``plan`` on slot ``src``: (instrs, result slot, next free
    slot)."""
    instrs = []
    cur = src
    for step in prepare(plan, np.dtype(dtype)):
        instrs.append(Instr(step.kind, step.fn, (cur,), (next_slot,), label=step.label,
                            nbytes=step.nbytes, accepts_out=step.accepts_out))
        cur, next_slot = next_slot, next_slot + 1
    return instrs, cur, next_slot


def plan_call(op: OpDef, inputs: tuple, attrs: dict, mesh: ProcessMesh,
              inplace: tuple[int, int] | None = None, strides: tuple | None = None) -> Plan:
    """The plan of ``op(*inputs, **attrs)`` on this rank (see the module docstring).

    ``inplace``: the (input, output) pair of an ``op_`` call — the output is stored into that
    input in its own layout. ``strides``: the local (shape, strides) of input 0 for ops whose
    view is conditional (``view_if``)."""
    n_in = len(inputs)
    metas = _metas(inputs, mesh)
    in_attrs, out_metas = _rule_result(op, inputs, metas, attrs, mesh)
    in_dtypes = [None if t is None else np.dtype(t.dtype) for t in inputs]
    out_dtypes = op.out_dtypes(in_dtypes, attrs, [None if t is None else t.shape for t in inputs])
    n_out = len(out_dtypes) if op.n_out == -1 else op.n_out
    if out_metas is not None:
        n_out = len(out_metas)
        if len(out_dtypes) != n_out:
            out_dtypes = out_dtypes[:1] * n_out  # variable output count (split): one dtype
    if inplace is not None and out_metas is not None:
        ti, to = inplace
        if tuple(out_metas[to].shape) != tuple(inputs[ti].shape):
            raise ValueError(f"{op.name}_: the result shape {list(out_metas[to].shape)} differs "
                             f"from the shape {list(inputs[ti].shape)} of the tensor modified "
                             f"inplace ({describe_inputs(inputs)})")
    coord = coord_of(mesh)
    layouts = tuple(None if m is None else m.dist_attr for m in metas)
    if coord is None:
        return _outside_plan(op, inputs, attrs, out_metas, out_dtypes, mesh, layouts, inplace)
    if out_metas is None:
        out_metas = (None,) * n_out  # fallback rule: shapes come from the local results

    instrs: list[Instr] = []
    next_slot = n_in
    arg = list(range(n_in))
    req_metas = []
    for i, (t, m, want) in enumerate(zip(inputs, metas, in_attrs)):
        if m is None:
            req_metas.append(None)
            continue
        req_metas.append(TensorMeta(m.shape, want))
        if want is not None and m.dist_attr != want:
            rplan = plan_reshard(m.shape, in_dtypes[i].itemsize, mesh, m.dist_attr, mesh, want)
            if rplan.steps:
                more, arg[i], next_slot = reshard_instrs(rplan, in_dtypes[i], i, next_slot)
                instrs += more

    ctx = DistKernelCtx(tuple(req_metas), mesh, coord) if op.needs_ctx else None
    local = attrs
    if op.local_attrs is not None and out_metas[0] is not None:
        local = op.local_attrs(attrs, req_metas, out_metas, coord)
    mutated = dict((o, i) for i, o in op.mutates)
    out_slots = []
    for o in range(n_out):
        if o in mutated:
            out_slots.append(arg[mutated[o]])
        else:
            out_slots.append(next_slot)
            next_slot += 1
    writes = tuple(arg[i] for i, _ in op.mutates)
    # the inplace target: the kernel writes into it directly when it reads the target unmoved,
    # the op accepts out= and the result needs no reshard back
    direct_out = None
    if inplace is not None:
        ti, to = inplace
        tv = inputs[ti]._value
        same = tv.dist_attr is out_metas[to].dist_attr if inputs[ti].is_dist() else \
            out_metas[to].dist_attr.is_replicated()
        if same and op.accepts_out and n_out == 1 and out_dtypes[0] == in_dtypes[ti]:
            direct_out = ti
            out_slots[to] = ti
            writes = (ti,)
    kernel = _kernel_instr(op, local, ctx, tuple(arg), tuple(out_slots), writes, direct_out)
    instrs.append(kernel)

    stores: list[int] = []
    for i, o in op.mutates:  # write back mutated inputs that the kernel read resharded
        if arg[i] != i:
            more, next_slot = _store_back(inputs[i], metas[i], req_metas[i], arg[i], i,
                                          mesh, in_dtypes[i], next_slot)
            instrs += more
            stores.append(i)
    if inplace is not None and direct_out is None:
        ti, to = inplace
        src_meta = out_metas[to] if out_metas[to] is not None else \
            TensorMeta(tuple(inputs[ti].shape), canonical(DistAttr.replicated(
                inputs[ti].ndim, mesh.shape)))
        more, next_slot = _store_back(inputs[ti], metas[ti], src_meta, out_slots[to], ti, mesh,
                                      in_dtypes[ti], next_slot)
        instrs += more

    outputs = []
    for o in range(n_out):
        meta = out_metas[o]
        is_input = mutated.get(o)
        if inplace is not None and o == inplace[1]:
            is_input = inplace[0]
        src = op.view_source(o)
        view_of = arg[src] if src is not None and is_input is None and _is_view(
            op, strides if arg[src] == src else None, local) else None
        outputs.append(OutSpec(out_slots[o], None if meta is None else meta.shape,
                               out_dtypes[o], None if meta is None else meta.dist_attr,
                               view_of=view_of, is_input=is_input))
    writes_in = tuple(sorted({i for i, _ in op.mutates} | (
        {inplace[0]} if inplace is not None else set())))
    consumed = tuple((i, arg[i], req_metas[i].dist_attr) for i in range(n_in)
                     if arg[i] != i and i not in writes_in)
    return Plan(op, "dist", n_in, tuple(instrs), tuple(outputs), writes=writes_in, mesh=mesh,
                in_layouts=layouts, consumed=consumed)


def _is_view(op: OpDef, layout, attrs) -> bool:
    """Whether a ``view_if`` op's output is a view: always when the kernel reads a fresh
    (contiguous) temporary, else as the local piece's (shape, strides) allow."""
    return op.view_if is None or layout is None or op.view_if(layout[0], layout[1], attrs)


def _kernel_instr(op: OpDef, local: dict, ctx, args: tuple, outs: tuple, writes: tuple,
                  direct_out: int | None) -> Instr:
    """The kernel on the argument slots with its local attrs and context; ``direct_out``: the
    slot it writes its result into (``out=``)."""
    out_arg = None if direct_out is None else \
        (args.index(direct_out) if direct_out in args else 0)
    return Instr("kernel", op.kernel, args, outs, writes=writes, kwargs=local, ctx=ctx,
                 out_arg=out_arg, label=op.name,
                 collectives=tuple(ctx.collectives()) if ctx is not None else (),
                 accepts_out=op.accepts_out and not writes)


def _store_back(t, own_meta, src_meta, src_slot: int, dst_slot: int, mesh: ProcessMesh, dtype,
                next_slot: int) -> tuple[list[Instr], int]:
    """Instructions writing the value in ``src_slot`` (laid out as ``src_meta``) into input
    ``t``'s own buffer (``dst_slot``) in its own layout (a dense ``t``: Replicate)."""
    own = own_meta.dist_attr
    instrs: list[Instr] = []
    cur = src_slot
    if src_meta.dist_attr != own:
        rplan = plan_reshard(src_meta.shape, np.dtype(dtype).itemsize, mesh, src_meta.dist_attr,
                             mesh, own)
        more, cur, next_slot = reshard_instrs(rplan, dtype, src_slot, next_slot)
        instrs += more
    instrs.append(Instr("store", _store, (cur,), (), writes=(dst_slot,),
                        label=f"write back into input in {own.to_placements()}"))
    return instrs, next_slot


def _store(dst, src) -> None:
    dst[...] = src


def _outside_plan(op: OpDef, inputs: tuple, attrs: dict, out_metas, out_dtypes,
                  mesh: ProcessMesh, layouts: tuple, inplace) -> Plan:
    """A rank outside the mesh: empty pieces of the right global shapes, layouts and dtypes; a
    random op draws its seed like the members do, so every rank's generator stays in step."""
    if out_metas is None:
        raise ValueError(f"{op.name}: cannot tell the outputs of this op (no SPMD rule) on a "
                         f"rank outside {mesh}; give it a rule ({describe_inputs(inputs, mesh)})")
    n_in = len(inputs)
    mutated = dict((o, i) for i, o in op.mutates)
    if inplace is not None:
        mutated[inplace[1]] = inplace[0]
    fresh = [o for o in range(len(out_metas)) if o not in mutated]
    slots = {o: n_in + k for k, o in enumerate(fresh)}
    shapes = tuple((out_metas[o].shape, out_dtypes[o]) for o in fresh)

    draws = op.random and attrs.get("seed") is None

    def empty(xp, *arrays):
        if draws:
            default_generator.next_seed()
        like = next((a for a in arrays if a is not None), None)
        return tuple(empty_piece(s, d, like) for s, d in shapes)
    instrs = (Instr("empty", empty, tuple(range(n_in)), tuple(slots[o] for o in fresh),
                    label="empty pieces (rank outside the mesh)"),) if fresh else ()
    outputs = tuple(OutSpec(slots.get(o, mutated.get(o)), out_metas[o].shape, out_dtypes[o],
                            out_metas[o].dist_attr, is_input=mutated.get(o))
                    for o in range(len(out_metas)))
    return Plan(op, "dist", n_in, instrs, outputs, writes=(), mesh=mesh, in_layouts=layouts)
