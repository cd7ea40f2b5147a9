"""Matrix product with numpy matmul semantics (rule ``matmul``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, mesh_shape_of, op_name, prod, register_rule, require
from .dist_attr import DistAttr
from .einsum import broadcast_notations, contracted_partial, layout, linear_partial, merge_shardings
from .redistribute import reshard_cost

__all__ = ["matmul"]


@register_rule("matmul")
def matmul(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs (x, y), attrs transpose_x / transpose_y (ignored for 1-d operands).

    Notation ``...mk, ...kn -> ...mn`` with broadcast batch dims (size-1 broadcast batch dims
    replicated) and numpy's 1-d promotion (a 1-d x has no m, a 1-d y no n). Shardings of m, k,
    n and batch axes merge across x and y (x first); mesh dims sharding k make the output
    Partial(sum). A Partial (sum/avg) input may stay Partial (linearity), and the output with
    it; when both are, the smaller one is resolved (one all-reduce of the fewer bytes); other
    partial inputs are resolved. Keeping a Partial is compared with resolving it, counting
    the bytes of the inputs' reshards plus the output's eventual reduction: after a
    normalisation whose output is Partial, a column-parallel weight stays sharded and the
    (small) activation is all-reduced, rather than the weight gathered and the (larger)
    output left Partial.
    """
    op = op_name(attrs, "matmul")
    require(metas, op, 2)
    x, y = metas
    mesh = mesh_shape_of(op, metas)
    tx, ty = bool(attrs.get("transpose_x", False)), bool(attrs.get("transpose_y", False))
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"{op}: operands must have at least 1 dim, got x {x.shape}, y {y.shape}")
    if x.ndim == 1:
        x_tail, m = ["k"], None
    else:
        x_tail = ["k", "m"] if tx else ["m", "k"]
        m = x.shape[-1] if tx else x.shape[-2]
    if y.ndim == 1:
        y_tail, n = ["k"], None
    else:
        y_tail = ["n", "k"] if ty else ["k", "n"]
        n = y.shape[-2] if ty else y.shape[-1]
    xk = x.shape[x_tail.index("k") - len(x_tail)]
    yk = y.shape[y_tail.index("k") - len(y_tail)]
    if xk != yk:
        raise ValueError(f"{op}: contracted sizes differ: x {x.shape} (transpose_x={tx}) and "
                         f"y {y.shape} (transpose_y={ty}) give {xk} vs {yk}")
    batch, (xb, yb) = broadcast_notations(op, [x.shape[:-len(x_tail)], y.shape[:-len(y_tail)]],
                                          ["x batch", "y batch"])
    x_not, y_not = xb + x_tail, yb + y_tail
    out_not = (list(range(len(batch))) + (["m"] if m is not None else [])
               + (["n"] if n is not None else []))
    out_shape = batch + tuple(s for s in (m, n) if s is not None)

    xa, ya = x.dist_attr, y.dist_attr
    # one Partial (sum/avg) operand stays Partial; with two, the smaller one is resolved
    x_lin, y_lin = linear_partial(xa), linear_partial(ya)
    if x_lin and y_lin:
        x_lin = prod(x.shape) >= prod(y.shape)
        y_lin = not x_lin
    x_keep = xa.partial if x_lin else ()
    y_keep = ya.partial if y_lin else ()
    nots, shapes = (x_not, y_not, out_not), (x.shape, y.shape, out_shape)
    ins, out = _layouts(nots, (xa, ya), shapes, mesh, (x_keep, y_keep))
    if x_keep or y_keep:
        resolved = _layouts(nots, (xa, ya), shapes, mesh, ((), ()))
        if _bytes(shapes, (xa, ya), *resolved) < _bytes(shapes, (xa, ya), ins, out):
            ins, out = resolved
    return SpmdResult(ins, (TensorMeta(out_shape, out),))


def _layouts(nots, attrs, shapes, mesh, keeps) -> tuple[tuple[DistAttr, DistAttr], DistAttr]:
    """The inputs' and the output's layouts when input i keeps the partials ``keeps[i]``."""
    x_not, y_not, out_not = nots
    x_keep, y_keep = keeps
    exclude = {md for md, _ in x_keep + y_keep}
    merged = merge_shardings([x_not, y_not], list(attrs), exclude, list(shapes[:2]),
                             [x_keep, y_keep])
    out = layout(out_not, merged, mesh, list(x_keep + y_keep) + contracted_partial(merged, out_not))
    return (layout(x_not, merged, mesh, x_keep), layout(y_not, merged, mesh, y_keep)), out


def _bytes(shapes, attrs, ins, out: DistAttr) -> int:
    """Elements received by the inputs' reshards to ``ins`` and by reducing ``out``'s
    Partial later."""
    moved = sum(reshard_cost(tuple(s), 1, a, b) for s, a, b in zip(shapes, attrs, ins))
    return moved + reshard_cost(tuple(shapes[2]), 1, out, out.without_partial())
