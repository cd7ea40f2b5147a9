"""``shard_optimizer`` and ZeRO (Rajbhandari et al. 2020) on the data-parallel mesh dim, as
Paddle's ``dist.shard_optimizer(opt, dist.ShardingStage1/2/3("dp", mesh))``.

Each parameter gets a *dp layout*: its own layout with the data-parallel mesh dim also sharding
one tensor dim (the first dim no other mesh dim shards whose size is at least the dp degree,
else the largest free dim, else co-sharding its largest dim inside the pieces of the mesh dims
already there: a tensor-parallel bias ``[R, S(0)]`` becomes ``[S(0, shard_order=1), S(0,
shard_order=0)]``, tp first, so one all-gather over dp gives back the TP layout and the
gradient's Partial over dp is one reduce-scatter; dp first would need both mesh dims' gathers),
so on a [dp, mp] mesh a column-parallel ``[in, out]`` weight ``[R, S(1)]`` becomes ``[S(0),
S(1)]``. Then:

* **stage 1** — optimizer states (moments, velocity) are created in the dp layout. The fused
  update runs on the dp pieces (the elementwise rule merges the layouts): each rank updates
  its slice of the parameter, which is all-gathered back into the replicated parameter.
  Per rank: parameters 4Ψ, gradients 4Ψ, states 8Ψ/N bytes (float32 AdamW).
* **stage 2** — also the gradient placement policy: each parameter's gradient is laid out in
  the dp layout, so its Partial gradient is reduce-scattered instead of all-reduced. Gradients
  4Ψ/N.
* **stage 3** — also the parameters: each is resharded to its dp layout in place (same Tensor
  object). An op that uses one gathers it over dp where its rule needs it whole (a matmul
  whose other input is sharded on dp by the batch), for that op only, in forward and again in
  backward (backward ops read the sharded parameter); the gradient of that gather is a
  reduce-scatter. Parameters 4Ψ/N.

A dense parameter is first replicated on the stage's ``mesh`` in place. The optimizer object is
changed in place and returned.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from spmd_rules import DistAttr, ProcessMesh, Replicate

from ..autograd import no_grad
from ..distributed.api import reshard_to, shard_tensor
from ..grad_sync import set_grad_layout
from ..optimizer import Optimizer
from ..tensor import Tensor
from .mesh import mesh_dim_index

__all__ = ["shard_optimizer", "ShardingStage1", "ShardingStage2", "ShardingStage3",
           "dp_layout"]


def dp_layout(shape: tuple[int, ...], attr: DistAttr, dp: int) -> DistAttr:
    """``attr`` with mesh dim ``dp`` also sharding one tensor dim of ``shape``, innermost
    (``attr`` itself when ``dp`` already shards a dim, or the tensor is 0-d)."""
    if any(dp in dm for dm in attr.dims_mapping) or not shape:
        return attr
    n = attr.mesh_shape[dp]
    free = [d for d, dm in enumerate(attr.dims_mapping) if not dm]
    fits = [d for d in free if shape[d] >= n]
    if fits:
        d = fits[0]
    elif free:
        d = max(free, key=lambda k: shape[k])
    else:
        d = max(range(len(shape)), key=lambda k: shape[k])
    dims = [list(dm) for dm in attr.dims_mapping]
    dims[d] = dims[d] + [dp]  # innermost: one all-gather over dp restores the layout
    return attr.with_dims_mapping(dims)


class _ShardingStage:
    """A ``shard_fn`` for :func:`shard_optimizer` that shards over one mesh dim (ZeRO)."""

    stage = 0

    def __init__(self, sharding_mesh_dim: int | str = "dp", mesh: ProcessMesh | None = None):
        name = type(self).__name__
        if isinstance(sharding_mesh_dim, ProcessMesh):  # Paddle 2.6's ShardingStageN(mesh)
            sharding_mesh_dim, mesh = 0, sharding_mesh_dim
        if mesh is not None and not isinstance(mesh, ProcessMesh):
            raise TypeError(f"{name}: mesh must be a ProcessMesh or None, got "
                            f"{type(mesh).__name__}")
        if isinstance(sharding_mesh_dim, bool) or not isinstance(
                sharding_mesh_dim, (int, np.integer, str)):
            raise TypeError(f"{name}: sharding_mesh_dim must be a mesh dim name or index, got "
                            f"{sharding_mesh_dim!r}")
        self.sharding_mesh_dim, self.mesh = sharding_mesh_dim, mesh

    def dim_on(self, mesh: ProcessMesh) -> int:
        """The index of the sharding dim on ``mesh`` (ValueError naming the stage if absent)."""
        return mesh_dim_index(f"shard_optimizer ({type(self).__name__})", mesh,
                              self.sharding_mesh_dim)

    def layout(self, p: Tensor) -> tuple[ProcessMesh, DistAttr]:
        v = p._value
        return v.mesh, dp_layout(tuple(v.shape), v.dist_attr, self.dim_on(v.mesh))

    def __call__(self, accumulator_name: str, param: Tensor, accumulator: Tensor) -> Tensor:
        """Paddle's shard_fn contract: the state tensor of ``param`` in the dp layout. Adam's
        beta powers (``*_pow_acc``, one element whatever the parameter's shape) and states of
        another shape are returned as they are."""
        if not param.is_dist() or accumulator.shape != param.shape or \
                accumulator_name.endswith("_pow_acc"):
            return accumulator
        mesh, attr = self.layout(param)
        with no_grad():
            return reshard_to(accumulator, mesh, attr)

    def prepare(self, params: list[Tensor]) -> None:
        """Check every parameter (raises before anything changes), replicate dense ones on
        ``mesh``, then apply the stage's gradient and parameter policies."""
        fn = f"shard_optimizer ({type(self).__name__})"
        dense = [p for p in params if not p.is_dist()]
        if dense and self.mesh is None:
            raise ValueError(f"{fn}: parameter '{dense[0]._label()}' is dense; pass mesh= to "
                             "the stage (dense parameters are replicated on it) or place the "
                             "parameters first (shard_tensor, shard_layer, parallelize)")
        for p in params:
            self.dim_on(p._value.mesh if p.is_dist() else self.mesh)
        with no_grad():
            for p in dense:
                p._value = shard_tensor(p, self.mesh, [Replicate()] * self.mesh.ndim)._value
                p.grad = None
            for p in params:
                self._place(p)

    def _place(self, p: Tensor) -> None:
        """Stage 1: nothing (states take the dp layout when created)."""


class ShardingStage1(_ShardingStage):
    """ZeRO stage 1: optimizer states sharded over ``sharding_mesh_dim`` (see the module
    notes). Collectives per step: each parameter's updated slice is all-gathered over dp.

    Example::

        opt = dt.shard_optimizer(opt, dt.ShardingStage1("dp", mesh))
    """

    stage = 1


class ShardingStage2(ShardingStage1):
    """ZeRO stage 2: states and gradients sharded over ``sharding_mesh_dim`` (gradients are
    reduce-scattered in backward instead of all-reduced).

    Example::

        opt = dt.shard_optimizer(opt, dt.ShardingStage2("dp", mesh))
    """

    stage = 2

    def _place(self, p):
        mesh, attr = self.layout(p)
        set_grad_layout(p, mesh, attr)
        p.grad = None


class ShardingStage3(ShardingStage1):
    """ZeRO stage 3: states, gradients and parameters sharded over ``sharding_mesh_dim``; an op
    gathers a parameter over dp where its rule needs it whole, in forward and backward.

    Example::

        opt = dt.shard_optimizer(opt, dt.ShardingStage3("dp", mesh))
    """

    stage = 3

    def _place(self, p):
        mesh, attr = self.layout(p)
        set_grad_layout(p, None, None)
        if attr != p._value.dist_attr:
            p._value = reshard_to(p, mesh, attr)._value
        p.grad = None


def shard_optimizer(optimizer: Optimizer, shard_fn: Callable[[str, Tensor, Tensor], Tensor] |
                    None = None, gradient_accumulation_steps: int = 1) -> Optimizer:
    """Make ``optimizer`` distributed (Paddle's ``dist.shard_optimizer``).

    ``shard_fn(accumulator_name, param, accumulator) -> accumulator`` lays out each optimizer
    state when it is created (and any existing state now); without it states take their
    parameter's layout. :class:`ShardingStage1`, :class:`ShardingStage2` and
    :class:`ShardingStage3` are such functions that also apply ZeRO's gradient and parameter
    policies (module notes); on a [dp, mp] mesh they work with tensor parallelism, the dp
    sharding added to each parameter's mp layout.

    Bad input (a stage whose mesh dim the parameters' mesh lacks, dense parameters without a
    stage mesh) raises on every rank before anything changes. Returns ``optimizer``.

    Example::

        mesh = dt.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        opt = dt.optimizer.AdamW(parameters=model.parameters())
        opt = dt.shard_optimizer(opt, dt.ShardingStage2("dp", mesh))
    """
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"shard_optimizer: optimizer must be a disttensor Optimizer, got "
                        f"{type(optimizer).__name__}")
    if shard_fn is not None and not callable(shard_fn):
        raise TypeError(f"shard_optimizer: shard_fn must be callable, got "
                        f"{type(shard_fn).__name__}")
    if gradient_accumulation_steps != 1:
        raise NotImplementedError("shard_optimizer: gradient_accumulation_steps other than 1 "
                                  "is not supported (accumulate by calling backward several "
                                  "times before step)")
    if isinstance(shard_fn, _ShardingStage):
        shard_fn.prepare(optimizer._parameter_list)
    optimizer._set_shard_fn(shard_fn)
    return optimizer
