"""The entry points of the distributed layer (Paddle-style names): ``shard_tensor``,
``reshard``, ``dtensor_from_local``, ``dtensor_to_local``, ``unshard_dtensor``, ``reshard_plan``,
``Tensor.numpy()`` (``shard_layer`` lives with the user layer in :mod:`disttensor.parallel`).

Each is a registered op (rule None: it plans itself) whose plan is built here and executed by
:func:`disttensor.dispatch.run`, the seam every tensor passes:

* ``reshard`` — the steps of :func:`spmd_rules.plan_reshard`, one instruction per collective or
  local step, with groups and sizes resolved (a copy when nothing moves);
* ``shard_tensor`` — one local instruction: this rank's slice of data every rank holds;
* ``dtensor_from_local`` — no instruction: the output *views* the local piece; the global shape
  is agreed on by one small all-gather of the pieces' shapes while planning;
* ``dtensor_to_local`` — no instruction: the output views this rank's piece.

All are differentiable where their dense meaning is: each is the identity on the global value,
so its gradient is the incoming gradient laid out like the input (a Partial input's pieces each
receive the whole gradient)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from collectives._common import CHECK_COLLECTIVES
from spmd_rules import (
    LOGICAL_REDUCE_TYPES,
    DistAttr,
    Partial,
    Placement,
    ProcessMesh,
    Replicate,
    ReshardPlan,
    Shard,
    local_shape,
    plan_reshard,
)

from ..dispatch import host_read, run
from ..dtype import to_np_dtype
from ..layout.dist_tensor import (
    _MESH_IDS,
    _MESHES,
    DistTensor,
    canonical,
    canonical_mesh,
    empty_piece,
)
from ..layout.mesh_groups import check_mesh, coord_of, group_over
from ..layout.planner import reshard_instrs
from ..layout.reshard import cut
from ..ops import cast, setitem, to_tensor
from ..ops.data_checks import flush_data_checks
from ..parameter import Parameter
from ..plan import Instr, OutSpec, Plan
from ..schema import OPS, public, register
from ..tape import _GradMode, set_grad_enabled
from ..tensor import Tensor, array_module
from .agreement import (
    broadcast_from,
    check_from_local,
    check_reshard,
    check_shard_tensor,
)

__all__ = ["shard_tensor", "reshard", "reshard_to", "reshard_plan", "dtensor_from_local",
           "dtensor_to_local", "unshard_dtensor", "numpy", "local_value"]


def _check_placements(op: str, mesh: ProcessMesh, placements: Sequence[Placement], ndim: int,
                      shape, dtype=None) -> DistAttr:
    """The DistAttr of ``placements`` for a tensor of ``shape``; Partial(any/all) only on bool
    tensors (``dtype`` given)."""
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{op}: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    check_mesh(mesh, op)
    placements = list(placements)
    for p in placements:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"{op}: placements {placements} contain {p!r}, which is not a "
                            "Shard, Replicate or Partial")
        if (dtype is not None and isinstance(p, Partial) and p.reduce_type in
                LOGICAL_REDUCE_TYPES and np.dtype(dtype) != np.bool_):
            raise ValueError(f"{op}: placements {placements}: {p!r} needs a bool tensor, got "
                             f"dtype {np.dtype(dtype).name} of shape {list(shape)}")
    try:
        return _layout_of(tuple(placements), ndim, mesh)
    except ValueError as e:
        raise ValueError(f"{op}: tensor of shape {list(shape)}: {e}") from None


@lru_cache(maxsize=1024)
def _layout_of(placements: tuple, ndim: int, mesh: ProcessMesh) -> DistAttr:
    """The interned DistAttr of ``placements`` (built once per distinct call)."""
    return canonical(DistAttr.from_placements(placements, ndim, mesh.shape))


def _dist_value(op: str, x: Tensor) -> DistTensor:
    if not isinstance(x, Tensor) or not x.is_dist():
        raise TypeError(f"{op}: x must be a distributed Tensor (made by shard_tensor), got "
                        f"{type(x).__name__ if not isinstance(x, Tensor) else 'a dense Tensor'}")
    return x._value


def _grad_avg_scale(attr: DistAttr) -> float:
    """A Partial(avg) input's pieces each get grad / n (n = product of its avg mesh dims)."""
    n = 1
    for m, r in attr.partial:
        if r.value == "avg":
            n *= attr.mesh_shape[m]
    return 1.0 / n


def _copy(arr, out=None):
    """A copy of ``arr`` (into ``out`` when given). Nothing moves when ``out`` is ``arr``'s own
    buffer: a memory plan gives a copy its input's bytes when the input dies there."""
    if out is None:
        return arr.copy()
    if not array_module(arr).may_share_memory(out, arr):
        out[...] = arr
    return out


# -- reshard -----------------------------------------------------------------------------------

_RESHARD_PLANS: dict = {}


def _reshard_plan(x: Tensor, mesh: ProcessMesh, attr: DistAttr) -> Plan:
    """The plan moving ``x`` (a dense ``x`` counts as Replicate on ``mesh``) to ``attr``."""
    v = x._value
    if type(v) is DistTensor:
        src_mesh, src_attr, shape, dtype = v.mesh, v.dist_attr, v.shape, v.dtype
    else:
        src_mesh, src_attr = mesh, DistAttr.replicated(x.ndim, mesh.shape)
        shape, dtype = tuple(v.array.shape), v.array.dtype
    key = (src_mesh, src_attr, shape, dtype, mesh, attr)
    plan = _RESHARD_PLANS.get(key)
    if plan is None:
        rplan = plan_reshard(shape, dtype.itemsize, src_mesh, src_attr, mesh, attr)
        dense_src = type(v) is not DistTensor
        if dense_src and coord_of(mesh) is None:  # a dense value outside the mesh: no piece
            instrs = [Instr("local", lambda a, s=shape: empty_piece(s, a.dtype, a), (0,), (1,),
                            label="empty piece (rank outside the mesh)")]
            out = 1
        else:
            instrs, out, _ = reshard_instrs(rplan, dtype, 0, 1)
        if not instrs:  # nothing moves: reshard still returns a new tensor
            instrs, out = [Instr("local", _copy, (0,), (1,), label="copy (layout unchanged)",
                                 accepts_out=True)], 1
        plan = Plan(OPS["reshard"], "dist", 1, tuple(instrs),
                    (OutSpec(out, shape, dtype, canonical(attr)),), mesh=canonical_mesh(mesh),
                    in_layouts=(src_attr,))
        if len(_RESHARD_PLANS) >= 4096:
            del _RESHARD_PLANS[next(iter(_RESHARD_PLANS))]
        _RESHARD_PLANS[key] = plan
    return plan


def _reshard_bwd(node, g):
    # The gradient of the global value. On the same mesh it stays in the layout it arrives in
    # (sharded gradients stay sharded; the leaf, or the next op's rule, decides where it must
    # move), across meshes it goes back to the input's mesh laid out like the input without its
    # Partial dims. No Partial(avg) scaling here: that belongs where the addends themselves are
    # the variables (dtensor_from_local's backward).
    src_mesh, src_attr = node.attrs["src_mesh"], node.attrs["src_attr"]
    if src_attr is None:  # the input was dense: its gradient is the replicated value
        return _to_local(reshard_to(g, g._value.mesh, DistAttr.replicated(
            g.ndim, g._value.mesh.shape)))
    if g.is_dist() and g._value.mesh == src_mesh:
        return g
    return reshard_to(g, src_mesh, src_attr.without_partial())


register("reshard", None, rule=None, backward=_reshard_bwd)


def reshard_to(x: Tensor, mesh: ProcessMesh, attr: DistAttr, plan: Plan | None = None) -> Tensor:
    """``x`` laid out as ``attr`` on ``mesh`` (Partial targets included): always a new tensor.
    ``plan``: the one :func:`_reshard_plan` gives, when the caller has it already."""
    v = x._value
    src = (v.mesh, v.dist_attr) if type(v) is DistTensor else (None, None)
    return run(plan or _reshard_plan(x, mesh, attr), (x,),
               {"mesh": mesh, "dist_attr": attr, "src_mesh": src[0], "src_attr": src[1]})


def reshard_plan(x: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> ReshardPlan:
    """The plan ``reshard(x, mesh, placements)`` would run (print it to see the steps)."""
    v = _dist_value("reshard", x)
    attr = _check_placements("reshard", mesh, placements, x.ndim, x.shape, v.dtype)
    return plan_reshard(v.shape, np.dtype(v.dtype).itemsize, v.mesh, v.dist_attr, mesh, attr)


#: resolved reshard calls: (source mesh, layout, shape, dtype, target mesh, placements) ->
#: (target layout, plan); meshes and layouts by the id of their interned instance. A call found
#: here was checked and agreed on before, so it skips both (not in debug mode).
_RESHARD_CALLS: dict = {}


def _call_key(v: DistTensor, interned_mesh: ProcessMesh, placements: tuple) -> tuple:
    return (id(v.mesh), id(v.dist_attr), v.shape, v.dtype, id(interned_mesh), placements)


@public()
def reshard(x: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> Tensor:
    """``x`` laid out as ``placements`` on ``mesh`` (a new tensor; collectives as planned).

    Partial targets keep the global value: from Replicate (or Shard) the value stays on
    coordinate 0 of each new Partial mesh dim (its own block, for Shard) and the reduction's
    identity fills the rest, Partial(sum) <-> Partial(avg) rescales locally, and a Partial
    source to its own placements is a copy."""
    v = x._value if isinstance(x, Tensor) else None
    if type(v) is DistTensor and not CHECK_COLLECTIVES:
        try:
            placements = tuple(placements)
            m = mesh if id(mesh) in _MESH_IDS else _MESHES.get(mesh)
            hit = m is not None and _RESHARD_CALLS.get(_call_key(v, m, placements))
        except TypeError:  # unhashable arguments: the checks below name them
            hit = None
        if hit:
            return reshard_to(x, mesh, *hit)
    v = _dist_value("reshard", x)
    attr = _check_placements("reshard", mesh, placements, x.ndim, x.shape, v.dtype)
    check_reshard(v, mesh, attr)
    plan = _reshard_plan(x, mesh, attr)
    if type(placements) is tuple and not CHECK_COLLECTIVES:
        if len(_RESHARD_CALLS) >= 4096:
            del _RESHARD_CALLS[next(iter(_RESHARD_CALLS))]
        _RESHARD_CALLS[_call_key(v, canonical_mesh(mesh), placements)] = (attr, plan)
    return reshard_to(x, mesh, attr, plan)


# -- creation and conversion -----------------------------------------------------------------

def _shard_bwd(node, g):
    return unshard_dtensor(g) if g.is_dist() else g


register("shard_tensor", None, rule=None, backward=_shard_bwd)


def _slicer(shape, attr: DistAttr, coord):
    """A C-contiguous copy of this rank's slice of the global array (np.array keeps 0-d;
    a strided shard's piece is its ranges concatenated)."""
    def take(a):
        return array_module(a).array(cut(a, shape, attr, coord), copy=True, order="C")
    return take


def _shard_plan(src: Tensor, mesh: ProcessMesh, attr: DistAttr) -> Plan:
    """This rank's slice of ``src``; Partial mesh dims then keep the value on coordinate 0 and
    the reduction's identity elsewhere (Replicate -> Partial, no communication)."""
    arr = src._value.array
    shape = tuple(arr.shape)
    coord = coord_of(mesh)
    plain = attr.without_partial()
    if coord is None:
        fn = lambda a: empty_piece(shape, a.dtype, a)  # noqa: E731
        label = "empty piece (rank outside the mesh)"
    else:
        fn, label = _slicer(shape, plain, coord), f"slice of {plain.to_placements()}"
    instrs = [Instr("local", fn, (0,), (1,), label=label)]
    out = 1
    if attr.partial and coord is not None:
        more, out, _ = reshard_instrs(plan_reshard(shape, arr.dtype.itemsize, mesh, plain, mesh,
                                                   attr), arr.dtype, 1, 2)
        instrs += more
    return Plan(OPS["shard_tensor"], "dist", 1, tuple(instrs),
                (OutSpec(out, shape, arr.dtype, canonical(attr)),), mesh=canonical_mesh(mesh))


@public()
def shard_tensor(data: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: Any = None,
                 place: str | None = None, stop_gradient: bool | None = None,
                 src_rank: int | None = None) -> Tensor:
    """A distributed tensor from data that every rank holds (this rank keeps its slice). A
    leaf that needs grad (a parameter) stays a leaf; a non-leaf stays differentiable.

    The mesh's ranks agree on (global shape, dtype, mesh, placements) with one small
    collective the first time they meet them. ``src_rank=k`` takes the data from rank ``k``
    (an array there; ignored, and may be None, elsewhere)."""
    if isinstance(data, Tensor) and data.is_dist():
        raise ValueError("shard_tensor: data is already distributed; use reshard")
    if src_rank is not None:
        data = broadcast_from(data.numpy() if isinstance(data, Tensor) else data, int(src_rank),
                              mesh, "shard_tensor")
    src = data if isinstance(data, Tensor) else None
    if src is None:
        src = to_tensor(data, dtype=dtype, place=place)
    elif dtype is not None and np.dtype(src.dtype) != to_np_dtype(dtype):
        src = cast(src, dtype)
    attr = _check_placements("shard_tensor", mesh, placements, src.ndim, src.shape, src.dtype)
    check_shard_tensor(mesh, attr, src._value.array)
    sg = src.stop_gradient if stop_gradient is None else bool(stop_gradient)
    differentiable = src._node is not None and not src.stop_gradient and _GradMode.enabled
    out = run(_shard_plan(src, mesh, attr), (src,), {"mesh": mesh, "dist_attr": attr},
              needs_grad=differentiable)
    if isinstance(src, Parameter):  # a sharded parameter is still a parameter (a leaf)
        param = Parameter(out._value, name=src.name, trainable=not sg)
        param.optimize_attr = dict(src.optimize_attr)
        return param
    out.name, out.persistable = src.name, src.persistable
    out.stop_gradient = sg
    return out


def _from_local_bwd(node, g):
    mesh, attr = node.attrs["mesh"], node.attrs["dist_attr"]
    if not g.is_dist():
        g = reshard_to(g, mesh, DistAttr.replicated(g.ndim, mesh.shape))
    out = _to_local(reshard_to(g, mesh, attr.without_partial()))
    scale = _grad_avg_scale(attr)
    return out if scale == 1.0 else out * scale


register("dtensor_from_local", None, rule=None, backward=_from_local_bwd)

_MAX_NDIM = 16


def _gather_piece_metas(mesh: ProcessMesh, arr) -> list[tuple]:
    """(mesh coord, local shape, dtype) of every member, by one small all-gather of int64s."""
    if arr.ndim > _MAX_NDIM:
        raise ValueError(f"dtensor_from_local: at most {_MAX_NDIM} dims are supported")
    row = np.full((1, 2 + _MAX_NDIM), -1, dtype=np.int64)
    row[0, 0], row[0, 1] = arr.ndim, ord(np.dtype(arr.dtype).char)
    row[0, 2:2 + arr.ndim] = arr.shape
    ranks = mesh.process_ids
    rows = row if len(ranks) == 1 else group_over(mesh, tuple(range(mesh.ndim))).all_gather(row)
    return [(mesh.get_coord(r), tuple(int(v) for v in rec[2:2 + int(rec[0])]),
             np.dtype(chr(int(rec[1]))).str) for r, rec in zip(ranks, rows)]


def _global_shape_from_pieces(metas, attr: DistAttr, shape) -> tuple[int, ...]:
    """Check the gathered (coord, local shape, dtype) records and return the global shape."""
    dtypes = {d for _, _, d in metas}
    if len(dtypes) > 1:
        raise ValueError(f"dtensor_from_local: local pieces have different dtypes "
                         f"{sorted(np.dtype(d).name for d in dtypes)}")
    ndim = len(metas[0][1])
    if any(len(s) != ndim for _, s, _ in metas):
        raise ValueError(f"dtensor_from_local: local pieces have different ranks: "
                         f"{[list(s) for _, s, _ in metas]}")
    if shape is None:
        # Each tensor dim: sum of the piece sizes along its sharding mesh dims (others at 0).
        shape = []
        for d, dm in enumerate(attr.dims_mapping):
            shape.append(sum(s[d] for c, s, _ in metas
                             if all(c[m] == 0 for m in range(len(c)) if m not in dm)))
    shape = tuple(int(s) for s in shape)
    for c, s, _ in metas:
        want = local_shape(shape, attr, c) if len(shape) == ndim else None
        if want != tuple(s):
            raise ValueError(f"dtensor_from_local: the piece at mesh coordinate {list(c)} has "
                             f"shape {list(s)} but global shape {list(shape)} with placements "
                             f"{attr.to_placements()} needs {None if want is None else list(want)}")
    return shape


def _view_plan(op: str, dtype, shape, mesh, attr, n_in: int = 1) -> Plan:
    """A plan with no instruction whose output views input 0 (dist when ``mesh`` is given)."""
    spec = OutSpec(0, shape, dtype, None if attr is None else canonical(attr), view_of=0)
    return Plan(OPS[op], "dist" if mesh is not None else "dense", n_in, (), (spec,),
                mesh=None if mesh is None else canonical_mesh(mesh))


def _from_local(t: Tensor, mesh: ProcessMesh, attr: DistAttr, shape) -> Tensor:
    """The distributed tensor of global ``shape`` whose piece here is ``t`` (no checks)."""
    return run(_view_plan("dtensor_from_local", t.dtype, tuple(shape), mesh, attr), (t,),
               {"mesh": mesh, "dist_attr": attr, "shape": tuple(shape)})


@public()
def dtensor_from_local(local: Any, mesh: ProcessMesh, placements: Sequence[Placement],
                       shape: Sequence[int] | None = None) -> Tensor:
    """A distributed tensor whose piece on this rank is ``local`` (uneven pieces allowed); it
    shares a dense Tensor's buffer, and holds a copy of an array (as ``to_tensor`` makes).

    One small all-gather of (local shape, dtype) over the mesh checks that the pieces form the
    global shape (given, or found from the pieces) and raises the same error on every rank."""
    t = local if isinstance(local, Tensor) else to_tensor(np.asarray(local))
    if t.is_dist():
        raise ValueError("dtensor_from_local: local is already distributed")
    arr = t._value.array
    attr = _check_placements("dtensor_from_local", mesh, placements, arr.ndim, arr.shape,
                             arr.dtype)
    if coord_of(mesh) is None:
        # A rank outside the mesh takes no part in the (mesh-wide) check and holds an empty
        # piece; it can only know the global shape when it is given.
        if shape is None:
            raise ValueError(f"dtensor_from_local: this rank is not in {mesh}; pass shape= to "
                             "get an empty piece of the global tensor here")
        gshape = tuple(int(s) for s in shape)
        if len(gshape) != arr.ndim:
            raise ValueError(f"dtensor_from_local: shape {list(gshape)} has {len(gshape)} dims "
                             f"but the local value has {arr.ndim}")
        empty = to_tensor(empty_piece(gshape, arr.dtype, arr))
        return _from_local(empty, mesh, attr, gshape)
    check_from_local(mesh, attr, shape)
    gshape = _global_shape_from_pieces(_gather_piece_metas(mesh, arr), attr, shape)
    return _from_local(t, mesh, attr, gshape)


def _to_local_bwd(node, g):
    return _from_local(g, node.attrs["mesh"], node.attrs["dist_attr"].without_partial(),
                       node.attrs["shape"])


register("dtensor_to_local", None, rule=None, backward=_to_local_bwd)


def _to_local(x: Tensor) -> Tensor:
    v = x._value
    return run(_view_plan("dtensor_to_local", v.dtype, None, None, None), (x,),
               {"mesh": v.mesh, "dist_attr": v.dist_attr, "shape": v.shape})


@public()
def dtensor_to_local(x: Tensor, mesh: ProcessMesh | None = None,
                     placements: Sequence[Placement] | None = None) -> Tensor:
    """This rank's piece as a dense tensor sharing the buffer (differentiable).

    Paddle's three-argument form ``dtensor_to_local(x, mesh, placements)`` names the layout
    whose piece is wanted: x's own (the usual case: no communication), or another one that x
    is resharded to first."""
    v = _dist_value("dtensor_to_local", x)
    if (mesh is None) != (placements is None):
        raise ValueError("dtensor_to_local: pass both mesh and placements, or neither")
    if mesh is not None:
        attr = _check_placements("dtensor_to_local", mesh, placements, x.ndim, x.shape, v.dtype)
        if mesh != v.mesh or attr != v.dist_attr:
            x = reshard_to(x, mesh, attr)
    flush_data_checks()  # the piece leaves the runtime: pending data checks agree first
    return _to_local(x)


@public(methods=("_local_value",), export=False)
def local_value(x: Tensor) -> Tensor:
    """``x._local_value()``: this rank's piece as a dense tensor sharing its buffer, outside
    autograd (a dense ``x`` is returned itself)."""
    if not x.is_dist():
        return x
    flush_data_checks()  # the piece leaves the runtime: pending data checks agree first
    with set_grad_enabled(False):
        return _to_local(x)


@public()
def unshard_dtensor(x: Tensor) -> Tensor:
    """The global value as a dense tensor on every rank of the mesh (differentiable)."""
    v = _dist_value("unshard_dtensor", x)
    return _to_local(reshard_to(x, v.mesh, DistAttr.replicated(x.ndim, v.mesh.shape)))


@public(methods=("set_value",), export=False)
def set_value(x: Tensor, value: Any) -> Tensor:
    """``x.set_value(value)`` (Paddle): replace x's data by ``value`` (a Tensor, array or
    nested list of x's global shape, cast to x's dtype) outside autograd: x keeps its
    identity, buffer, mesh and placements (the usual way to load weights into a parameter).
    A dense ``value`` for a distributed ``x`` is the global value: each rank keeps its slice."""
    vshape = list(value.shape) if isinstance(value, Tensor) else list(np.shape(value))
    if vshape != list(x.shape):
        raise ValueError(f"set_value: value of shape {vshape} does not match the tensor's "
                         f"shape {list(x.shape)}")
    if not isinstance(value, Tensor):
        value = to_tensor(np.asarray(value), dtype=x.dtype)
    elif value.dtype != x.dtype:
        value = cast(value, x.dtype)
    with set_grad_enabled(False):
        setitem(x, Ellipsis, value)
    return x


@public(methods=True, export=False)
def numpy(x: Tensor) -> np.ndarray:
    """The (global) value as a numpy array. On a distributed tensor this is a collective: every
    rank of the mesh must call it."""
    host_read("Tensor.numpy()")
    v = x._value
    if type(v) is DistTensor:
        if coord_of(v.mesh) is None:
            raise ValueError(f"numpy: this rank is not in {v.mesh}; only its members hold the "
                             "tensor (reshard it to a mesh that contains this rank)")
        attr = v.dist_attr
        if attr.partial or any(attr.dims_mapping):
            with set_grad_enabled(False):
                rep = reshard_to(x, v.mesh, DistAttr.replicated(len(v.shape), v.mesh.shape))
            arr = rep._value.local.array
            return arr if isinstance(arr, np.ndarray) else arr.get()
        v = v.local  # replicated: the piece is the value
    arr = v.array
    return arr.copy() if isinstance(arr, np.ndarray) else arr.get()
