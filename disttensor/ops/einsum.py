"""einsum and outer (rule ``einsum``): equal labels keep their shards across operands, labels
summed away make the output Partial(sum) where they were sharded (as matmul's contracted dim).
The gradient of each operand is the einsum of the output gradient with the other operands."""
from __future__ import annotations

from spmd_rules.contraction import parse_equation

from ..dispatch import apply
from ..schema import OPS, equal_dtypes, public, register
from ..tensor import Tensor
from .common import as_tensor, constant
from .shape import expand, reshape_to


def _einsum_kernel(xp, x, y, equation):
    return xp.asarray(xp.einsum(equation, x, y))


def _grad_of(g: Tensor, out: str, ins: list[str], operands: list, k: int,
             shape: tuple) -> Tensor:
    """d(sum(g * einsum(x, y)))/d operand k: the einsum of g with the other operand onto the
    labels of operand k they carry, broadcast over the labels only operand k had."""
    other, lab = operands[1 - k], ins[1 - k]
    avail = set(out) | set(lab)
    target = "".join(c for c in ins[k] if c in avail)
    grad = apply(OPS["einsum"], (g, other), {"equation": f"{out},{lab}->{target}"})
    if target != ins[k]:
        grad = expand(reshape_to(grad, [shape[i] if c in avail else 1
                                        for i, c in enumerate(ins[k])]), list(shape))
    return grad


def _einsum_bwd(node, g):
    ins, out = parse_equation("einsum", node.attrs["equation"], 2)
    operands = [node.saved_tensor(0), node.saved_tensor(1)]
    return tuple(_grad_of(g, out, ins, operands, k, tuple(node.in_shapes[k]))
                 if node.needs_grad(k) else None for k in range(2))


# two operands (the public function contracts more pairwise; one operand pairs with a 0-d 1)
register("einsum", _einsum_kernel, backward=_einsum_bwd, rule="einsum", save_inputs=(0, 1),
         dtype=equal_dtypes)


def _outer_bwd(node, g):
    x, y = node.saved_tensor(0), node.saved_tensor(1)
    return (apply(OPS["einsum"], (g, y), {"equation": "ij,j->i"}) if node.needs_grad(0) else None,
            apply(OPS["einsum"], (g, x), {"equation": "ij,i->j"}) if node.needs_grad(1) else None)


register("outer", lambda xp, x, y: xp.outer(x, y), backward=_outer_bwd, rule="einsum",
         rule_attrs={"equation": "i,j->ij"}, save_inputs=(0, 1), dtype=equal_dtypes)


def _explicit(equation: str) -> str:
    """numpy's implicit output (the labels used once, alphabetically) made explicit."""
    eq = equation.replace(" ", "")
    if "->" in eq:
        return eq
    labels = eq.replace(",", "")
    return eq + "->" + "".join(sorted(c for c in set(labels) if labels.count(c) == 1))


@public()
def einsum(equation: str, *operands: Tensor) -> Tensor:
    """Sum of products over the labels of ``equation`` (numpy's einsum; explicit ``->`` or
    implicit output). Letters only: no ``...`` and no label repeated within one operand.

    Example: ``dt.einsum("bhqd,bhkd->bhqk", q, k)`` (attention scores; heads stay sharded)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum: no operands given")
    ts = [as_tensor(t) for t in operands]
    eq = _explicit(equation) if isinstance(equation, str) else equation
    ins, _ = parse_equation("einsum", eq, len(ts))
    sizes: dict[str, int] = {}
    for k, (term, t) in enumerate(zip(ins, ts)):
        if len(term) != t.ndim:
            raise ValueError(f"einsum: operand {k} of shape {t.shape} has {t.ndim} dims, the "
                             f"equation's term {term!r} {len(term)}")
        for c, n in zip(term, t.shape):
            if sizes.setdefault(c, n) != n:
                raise ValueError(f"einsum: label {c!r} has size {sizes[c]} and {n} (operand {k} "
                                 f"of shape {t.shape}, equation {equation!r})")
    out = eq.split("->")[1]
    if len(ts) == 1:
        return apply(OPS["einsum"], (ts[0], constant(1, ts[0].dtype, like=ts[0])),
                     {"equation": f"{ins[0]},->{out}"})
    acc, acc_lab = ts[0], ins[0]
    for j in range(1, len(ts)):  # pairwise, keeping the labels the rest still needs
        need = set(out).union(*[set(t) for t in ins[j + 1:]])
        lab = out if j == len(ts) - 1 else "".join(
            dict.fromkeys(c for c in acc_lab + ins[j] if c in need))
        acc = apply(OPS["einsum"], (acc, ts[j]), {"equation": f"{acc_lab},{ins[j]}->{lab}"})
        acc_lab = lab
    return acc


@public(methods=True)
def outer(x: Tensor, y: Tensor, name: str | None = None) -> Tensor:
    """The outer product of x and y flattened: shape ``[x.size, y.size]`` (Paddle's outer).
    Example: ``dt.outer(positions, inv_freq)`` gives rotary angles."""
    x, y = as_tensor(x), as_tensor(y)
    if x.ndim != 1:
        x = reshape_to(x, [x.size])
    if y.ndim != 1:
        y = reshape_to(y, [y.size])
    return apply(OPS["outer"], (x, y), {})
