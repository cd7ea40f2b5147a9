"""The public distributed API (Paddle-style names): shard_tensor, reshard, dtensor_from_local,
dtensor_to_local, unshard_dtensor, reshard_plan, and Tensor.numpy() for distributed tensors.

All of them are differentiable where their dense meaning is: each is the identity on the global
value, so its gradient is the incoming gradient laid out like the input (a Partial input's
pieces each receive the whole gradient)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from spmd_rules import DistAttr, Partial, Placement, ProcessMesh, Replicate, Shard, local_slices

from ..autograd import _GradMode, record
from ..dtype import to_np_dtype
from ..ops.registry import OpDef
from ..tensor import DenseTensor, Tensor, array_module
from .dist_tensor import DistTensor, empty_piece
from .mesh_groups import check_mesh, coord_of, group_over
from spmd_rules import ReshardPlan, plan_reshard

from .reshard import execute


def _check_placements(op: str, mesh: ProcessMesh, placements: Sequence[Placement], ndim: int,
                      shape, allow_partial: bool) -> DistAttr:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{op}: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    check_mesh(mesh, op)
    placements = list(placements)
    for p in placements:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"{op}: placements {placements} contain {p!r}, which is not a "
                            "Shard, Replicate or Partial")
        if isinstance(p, Partial) and not allow_partial:
            raise ValueError(f"{op}: placements {placements} contain Partial; a tensor can only "
                             "become Partial as the output of an op (use dtensor_from_local to "
                             "build one from per-rank addends)")
    try:
        return DistAttr.from_placements(placements, ndim, mesh.shape)
    except ValueError as e:
        raise ValueError(f"{op}: tensor of shape {list(shape)}: {e}") from None


def _make(arr, mesh: ProcessMesh, attr: DistAttr, shape, holder=None) -> DistTensor:
    return DistTensor(DenseTensor(arr, holder), mesh, attr, tuple(shape))


def _nonpartial(attr: DistAttr) -> DistAttr:
    return attr.without_partial()


def _grad_avg_scale(attr: DistAttr) -> float:
    """A Partial(avg) input's pieces each get grad / n (n = product of its avg mesh dims)."""
    n = 1
    for m, r in attr.partial:
        if r.value == "avg":
            n *= attr.mesh_shape[m]
    return 1.0 / n


# -- reshard ---------------------------------------------------------------------------------

def reshard_plan(x: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> ReshardPlan:
    """The plan ``reshard(x, mesh, placements)`` would run (print it to see the steps)."""
    attr = _check_placements("reshard", mesh, placements, x.ndim, x.shape, allow_partial=True)
    v = _dist_value("reshard", x)
    return plan_reshard(v.shape, np.dtype(v.dtype).itemsize, v.mesh, v.dist_attr, mesh, attr)


def _dist_value(op: str, x: Tensor) -> DistTensor:
    if not isinstance(x, Tensor) or not x.is_dist():
        raise TypeError(f"{op}: x must be a distributed Tensor (made by shard_tensor), got "
                        f"{type(x).__name__ if not isinstance(x, Tensor) else 'a dense Tensor'}")
    return x._value


def reshard_value(v: DistTensor, mesh: ProcessMesh, attr: DistAttr) -> DistTensor:
    """``v`` moved to ``attr`` on ``mesh`` (no autograd); ``v`` itself if nothing changes."""
    if v.mesh == mesh and v.dist_attr == attr:
        return v
    plan = plan_reshard(v.shape, np.dtype(v.dtype).itemsize, v.mesh, v.dist_attr, mesh, attr)
    arr = execute(plan, v.local.array, v.dtype)
    return _make(arr, mesh, attr, v.shape)


def _reshard_bwd(node, g):
    # The gradient of the global value, laid out like the input without its Partial dims. No
    # Partial(avg) scaling here: that belongs where the addends themselves are the variables
    # (dtensor_from_local's backward); scaling here too divided by n twice.
    src_mesh, src_attr = node.attrs["src_mesh"], node.attrs["src_attr"]
    return _reshard_tensor(g, src_mesh, _nonpartial(src_attr))


_RESHARD = OpDef("reshard", kernel=None, backward=_reshard_bwd)


def _reshard_tensor(x: Tensor, mesh: ProcessMesh, attr: DistAttr) -> Tensor:
    v = x._value if x.is_dist() else _replicated_value(x, mesh)
    new = reshard_value(v, mesh, attr)
    # always a new tensor: a copy when the layout already matches
    out = Tensor(new if new is not v else _make(v.local.array.copy(), mesh, attr, v.shape))
    if _GradMode.enabled and not x.stop_gradient:
        record(_RESHARD, {"src_mesh": v.mesh, "src_attr": v.dist_attr}, (x,), (out,))
    return out


def _replicated_value(x: Tensor, mesh: ProcessMesh) -> DistTensor:
    """A dense tensor seen as Replicate on ``mesh`` (the same array on every rank)."""
    arr = x._value.array
    attr = DistAttr.replicated(x.ndim, mesh.shape)
    if coord_of(mesh) is None:
        return DistTensor(DenseTensor(empty_piece(arr.shape, arr.dtype, arr)), mesh, attr,
                          arr.shape)
    return DistTensor(x._value, mesh, attr, arr.shape)


def reshard(x: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> Tensor:
    """``x`` laid out as ``placements`` on ``mesh`` (a new tensor; collectives as planned).
    Resharding to Partial is refused, as in user code a Partial layout only comes from ops."""
    attr = _check_placements("reshard", mesh, placements, x.ndim, x.shape, allow_partial=False)
    _dist_value("reshard", x)
    return _reshard_tensor(x, mesh, attr)


# -- creation and conversion -----------------------------------------------------------------

def _shard_bwd(node, g):
    return unshard_dtensor(g) if g.is_dist() else g


_SHARD = OpDef("shard_tensor", kernel=None, backward=_shard_bwd)


def shard_tensor(data: Any, mesh: ProcessMesh, placements: Sequence[Placement], dtype: Any = None,
                 place: str | None = None, stop_gradient: bool | None = None) -> Tensor:
    """A distributed tensor from data that every rank holds (this rank keeps its slice, no
    communication). A leaf that needs grad (a parameter) stays a leaf; a non-leaf stays
    differentiable."""
    if isinstance(data, Tensor) and data.is_dist():
        raise ValueError("shard_tensor: data is already distributed; use reshard")
    src = data if isinstance(data, Tensor) else None
    if src is None:
        from ..tensor import to_tensor

        src = to_tensor(data, dtype=dtype, place=place)
    elif dtype is not None and np.dtype(src.dtype) != to_np_dtype(dtype):
        from ..ops import cast

        src = cast(src, dtype)
    attr = _check_placements("shard_tensor", mesh, placements, src.ndim, src.shape,
                             allow_partial=False)
    arr = src._value.array
    coord = coord_of(mesh)
    # a C-contiguous copy of this rank's slice (np.array keeps 0-d arrays 0-d)
    local = empty_piece(arr.shape, arr.dtype, arr) if coord is None else \
        array_module(arr).array(arr[local_slices(arr.shape, attr, coord)], copy=True, order="C")
    sg = src.stop_gradient if stop_gradient is None else bool(stop_gradient)
    from ..nn.layer import Parameter

    if isinstance(src, Parameter):  # a sharded parameter is still a parameter (a leaf)
        out = Parameter(_make(local, mesh, attr, arr.shape), name=src.name, trainable=not sg)
        out.optimize_attr = dict(src.optimize_attr)
    else:
        out = Tensor(_make(local, mesh, attr, arr.shape))
        out.name, out.persistable = src.name, src.persistable
    if src._node is not None and not src.stop_gradient and _GradMode.enabled:
        record(_SHARD, {}, (src,), (out,))
    out.stop_gradient = sg
    return out


def _from_local_bwd(node, g):
    mesh, attr = node.attrs["mesh"], node.attrs["attr"]
    gv = g._value if g.is_dist() else _replicated_value(g, mesh)
    gv = reshard_value(gv, mesh, _nonpartial(attr))
    scale = _grad_avg_scale(attr)
    out = Tensor(DenseTensor(gv.local.array))
    return out if scale == 1.0 else out * scale


_FROM_LOCAL = OpDef("dtensor_from_local", kernel=None, backward=_from_local_bwd)


def dtensor_from_local(local: Any, mesh: ProcessMesh, placements: Sequence[Placement],
                       shape: Sequence[int] | None = None) -> Tensor:
    """A distributed tensor whose piece on this rank is ``local`` (uneven pieces allowed).

    One small all-gather of (local shape, dtype) over the mesh checks that the pieces form the
    global shape (given, or found from the pieces) and raises the same error on every rank."""
    t = local if isinstance(local, Tensor) else Tensor(DenseTensor(np.asarray(local)))
    if t.is_dist():
        raise ValueError("dtensor_from_local: local is already distributed")
    arr = t._value.array
    attr = _check_placements("dtensor_from_local", mesh, placements, arr.ndim, arr.shape,
                             allow_partial=True)
    coord = coord_of(mesh)
    if coord is None:
        # A rank outside the mesh takes no part in the (mesh-wide) check and holds an empty
        # piece; it can only know the global shape when it is given.
        if shape is None:
            raise ValueError(f"dtensor_from_local: this rank is not in {mesh}; pass shape= to "
                             "get an empty piece of the global tensor here")
        shape = tuple(int(s) for s in shape)
        if len(shape) != arr.ndim:
            raise ValueError(f"dtensor_from_local: shape {list(shape)} has {len(shape)} dims but "
                             f"the local value has {arr.ndim}")
        return Tensor(_make(empty_piece(shape, arr.dtype, arr), mesh, attr, shape))
    metas = _gather_piece_metas(mesh, arr)
    gshape = _global_shape_from_pieces(metas, attr, shape)
    out = Tensor(_make(arr, mesh, attr, gshape, t._value.holder))
    if _GradMode.enabled and not t.stop_gradient:
        record(_FROM_LOCAL, {"mesh": mesh, "attr": attr}, (t,), (out,))
    return out


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
        want = tuple(sl.stop - sl.start for sl in local_slices(shape, attr, c)) \
            if len(shape) == ndim else None
        if want != tuple(s):
            raise ValueError(f"dtensor_from_local: the piece at mesh coordinate {list(c)} has "
                             f"shape {list(s)} but global shape {list(shape)} with placements "
                             f"{attr.to_placements()} needs {None if want is None else list(want)}")
    return shape


def _to_local_bwd(node, g):
    mesh, attr, shape = node.attrs["mesh"], node.attrs["attr"], node.attrs["shape"]
    return Tensor(_make(g._value.array, mesh, _nonpartial(attr), shape))


_TO_LOCAL = OpDef("dtensor_to_local", kernel=None, backward=_to_local_bwd)


def dtensor_to_local(x: Tensor) -> Tensor:
    """This rank's piece as a dense tensor sharing the buffer (differentiable)."""
    v = _dist_value("dtensor_to_local", x)
    out = Tensor(v.local.view(v.local.array))
    if _GradMode.enabled and not x.stop_gradient:
        record(_TO_LOCAL, {"mesh": v.mesh, "attr": v.dist_attr, "shape": v.shape}, (x,), (out,))
    return out


def unshard_dtensor(x: Tensor) -> Tensor:
    """The global value as a dense tensor on every rank of the mesh (differentiable)."""
    v = _dist_value("unshard_dtensor", x)
    rep = _reshard_tensor(x, v.mesh, DistAttr.replicated(x.ndim, v.mesh.shape))
    out = Tensor(DenseTensor(rep._value.local.array))
    if _GradMode.enabled and not rep.stop_gradient:
        record(_TO_LOCAL, {"mesh": v.mesh, "attr": rep._value.dist_attr, "shape": v.shape},
               (rep,), (out,))
    return out


def _global_numpy(x: Tensor) -> np.ndarray:
    """Tensor.numpy() of a distributed tensor: the global array (a collective over the mesh)."""
    v = x._value
    if coord_of(v.mesh) is None:
        raise ValueError(f"numpy: this rank is not in {v.mesh}; only its members hold the "
                         "tensor (reshard it to a mesh that contains this rank)")
    rep = reshard_value(v, v.mesh, DistAttr.replicated(len(v.shape), v.mesh.shape))
    arr = rep.local.array
    out = arr if isinstance(arr, np.ndarray) else arr.get()
    return out.copy() if rep is v else out


def shard_layer(layer, process_mesh: ProcessMesh, shard_fn=None):
    """Distribute ``layer``'s parameters and buffers in place (Paddle's ``shard_layer``).

    ``shard_fn(name, sublayer, process_mesh)`` is called for every sublayer (the layer itself
    included, name "" ) and may replace its parameters with ``shard_tensor(...)`` results;
    whatever is still dense afterwards is replicated on ``process_mesh``."""
    for name, sub in layer.named_sublayers(include_self=True):
        if shard_fn is not None:
            shard_fn(name, sub, process_mesh)
        for pname, p in list(sub._parameters.items()):
            if p is not None and not p.is_dist():
                setattr(sub, pname, shard_tensor(p, process_mesh,
                                                 [Replicate()] * len(process_mesh.shape)))
        for bname, b in list(sub._buffers.items()):
            if b is not None and not b.is_dist():
                setattr(sub, bname, shard_tensor(b, process_mesh,
                                                 [Replicate()] * len(process_mesh.shape)))
    return layer
