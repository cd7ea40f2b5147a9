"""Embedding lookup (Paddle ``F.embedding``). Rules: ``embedding`` / ``embedding_grad``.

The kernel is a *masked* lookup: a weight piece holding vocabulary rows
``[ctx.offset(1, 0), + local V)`` answers only the ids in that range and gives zero rows for the
others, so a vocab-sharded weight yields a Partial(sum) output with no gather of the weight.
"""
from __future__ import annotations

import numpy as np

from ..dispatch import apply
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, check_index_range


def _embedding_kernel(xp, ids, weight, padding_idx, ctx):
    vocab = ctx.global_shape(1, weight.shape)[0]
    ids = check_index_range(xp, ctx, "embedding", "id", ids, vocab, 0)
    local = ids - ctx.offset(1, 0)
    mask = (local >= 0) & (local < weight.shape[0])
    if padding_idx is not None:
        mask &= ids != padding_idx
    out = xp.zeros(ids.shape + (weight.shape[1],), dtype=weight.dtype)
    out[mask] = weight[local[mask]]
    return out


def scatter_add(xp, dst, index, values) -> None:
    """``dst[index] += values`` with repeated indices accumulated."""
    if xp is np:
        np.add.at(dst, index, values)
    else:
        import cupyx

        cupyx.scatter_add(dst, index, values)


def _embedding_grad_kernel(xp, ids, dout, num_embeddings, padding_idx):
    """dweight [num_embeddings, D]: rows of dout scatter-added at their ids (padding_idx rows
    get nothing)."""
    dweight = xp.zeros((num_embeddings, dout.shape[-1]), dtype=dout.dtype)
    ids_f = ids.reshape(-1)
    rows = dout.reshape(ids_f.shape[0], dout.shape[-1])  # not -1: D may be 0 (a sharded piece)
    if padding_idx is not None:
        keep = ids_f != padding_idx
        ids_f, rows = ids_f[keep], rows[keep]
    scatter_add(xp, dweight, ids_f, rows)
    return dweight


def _embedding_bwd(node, g):
    attrs = {"num_embeddings": int(node.in_shapes[1][0]),
             "padding_idx": node.attrs["padding_idx"]}
    return None, apply(OPS["embedding_grad"], (node.saved_tensor(0), g), attrs)


register("embedding_grad", _embedding_grad_kernel, rule="embedding_grad", dtype=same_dtype(1))
register("embedding", _embedding_kernel, backward=_embedding_bwd, rule="embedding",
         save_inputs=(0,), grad_inputs=(1,), needs_ctx=True, no_need_buffer=(1,),
         dtype=same_dtype(1))


@public()
def embedding(x: Tensor, weight: Tensor, padding_idx: int | None = None, sparse: bool = False,
              name: str | None = None) -> Tensor:
    """Rows of ``weight`` [V, D] picked by the integer ids ``x`` -> shape ``x.shape + [D]``.

    Rows for ``padding_idx`` (negative counts from V) are zeros and get no gradient; ids outside
    [0, V) raise ValueError. ``sparse`` is accepted for Paddle compatibility; the gradient is
    always dense.
    """
    x = as_tensor(x)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        got = weight.shape if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"embedding: weight must be a 2-d tensor [V, D], got {got}")
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"embedding: x (ids) must be an integer tensor, got "
                        f"{np.dtype(x.dtype).name}")
    vocab = weight.shape[0]
    if padding_idx is not None:
        if not -vocab <= int(padding_idx) < vocab:
            raise ValueError(f"embedding: padding_idx {padding_idx} is out of range "
                             f"[-{vocab}, {vocab}) for weight {weight.shape}")
        padding_idx = int(padding_idx) % vocab
    return apply(OPS["embedding"], (x, weight), {"padding_idx": padding_idx})
