"""embedding lookup and its grad."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, check_ndim, mesh_shape_of, op_name, register_rule, require
from .einsum import contracted_partial, layout, merge_shardings

__all__ = ["embedding", "embedding_grad"]


@register_rule("embedding")
def embedding(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (ids [*B] int, weight [V, D]), attrs padding_idx -> out [*B, D].

    ``*b, vd -> *b d``: ids keep their B sharding; weight's D sharding goes to the output's last
    dim; weight's V axis sharded on a mesh dim not already used by ids/D makes the output
    Partial(sum) there (the kernel does a masked lookup: ids outside the local vocab range
    [offset, offset + local V) give zero rows). Partial inputs are resolved.
    """
    op = op_name(attrs, "embedding")
    require(metas, op, 2)
    ids, w = metas
    mesh = mesh_shape_of(op, metas)
    check_ndim(op, "weight", w, ndims=(2,))
    b = list(range(ids.ndim))
    merged = merge_shardings([b, ["v", "d"]], [ids.dist_attr, w.dist_attr],
                             shapes=[ids.shape, w.shape])
    out_not = b + ["d"]
    out = layout(out_not, merged, mesh, contracted_partial(merged, out_not))
    return SpmdResult((layout(b, merged, mesh), layout(["v", "d"], merged, mesh)),
                      (TensorMeta(ids.shape + (w.shape[1],), out),))


@register_rule("embedding_grad")
def embedding_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (ids [*B], dout [*B, D]), attrs num_embeddings -> dweight [V, D].

    B axes merge across ids and dout (ids first); dweight's D takes dout's last-dim sharding,
    V is replicated, and dweight is Partial(sum) on the mesh dims sharding B (scatter-add of
    local rows). Partial inputs are resolved.
    """
    op = op_name(attrs, "embedding_grad")
    require(metas, op, 2)
    ids, dout = metas
    mesh = mesh_shape_of(op, metas)
    if dout.shape[:-1] != ids.shape or dout.ndim != ids.ndim + 1:
        raise ValueError(f"{op}: dout shape {dout.shape} must be ids shape {ids.shape} + (D,)")
    vocab = attrs.get("num_embeddings")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
        raise ValueError(f"{op}: num_embeddings must be a non-negative int, got {vocab!r}")
    b = list(range(ids.ndim))
    merged = merge_shardings([b, b + ["d"]], [ids.dist_attr, dout.dist_attr],
                             shapes=[ids.shape, dout.shape])
    out_not = ["v", "d"]
    out = layout(out_not, merged, mesh, contracted_partial(merged, out_not))
    return SpmdResult((layout(b, merged, mesh), layout(b + ["d"], merged, mesh)),
                      (TensorMeta((vocab, dout.shape[-1]), out),))
