"""einsum (rule ``einsum``) and the reductions that all-reduce their own statistics (rule
``axis_statistics``: logsumexp, var, std, norm)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .base import SpmdResult, TensorMeta, check_axis, mesh_shape_of, op_name, prod, register_rule
from .einsum import contracted_partial, layout, linear_partial, merge_shardings

__all__ = ["einsum", "parse_equation", "axis_statistics"]


def parse_equation(op: str, equation: str, n_inputs: int) -> tuple[list[str], str]:
    """``"ij,jk->ik"`` -> (["ij", "jk"], "ik"): explicit output, letters only, no label twice in
    one operand or in the output, every output label in some input."""
    if not isinstance(equation, str) or "->" not in equation:
        raise ValueError(f"{op}: equation must be an explicit 'in,in->out' string, got "
                         f"{equation!r}")
    lhs, out = equation.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != n_inputs:
        raise ValueError(f"{op}: equation {equation!r} names {len(ins)} operands, got {n_inputs}")
    for term in ins + [out]:
        if not all(c.isalpha() for c in term) or len(set(term)) != len(term):
            raise ValueError(f"{op}: equation {equation!r}: each term must be distinct letters "
                             f"(no '...', no repeated label), got {term!r}")
    missing = set(out) - set("".join(ins))
    if missing:
        raise ValueError(f"{op}: equation {equation!r}: output labels {sorted(missing)} appear "
                         f"in no operand")
    return ins, out


@register_rule("einsum")
def einsum(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """inputs: the operands; attrs equation (explicit, see :func:`parse_equation`).

    Equal labels merge their shardings across operands at the fewest bytes moved; mesh dims
    sharding a label absent from the output make it Partial(sum). One Partial (sum/avg) operand
    stays Partial (the product is linear in each operand; of several, the largest is kept and
    the others resolved)."""
    op = op_name(attrs, "einsum")
    if not metas or any(m is None for m in metas):
        raise ValueError(f"{op}: every operand must be a tensor, got {list(metas)}")
    mesh = mesh_shape_of(op, metas)
    ins, out = parse_equation(op, attrs.get("equation"), len(metas))
    sizes: dict[str, int] = {}
    for k, (term, m) in enumerate(zip(ins, metas)):
        if len(term) != m.ndim:
            raise ValueError(f"{op}: operand {k} of shape {list(m.shape)} has {m.ndim} dims, "
                             f"the equation's term {term!r} {len(term)}")
        for lab, n in zip(term, m.shape):
            if sizes.setdefault(lab, n) != n:
                raise ValueError(f"{op}: label {lab!r} has size {sizes[lab]} and {n} (operand "
                                 f"{k} of shape {list(m.shape)}, equation {attrs['equation']!r})")
    linear = [k for k, m in enumerate(metas) if linear_partial(m.dist_attr)]
    kept_k = max(linear, key=lambda k: (prod(metas[k].shape), -k), default=None)
    kept = [metas[k].dist_attr.partial if k == kept_k else () for k in range(len(metas))]
    exclude = {m for p in kept for m, _ in p}
    notations = [list(t) for t in ins]
    merged = merge_shardings(notations, [m.dist_attr for m in metas], exclude,
                             [m.shape for m in metas], kept)
    partial = [p for ps in kept for p in ps] + contracted_partial(merged, list(out))
    return SpmdResult(tuple(layout(n, merged, mesh, p) for n, p in zip(notations, kept)),
                      (TensorMeta(tuple(sizes[c] for c in out), layout(list(out), merged, mesh,
                                                                       partial)),))


@register_rule("axis_statistics")
def axis_statistics(metas: Sequence[TensorMeta | None], attrs: Mapping[str, Any]) -> SpmdResult:
    """input (x,), attrs axis (a tuple; empty = all), keepdim: a reduction whose kernel
    all-reduces its own per-line statistics over the mesh dims sharding the reduced axes
    (logsumexp: a max and a sum; var: a sum and a sum of squared deviations; norm: a sum of
    squares), so x keeps every shard and is never gathered. A Partial x is resolved (none of
    these is linear). The output keeps the other axes' shards and is not Partial."""
    op = op_name(attrs, "axis_statistics")
    if len(metas) != 1 or metas[0] is None:
        raise ValueError(f"{op}: expected one input tensor, got {list(metas)}")
    (x,) = metas
    mesh_shape_of(op, metas)
    axes = tuple(attrs.get("axis") or range(x.ndim))
    for a in axes:
        check_axis(op, "axis", a, x.ndim)
    keepdim = bool(attrs.get("keepdim", False))
    required = x.dist_attr.without_partial()
    dims = [() if d in axes else dm for d, dm in enumerate(required.dims_mapping)
            if keepdim or d not in axes]
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape) if keepdim or d not in axes)
    return SpmdResult((required,), (TensorMeta(shape, required.with_dims_mapping(dims)),))
