"""spmd_rules: the placement algebra and the per-op SPMD rules (pure metadata).

Imports only the standard library. A rule is ``infer_forward(metas, attrs) -> SpmdResult``
registered by name in :data:`RULES` (see :func:`get_rule`). Rule names: elementwise, matmul,
reduction, softmax, layer_norm, layer_norm_grad, batch_norm, batch_norm_grad, embedding,
embedding_grad, cross_entropy, cross_entropy_grad, reshape, squeeze, unsqueeze, flatten,
transpose, slice, slice_grad, set_value, concat, stack, split, gather, gather_grad, one_hot, tile,
expand and the fallback ``replicated``; the tensor ops add along_axes, unbind, take_along_axis,
take_along_axis_grad, put_along_axis, scatter, einsum and axis_statistics.

Runtime contract (what the dispatcher does with a result, on the coordinate ``coord`` of this
rank in the mesh):

- reshard each input to ``result.inputs[i]``; every output's local shape is
  ``local_shape(out.shape, out.dist_attr, coord)``;
- shape attributes given in global terms become local: reshape / expand target =
  ``local_shape(target, out_attr, coord)``; gather_grad / slice_grad ``input_shape`` and
  embedding_grad's ``num_embeddings`` become the local shape of the output; tile's
  repeat_times, split's sections, concat/stack axes, one_hot's num_classes are unchanged (the
  axes involved are replicated); slice's local index keeps its global items on non-full axes
  (they are replicated) and uses ``slice(None)`` on full-range axes;
- reductions: ``mean`` divides by the GLOBAL number of reduced elements (output Partial(sum));
  max/min/prod on an empty local piece give the identity (-inf / +inf / 1);
- embedding with a vocab-sharded weight: masked lookup of ``ids - local_offset(weight)[0]``,
  rows outside ``[0, local V)`` are zero; ``padding_idx`` compares against the global ids;
- cross_entropy(_grad) with the class axis sharded on mesh dims M (the required logits' dims
  mapping of the class axis): all-reduce max, sum-exp and the picked logit over M; labels are
  global class ids (subtract the class offset locally);
- batch_norm(_grad): all-reduce per-channel sums over the mesh dims sharding x's non-channel
  axes and divide by the global count;
- Partial(avg) is treated like Partial(sum) by the linear rules (both are linear).
"""
from . import (  # noqa: F401  (these modules register their rules)
    along_axis,
    concat,
    contraction,
    conv,
    cross_entropy,
    elementwise,
    embedding,
    indexing,
    matmul,
    reduction,
    replicated,
    softmax,
)
from .base import (
    FALLBACK_RULE,
    RULES,
    Rule,
    SpmdResult,
    TensorMeta,
    get_rule,
    register_rule,
    rule_coverage,
)
from .dist_attr import (
    DistAttr,
    local_offset,
    local_ranges,
    local_shape,
    local_slices,
    locate,
    piece_length,
    split_range,
    strided_ranges,
)
from .einsum import broadcast_notations, contracted_partial, layout, linear_partial, merge_shardings
from .mesh import ProcessMesh
from .norm import channel_axis
from .placement import (
    LINEAR_REDUCE_TYPES,
    LOGICAL_REDUCE_TYPES,
    Partial,
    Placement,
    ReduceType,
    Replicate,
    Shard,
)
from .redistribute import ReshardPlan, Step, plan_reshard, plan_same_mesh, reshard_cost
from .reduction import REDUCE_PARTIAL
from .reshape import (
    Broadcast,
    DimTrans,
    Flatten,
    InputDim,
    Repeat,
    Singleton,
    Split,
    infer_dim_trans,
    make_reshape_dim_trans,
)
from .view import parse_index

__all__ = [
    "ReduceType", "Placement", "Shard", "Replicate", "Partial", "LINEAR_REDUCE_TYPES",
    "LOGICAL_REDUCE_TYPES",
    "ProcessMesh", "DistAttr", "split_range", "local_shape", "local_offset", "local_slices",
    "TensorMeta", "SpmdResult", "Rule", "RULES", "FALLBACK_RULE", "register_rule", "get_rule",
    "rule_coverage", "merge_shardings", "layout", "contracted_partial", "broadcast_notations",
    "linear_partial", "DimTrans", "InputDim", "Singleton", "Flatten", "Split", "Broadcast",
    "Repeat", "make_reshape_dim_trans", "infer_dim_trans", "parse_index", "ReshardPlan", "Step",
    "plan_reshard", "plan_same_mesh", "reshard_cost", "channel_axis", "REDUCE_PARTIAL",
    "local_ranges", "locate", "piece_length", "strided_ranges",
]
from . import (
    attention,  # noqa: F401,E402  (registers the attention and rotary rules)
    strided,  # noqa: F401,E402  (strided-aware fronts of split, concat and the views)
)
