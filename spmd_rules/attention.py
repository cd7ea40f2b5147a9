"""Rules of the transformer ops: fused attention and its grad, rotary position embedding.

Attention tensors use Paddle's layout: query ``[b, sq, h, d]``, key ``[b, sk, hk, d]``,
value ``[b, sk, hk, dv]`` with ``hk`` dividing ``h`` (grouped-query attention), an optional mask
broadcastable to ``[b, h, sq, sk]``. Batch and heads shard with no communication (the Megatron
layout: heads over the model-parallel mesh dim); a sharded query sequence keeps its shard and
gathers key/value along their sequence, never the query; head_dim is kept whole; Partial inputs
are resolved.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, prod, register_rule, require
from .dist_attr import DistAttr
from .einsum import assignments, contracted_partial, layout, merge_shardings
from .redistribute import reshard_cost

__all__ = ["attention", "attention_grad", "rotary_embedding", "attention_shapes",
           "rotary_shapes"]

_Q = ["b", "s", "h", None]     # query, output and their grads
_KV = ["b", None, "h", None]   # key, value: the key sequence is always whole
_LSE = ["b", "h", "s"]


def attention_shapes(op: str, q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                     mask: tuple[int, ...] | None) -> None:
    """Validate the shapes of an attention call; ValueError naming the op and the shapes."""
    shapes = f"query {list(q)}, key {list(k)}, value {list(v)}"
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        raise ValueError(f"{op}: query, key and value must be 4-D [batch, seq, heads, head_dim], "
                         f"got {shapes}")
    if k[:3] != v[:3]:
        raise ValueError(f"{op}: key and value must agree in batch, seq and heads, got {shapes}")
    if q[0] != k[0]:
        raise ValueError(f"{op}: query and key must have the same batch size, got {shapes}")
    if q[3] != k[3]:
        raise ValueError(f"{op}: head_dim mismatch: query has {q[3]}, key {k[3]} ({shapes})")
    if k[2] == 0 or q[2] % k[2]:
        raise ValueError(f"{op}: the key/value heads ({k[2]}) must divide the query heads "
                         f"({q[2]}) (grouped-query attention), got {shapes}")
    if mask is not None:
        full = (q[0], q[2], q[1], k[1])
        if len(mask) > 4 or any(m not in (1, f) for m, f in zip(mask[::-1], full[::-1])):
            raise ValueError(f"{op}: attn_mask of shape {list(mask)} is not broadcastable to "
                             f"[batch, heads, seq_q, seq_k] = {list(full)} ({shapes})")


def _mask_notation(mask: TensorMeta | None) -> list | None:
    if mask is None:
        return None
    labels = ["b", "h", "s", None][4 - mask.ndim:]
    return [lab if n != 1 else None for lab, n in zip(labels, mask.shape)]


def _merge(metas: Sequence[TensorMeta | None], notations: list, kv_heads: int,
           mesh: tuple[int, ...]) -> dict:
    """The label map at the fewest bytes moved: a sharded query sequence keeps its shard and
    key/value are gathered to it, unless moving that mesh dim to batch or heads by an
    all-to-all moves fewer bytes; batch, sequence or heads of size 1 are never sharded (one
    rank would do all the work). Under grouped-query
    attention heads shard only over mesh dims whose sizes' product divides the key/value heads
    (so each query head's piece lines up with its key/value head's piece); when the cheapest
    map breaks that, every map that keeps it is searched."""
    q = metas[0].shape
    single = {lab for lab, n in (("b", q[0]), ("s", q[1]), ("h", q[2])) if n == 1}
    present = [([None if lab in single else lab for lab in n], m)
               for n, m in zip(notations, metas) if m is not None and n is not None]
    nots, attrs = [n for n, _ in present], [m.dist_attr for _, m in present]
    shapes = [m.shape for _, m in present]
    merged = merge_shardings(nots, attrs, shapes=shapes)
    if _heads_ok(merged, kv_heads, mesh) or metas[0].shape[2] == kv_heads:
        return merged

    def cost(cand: dict) -> int:
        return sum(reshard_cost(s, 1, a, layout(n, cand, mesh)) for n, a, s in
                   zip(nots, attrs, shapes))
    labels = [None] + [lab for lab in ("b", "s", "h") if lab not in single]
    cands = [c for c in assignments(range(len(mesh)), [labels] * len(mesh))
             if _heads_ok(c, kv_heads, mesh)]
    return min(cands, key=lambda c: (cost(c), -sum(len(d) for d in c.values())))


def _heads_ok(merged: dict, kv_heads: int, mesh: tuple[int, ...]) -> bool:
    return kv_heads % prod([mesh[m] for m in merged.get("h", ())]) == 0


@register_rule("attention")
def attention(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (query, key, value, attn_mask|None). Outputs (out ``[b, sq, h, dv]`` like query,
    the row log-sum-exp ``[b, h, sq]``, the dropout seed (0-d, Replicate))."""
    op = op_name(attrs, "scaled_dot_product_attention")
    require(metas, op, 4, optional=(3,))
    q, k, v, mask = metas
    attention_shapes(op, q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    mesh = mesh_shape_of(op, metas)
    notations = [_Q, _KV, _KV, _mask_notation(mask)]
    merged = _merge(metas, notations, k.shape[2], mesh)
    ins = tuple(None if m is None else layout(n, merged, mesh) for n, m in zip(notations, metas))
    b, sq, h, _ = q.shape
    outs = (TensorMeta((b, sq, h, v.shape[3]), layout(_Q, merged, mesh)),
            TensorMeta((b, h, sq), layout(_LSE, merged, mesh)),
            TensorMeta((), DistAttr(mesh, (), ())))
    return SpmdResult(ins, outs)


@register_rule("attention_grad")
def attention_grad(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (query, key, value, attn_mask|None, out, lse, seed, dout), laid out as in the
    forward. Outputs (dquery like query, dkey and dvalue like key and value, Partial(sum) over
    the mesh dims sharding the query sequence: each rank's queries contribute to every key)."""
    op = op_name(attrs, "scaled_dot_product_attention_grad")
    require(metas, op, 8, optional=(3,))
    q, k, v, mask, out, lse, seed, dout = metas
    attention_shapes(op, q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    want = {"out": (out, (q.shape[0], q.shape[1], q.shape[2], v.shape[3])),
            "dout": (dout, (q.shape[0], q.shape[1], q.shape[2], v.shape[3])),
            "lse": (lse, (q.shape[0], q.shape[2], q.shape[1])), "seed": (seed, ())}
    for name, (meta, shape) in want.items():
        if meta.shape != shape:
            raise ValueError(f"{op}: {name} has shape {list(meta.shape)}, expected {list(shape)}")
    mesh = mesh_shape_of(op, metas)
    notations = [_Q, _KV, _KV, _mask_notation(mask), _Q, _LSE, [], _Q]
    merged = _merge(metas, notations, k.shape[2], mesh)
    ins = tuple(None if m is None else layout(n, merged, mesh) for n, m in zip(notations, metas))
    partial = contracted_partial(merged, _KV)
    outs = (TensorMeta(q.shape, layout(_Q, merged, mesh)),
            TensorMeta(k.shape, layout(_KV, merged, mesh, partial)),
            TensorMeta(v.shape, layout(_KV, merged, mesh, partial)))
    return SpmdResult(ins, outs)


def rotary_shapes(op: str, x: tuple[int, ...], sin: tuple[int, ...], cos: tuple[int, ...],
                  pos: tuple[int, ...] | None) -> None:
    """Validate the shapes of a rotary embedding call; ValueError naming the op and shapes."""
    if len(x) != 4 or x[3] % 2:
        raise ValueError(f"{op}: x must be 4-D [batch, seq, heads, head_dim] with an even "
                         f"head_dim, got {list(x)}")
    b, s, _, d = x
    for name, t in (("sin", sin), ("cos", cos)):
        ok = len(t) == 4 and t[0] == 1 and t[2] == 1 and t[3] == d and \
            (t[1] == s if pos is None else t[1] >= 1)
        if not ok:
            want = f"[1, {s}, 1, {d}]" if pos is None else f"[1, max_position, 1, {d}]"
            raise ValueError(f"{op}: {name} must have shape {want} for x {list(x)}, got "
                             f"{list(t)}")
    if pos is not None and tuple(pos) != (b, s):
        raise ValueError(f"{op}: position_ids must have shape [{b}, {s}] for x {list(x)}, "
                         f"got {list(pos)}")


@register_rule("rotary_embedding")
def rotary_embedding(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x ``[b, s, h, d]``, sin, cos ``[1, s_max, 1, d]``, position_ids ``[b, s]``|None).

    Batch and heads keep their shards. Without position_ids sin/cos cover exactly x's sequence
    and are sliced like it (a sharded sequence takes its rows locally); with position_ids the
    ids shard like x's batch and sequence and sin/cos are whole. head_dim is whole. Output
    like x; Partial inputs are resolved."""
    op = op_name(attrs, "fused_rotary_position_embedding")
    require(metas, op, 4, optional=(3,))
    x, sin, cos, pos = metas
    rotary_shapes(op, x.shape, sin.shape, cos.shape, None if pos is None else pos.shape)
    mesh = mesh_shape_of(op, metas)
    table = [None, "s" if pos is None else None, None, None]
    notations = [["b", "s", "h", None], table, table, ["b", "s"]]
    present = [(n, m) for n, m in zip(notations, metas) if m is not None]
    merged = merge_shardings([n for n, _ in present], [m.dist_attr for _, m in present],
                             shapes=[m.shape for _, m in present])
    ins = tuple(None if m is None else layout(n, merged, mesh) for n, m in zip(notations, metas))
    return SpmdResult(ins, (TensorMeta(x.shape, ins[0]),))
