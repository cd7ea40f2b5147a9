"""PyTorch DTensor names as thin aliases: ``distribute_tensor``, ``DTensor.from_local``, the
Tensor methods ``to_local``/``full_tensor``/``redistribute``/``device_mesh``, and tensor
parallelism with ``parallelize_module`` and ``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``.

Layout note: a disttensor ``Linear`` weight is ``[in, out]`` (Paddle's layout), PyTorch's is
``[out, in]``; the styles shard the same logical axis (column parallel: the output features).
"""
from __future__ import annotations

import fnmatch
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

import collectives
from spmd_rules import Placement, ProcessMesh, Replicate, Shard

from ..autograd import no_grad
from ..distributed.api import (
    dtensor_from_local,
    dtensor_to_local,
    reshard,
    reshard_to,
    shard_tensor,
    unshard_dtensor,
)
from ..layout.mesh_groups import get_rank
from ..nn.common import Embedding, Linear
from ..nn.layer import Layer, Parameter
from ..ops import to_tensor
from ..tensor import Tensor
from .mesh import DeviceMesh, get_mesh
from .sharding import dp_layout

__all__ = ["DTensor", "distribute_tensor", "parallelize_module", "ParallelStyle",
           "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "fully_shard",
           "TENSOR_METHODS"]


def _placements(fn: str, placements: Any, ndim: int) -> list[Placement]:
    pl = [placements] if isinstance(placements, (Shard, Replicate)) else list(placements)
    for p in pl:
        if not isinstance(p, Placement):
            raise TypeError(f"{fn}: placements {placements!r} contain {p!r}, which is not a "
                            "placement")
    return pl


def distribute_tensor(tensor: Any, device_mesh: ProcessMesh | None = None,
                      placements: Sequence[Placement] | None = None,
                      src_data_rank: int | None = 0) -> Tensor:
    """A distributed tensor of ``tensor``'s value taken from ONE member of the mesh (PyTorch's
    ``distribute_tensor``): the member at position ``src_data_rank`` of
    ``device_mesh.process_ids`` (default the first) broadcasts its value over the mesh and each
    rank keeps its slice; ``src_data_rank=None`` uses each rank's own value (no communication,
    like ``shard_tensor``). ``placements`` default to Replicate. A Parameter stays a Parameter
    (its dense value is overwritten with the source rank's first).

    Collective: one broadcast over the mesh (when ``src_data_rank`` is not None).

    Example::

        w = dt.distribute_tensor(np.random.rand(8, 4), mesh, [dt.Shard(0)])   # rank 0's data
    """
    fn = "distribute_tensor"
    mesh = device_mesh if device_mesh is not None else get_mesh()
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{fn}: device_mesh must be a ProcessMesh/DeviceMesh, got "
                        f"{type(mesh).__name__}")
    t = tensor if isinstance(tensor, Tensor) else to_tensor(tensor)
    if t.is_dist():
        raise ValueError(f"{fn}: tensor is already distributed; use redistribute")
    pl = [Replicate()] * mesh.ndim if placements is None else \
        _placements(fn, placements, t.ndim)
    if src_data_rank is not None:
        ids = mesh.process_ids
        if isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int) \
                or not 0 <= src_data_rank < len(ids):
            raise ValueError(f"{fn}: src_data_rank must be a position in the mesh's "
                             f"{len(ids)} ranks, got {src_data_rank!r}")
        if get_rank() in ids and len(ids) > 1:
            value = collectives.new_group(ids).broadcast(t.numpy(), src=src_data_rank)
            if isinstance(t, Parameter):
                with no_grad():
                    t.copy_(to_tensor(value, dtype=t.dtype, place=t.place))
            else:
                t = to_tensor(value, place=t.place)
    return shard_tensor(t, mesh, pl)


class _DTensorMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Tensor) and obj.is_dist()


class DTensor(metaclass=_DTensorMeta):
    """PyTorch's ``DTensor`` name: ``isinstance(x, DTensor)`` is true for distributed
    tensors, and :meth:`from_local` builds one from per-rank pieces.

    Example::

        x = dt.DTensor.from_local(np.ones((2, 3)), mesh, [dt.Shard(0)])
        assert isinstance(x, dt.DTensor)
    """

    @staticmethod
    def from_local(local_tensor: Any, device_mesh: ProcessMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None, stride: Any = None) -> Tensor:
        """A distributed tensor whose piece on this rank is ``local_tensor``
        (``dtensor_from_local``; placements default to Replicate). The pieces' shapes are
        always checked (one small all-gather); ``run_check`` and ``stride`` are accepted for
        compatibility.

        Example::

            x = dt.DTensor.from_local(np.ones((2, 3)), mesh, [dt.Shard(0)])  # [2n, 3]
        """
        mesh = device_mesh if device_mesh is not None else get_mesh()
        if not isinstance(mesh, ProcessMesh):
            raise TypeError("DTensor.from_local: device_mesh must be a ProcessMesh/DeviceMesh, "
                            f"got {type(mesh).__name__}")
        pl = [Replicate()] * mesh.ndim if placements is None else \
            _placements("DTensor.from_local", placements, np.ndim(local_tensor))
        return dtensor_from_local(local_tensor, mesh, pl, shape=shape)


# -- Tensor methods (PyTorch names), attached once by disttensor.parallel ------------------------

def _require_dist(fn: str, t: Tensor) -> None:
    if not t.is_dist():
        raise TypeError(f"Tensor.{fn}: the tensor is not distributed")


def to_local(self: Tensor) -> Tensor:
    """This rank's piece as a dense tensor sharing the buffer (differentiable).

    Example::

        piece = x.to_local()            # this rank's rows
    """
    _require_dist("to_local", self)
    return dtensor_to_local(self)


def full_tensor(self: Tensor) -> Tensor:
    """The global value as a dense tensor on every member (an all-gather; differentiable).

    Example::

        whole = x.full_tensor()          # all-gathered, dense
    """
    _require_dist("full_tensor", self)
    return unshard_dtensor(self)


def redistribute(self: Tensor, device_mesh: ProcessMesh | None = None,
                 placements: Sequence[Placement] | None = None, *,
                 async_op: bool = False) -> Tensor:
    """``reshard`` to ``placements`` on ``device_mesh`` (each defaults to the current one).

    Example::

        y = x.redistribute(placements=[dt.Replicate()])
    """
    _require_dist("redistribute", self)
    mesh = self.process_mesh if device_mesh is None else device_mesh
    pl = self.placements if placements is None else \
        _placements("Tensor.redistribute", placements, self.ndim)
    return reshard(self, mesh, pl)


def _device_mesh(self: Tensor) -> ProcessMesh | None:
    """The mesh of a distributed tensor (None for a dense one)."""
    return self.process_mesh


TENSOR_METHODS = {"to_local": to_local, "full_tensor": full_tensor,
                  "redistribute": redistribute, "device_mesh": property(_device_mesh)}


# -- tensor parallel styles ------------------------------------------------------------------

class ParallelStyle:
    """How ``parallelize_module`` distributes one module and lays out its inputs/outputs."""

    def __init__(self, input_layouts: Placement | None, output_layouts: Placement | None,
                 use_local_output: bool):
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts
        self.use_local_output = bool(use_local_output)

    def check(self, name: str, module: Layer) -> None:
        """Raise (before anything changes) when the style cannot apply to ``module``."""

    def apply(self, module: Layer, mesh: ProcessMesh, src_data_rank: int | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define apply")

    def _hooks(self, module: Layer, mesh: ProcessMesh, desired_input: Placement) -> None:
        """Inputs: a dense tensor is this rank's piece laid out as ``input_layouts``; it is then
        redistributed to ``desired_input``. Output: redistributed to ``output_layouts``, then
        made local when ``use_local_output``."""
        given, want_out = self.input_layouts, self.output_layouts

        def prepare_input(_m, inputs):
            if not inputs or not isinstance(inputs[0], Tensor):
                return None
            x = inputs[0]
            if not x.is_dist():
                _check_local_input(module, mesh)
                x = dtensor_from_local(x, mesh, [given])
            return (_lay_out(x, mesh, desired_input),) + tuple(inputs[1:])

        def prepare_output(_m, _inputs, out):
            if not isinstance(out, Tensor) or not out.is_dist():
                return None
            out = _lay_out(out, mesh, want_out)
            return dtensor_to_local(out) if self.use_local_output else out

        module.register_forward_pre_hook(prepare_input)
        module.register_forward_post_hook(prepare_output)


def _check_local_input(module: Layer, mesh: ProcessMesh) -> None:
    """A local (dense) input is this rank's piece on the style's ``mesh``; that cannot feed
    parameters :func:`fully_shard` moved to the parent mesh: say how to keep DTensors."""
    moved = next((p.process_mesh for p in module.parameters()
                  if p.is_dist() and p.process_mesh != mesh), None)
    if moved is not None:
        raise ValueError(
            f"parallelize_module: {type(module).__name__} got a local (dense) input, such as "
            "the output of a style with use_local_output=True (the default), but fully_shard "
            f"moved its parameters from {mesh} to {moved}, so the inputs would live on "
            "different meshes; pass use_local_output=False to the styles of parallelize_module "
            "so activations stay DTensors on that mesh")


def _lay_out(t: Tensor, mesh: ProcessMesh, placement: Placement) -> Tensor:
    """``t`` as ``[placement]`` on the 1-d ``mesh`` (negative Shard dims normalized). A tensor
    on a larger mesh with ``mesh``'s dim name (a module :func:`fully_shard` lifted to the
    parent mesh) gets ``placement`` on that dim, its other dims unchanged."""
    if isinstance(placement, Shard) and t.ndim:
        placement = replace(placement, dim=placement.dim % t.ndim)
    own = t.process_mesh
    if own == mesh:
        want, target = [placement], mesh
    elif mesh.dim_names[0] in own.dim_names:
        want, target = list(t.placements), own
        want[own.dim_names.index(mesh.dim_names[0])] = placement
    else:
        raise ValueError(f"parallelize_module: a tensor on {own} reached a module "
                         f"parallelized on {mesh}")
    return t if list(t.placements) == want else reshard(t, target, want)


def _place(module: Layer, name: str, mesh: ProcessMesh, pl: list[Placement],
           src_data_rank: int | None) -> None:
    p = getattr(module, name, None)
    if isinstance(p, Tensor) and not p.is_dist():
        setattr(module, name, distribute_tensor(p, mesh, pl, src_data_rank))


def _check_kind(style: str, name: str, module: Layer) -> None:
    if not isinstance(module, (Linear, Embedding)):
        raise ValueError(f"parallelize_module: {style} on '{name or type(module).__name__}' "
                         f"supports Linear and Embedding, got {type(module).__name__}")


class ColwiseParallel(ParallelStyle):
    """Column-wise sharding (PyTorch's ``ColwiseParallel``): a Linear's output features
    (weight ``Shard(1)`` in disttensor's ``[in, out]`` layout, bias ``Shard(0)``), an
    Embedding's embedding dim (``Shard(1)``). Input: given as ``input_layouts`` (default
    Replicate), used replicated; output: ``output_layouts`` (default ``Shard(-1)``), a local
    tensor when ``use_local_output`` (default). ``split_factor=k`` (a fused projection of k
    equal sections, e.g. QKV) shards each section: ``Shard(d, split_factor=k)``, the default
    output layout too, so each rank's local output holds its piece of every section.

    Example::

        dt.parallelize_module(mlp, mesh["tp"], {"fc1": dt.ColwiseParallel()})
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True,
                 split_factor: int = 1):
        if isinstance(split_factor, bool) or not isinstance(split_factor, int) \
                or split_factor < 1:
            raise ValueError(f"ColwiseParallel: split_factor must be an int >= 1, got "
                             f"{split_factor!r}")
        self.split_factor = split_factor
        super().__init__(input_layouts or Replicate(),
                         output_layouts or Shard(-1, split_factor=split_factor),
                         use_local_output)

    def check(self, name, module):
        _check_kind("ColwiseParallel", name, module)
        out = module.weight.shape[-1] if isinstance(module, Linear) else module.weight.shape[1]
        if out % self.split_factor:
            raise ValueError(f"parallelize_module: ColwiseParallel(split_factor="
                             f"{self.split_factor}) on '{name or type(module).__name__}': "
                             f"{out} output features are not {self.split_factor} equal sections")

    def apply(self, module, mesh, src_data_rank):
        k = self.split_factor
        _place(module, "weight", mesh, [Shard(1, split_factor=k)], src_data_rank)
        _place(module, "bias", mesh, [Shard(0, split_factor=k)], src_data_rank)
        self._hooks(module, mesh, Replicate())


class RowwiseParallel(ParallelStyle):
    """Row-wise sharding (PyTorch's ``RowwiseParallel``): a Linear's input features (weight
    ``Shard(0)`` in the ``[in, out]`` layout, bias replicated), an Embedding's vocabulary
    (``Shard(0)``). Input: given as ``input_layouts`` (default ``Shard(-1)``; an Embedding's
    ids are used replicated); output: ``output_layouts`` (default Replicate: the all-reduce of
    the partial sums), a local tensor when ``use_local_output`` (default).

    Example::

        dt.parallelize_module(mlp, mesh["tp"], {"fc2": dt.RowwiseParallel()})
    """

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True):
        super().__init__(input_layouts or Shard(-1), output_layouts or Replicate(),
                         use_local_output)

    def check(self, name, module):
        _check_kind("RowwiseParallel", name, module)

    def apply(self, module, mesh, src_data_rank):
        _place(module, "weight", mesh, [Shard(0)], src_data_rank)
        _place(module, "bias", mesh, [Replicate()], src_data_rank)
        self._hooks(module, mesh,
                    Replicate() if isinstance(module, Embedding) else Shard(-1))


class SequenceParallel(ParallelStyle):
    """Sequence parallelism (PyTorch's ``SequenceParallel``) for modules that act on each
    position alone (norms, dropout): parameters replicated, input and output sharded on
    ``sequence_dim``; the output stays distributed unless ``use_local_output``.

    Example::

        dt.parallelize_module(block, mesh["tp"], {"norm": dt.SequenceParallel()})
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__(Shard(sequence_dim), Shard(sequence_dim), use_local_output)

    def apply(self, module, mesh, src_data_rank):
        for name, _ in list(module.named_parameters()):
            owner = module
            *path, leaf = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            _place(owner, leaf, mesh, [Replicate()], src_data_rank)
        self._hooks(module, mesh, self.input_layouts)


def _fqn_match(pattern: str, name: str) -> bool:
    """PyTorch's module-FQN matching: atom by atom, each with shell wildcards."""
    a, b = pattern.split("."), name.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def parallelize_module(module: Layer, device_mesh: ProcessMesh | None = None,
                       parallelize_plan: ParallelStyle | dict | None = None, *,
                       src_data_rank: int | None = 0) -> Layer:
    """Tensor-parallelize ``module`` on a 1-d mesh (PyTorch's ``parallelize_module``; slice a
    larger mesh with ``mesh["tp"]``). ``parallelize_plan`` is a style for ``module`` itself or a
    dict of submodule names (``*`` wildcards per dotted part, ``"layers.*.mlp.fc1"``) to styles.
    Parameters are placed with :func:`distribute_tensor` from ``src_data_rank``; hooks lay out
    inputs and outputs as the styles declare.

    Bad input (a name matching no submodule, a style that does not fit its module, a mesh
    that is not 1-d) raises on every rank before any parameter changes. Collective: one
    broadcast per placed parameter (none with ``src_data_rank=None``).

    Example::

        tp = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        dt.parallelize_module(block, tp, {"fc1": dt.ColwiseParallel(),
                                          "fc2": dt.RowwiseParallel()})
    """
    fn = "parallelize_module"
    if not isinstance(module, Layer):
        raise TypeError(f"{fn}: module must be a Layer, got {type(module).__name__}")
    mesh = device_mesh if device_mesh is not None else get_mesh()
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{fn}: device_mesh must be a ProcessMesh/DeviceMesh, got "
                        f"{type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{fn}: device_mesh must be 1-d (slice a {mesh.ndim}-d mesh with "
                         f"mesh['tp']), got {mesh}")
    if parallelize_plan is None:
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        targets = [("", module, parallelize_plan)]
    elif isinstance(parallelize_plan, dict):
        subs = list(module.named_sublayers())
        targets = []
        for key, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"{fn}: the plan for {key!r} must be a ParallelStyle, got "
                                f"{type(style).__name__}")
            hits = [(n, m) for n, m in subs if _fqn_match(key, n)]
            if not hits:
                raise ValueError(f"{fn}: plan key {key!r} matches no submodule of "
                                 f"{type(module).__name__} (submodules: "
                                 f"{[n for n, _ in subs][:20]})")
            targets += [(n, m, style) for n, m in hits]
    else:
        raise TypeError(f"{fn}: parallelize_plan must be a ParallelStyle or a dict, got "
                        f"{type(parallelize_plan).__name__}")
    for name, m, style in targets:
        style.check(name, m)
    for _, m, style in targets:
        style.apply(m, mesh, src_data_rank)
    return module


# -- FSDP ------------------------------------------------------------------------------------

def _check_lift(fn: str, p: Tensor, parent: ProcessMesh) -> None:
    """Raise unless ``p`` is dense, on ``parent`` or on a sub-mesh ``parent[names]``."""
    own = p.process_mesh if p.is_dist() else parent
    if own != parent and not (isinstance(parent, DeviceMesh)
                              and set(own.dim_names) <= set(parent.dim_names)
                              and own == parent[own.dim_names]):
        raise ValueError(f"{fn}: parameter '{p._label()}' is on {own}, which is not a "
                         f"sub-mesh of {parent}")


def _lift(p: Tensor, parent: ProcessMesh) -> Tensor:
    """``p`` (checked by :func:`_check_lift`) as a tensor on ``parent``: a dense one
    replicated, one on a sub-mesh with its placements on the sub-mesh's dims and Replicate
    elsewhere (its piece is the same along the other dims)."""
    if not p.is_dist():
        return shard_tensor(p, parent, [Replicate()] * parent.ndim)
    own = p.process_mesh
    if own == parent:
        return p
    pl = [Replicate()] * parent.ndim
    for name, q in zip(own.dim_names, p.placements):
        pl[parent.dim_names.index(name)] = q
    return dtensor_from_local(dtensor_to_local(p), parent, pl, shape=p.shape)


def fully_shard(module: Layer, *, mesh: ProcessMesh | None = None,
                reshard_after_forward: bool = True) -> Layer:
    """Shard every parameter of ``module`` over the data-parallel mesh ``mesh`` (PyTorch's
    FSDP2 ``fully_shard``; ZeRO stage 3, as :class:`ShardingStage3`): each parameter is
    resharded in place (same Tensor object) to its layout plus ``mesh``'s dim sharding one
    tensor dim. With ``mesh = device_mesh["dp"]`` of a 2-d mesh whose other dim a
    ``parallelize_module`` used, parameters move from the ``mesh["tp"]`` sub-mesh to the 2-d
    mesh first ([Shard(0) on dp, the TP placement on tp]) and the styles' hooks lay activations
    out on the tp dim of the 2-d mesh. An op gathers a parameter over dp where its rule needs
    it whole, in forward and backward, and its gradient is reduce-scattered; create the
    optimizer afterwards so its states take the sharded layout.

    Feed the model DTensors on the 2-d mesh (``distribute_tensor(batch, mesh, [Shard(0),
    Replicate()])``) and use ``use_local_output=False`` styles, so the loss is the global one.
    ``reshard_after_forward`` must be True (parameters are never kept gathered).
    Collective: a small all-gather of shapes per lifted parameter, no data movement beyond
    dropping slices.

    Example::

        mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt.parallelize_module(model, mesh["tp"], plan)
        dt.fully_shard(model, mesh=mesh["dp"])
    """
    fn = "fully_shard"
    if not isinstance(module, Layer):
        raise TypeError(f"{fn}: module must be a Layer, got {type(module).__name__}")
    if not reshard_after_forward:
        raise NotImplementedError(f"{fn}: reshard_after_forward=False (keeping parameters "
                                  "gathered between forward and backward) is not supported")
    mesh = mesh if mesh is not None else get_mesh()
    if not isinstance(mesh, ProcessMesh) or mesh.ndim != 1:
        raise ValueError(f"{fn}: mesh must be a 1-d (data-parallel) mesh, got {mesh!r}")
    parent = getattr(mesh, "parent", None) or mesh
    dp = parent.dim_names.index(mesh.dim_names[0])
    params = list({id(p): p for p in module.parameters()}.values())
    for p in params:  # every parameter is checked before any changes
        _check_lift(fn, p, parent)
    with no_grad():
        for p in params:
            lifted = _lift(p, parent)
            v = lifted._value
            p._value = reshard_to(lifted, parent,
                                  dp_layout(tuple(v.shape), v.dist_attr, dp))._value
            p.grad = None
    return module
