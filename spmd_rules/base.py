"""Rule signature, result types, the rule registry and small shared checks."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import wraps
from typing import Any

from .dist_attr import DistAttr

__all__ = ["TensorMeta", "SpmdResult", "Rule", "RULES", "register_rule", "get_rule",
           "rule_coverage", "FALLBACK_RULE", "plain_metas", "register_strided"]


@dataclass(frozen=True)
class TensorMeta:
    """Global shape and layout of one tensor (dtype is not needed by any rule)."""

    shape: tuple[int, ...]
    dist_attr: DistAttr

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"TensorMeta: negative size in shape {shape}")
        if len(shape) != self.dist_attr.ndim:
            raise ValueError(f"TensorMeta: shape {shape} has {len(shape)} dims but dist_attr "
                             f"{self.dist_attr} has {self.dist_attr.ndim}")

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class SpmdResult:
    """``inputs``: the layout each input must have (None for absent inputs);
    ``outputs``: each output's global shape and layout (Partial included)."""

    inputs: tuple[DistAttr | None, ...]
    outputs: tuple[TensorMeta, ...]


Rule = Callable[[Sequence["TensorMeta | None"], Mapping[str, Any]], SpmdResult]

#: rule name -> infer_forward function
RULES: dict[str, Rule] = {}

#: name of the replicated fallback rule
FALLBACK_RULE = "replicated"


#: rule name -> the rule as written (it never sees a strided shard)
PLAIN_RULES: dict[str, Rule] = {}


def plain_metas(metas: Sequence[TensorMeta | None]) -> tuple[TensorMeta | None, ...]:
    """``metas`` with every strided shard made plain (same mesh dims on the same dims)."""
    return tuple(m if m is None or not m.dist_attr.split_factors
                 else TensorMeta(m.shape, m.dist_attr.without_split_factors()) for m in metas)


def _plain_only(fn: Rule) -> Rule:
    """``fn`` seeing strided inputs as plain shards: the layouts it requires are plain, so the
    runtime reshards a strided input first (never a wrong value)."""
    @wraps(fn)
    def rule(metas, attrs):
        if any(m is not None and m.dist_attr.split_factors for m in metas):
            metas = plain_metas(metas)
        return fn(metas, attrs)
    return rule


def register_rule(name: str) -> Callable[[Rule], Rule]:
    """Decorator registering ``infer_forward`` under ``name``. Strided shards reach it as plain
    ones unless :func:`register_strided` gives the rule a strided-aware front."""
    def deco(fn: Rule) -> Rule:
        if name in RULES:
            raise ValueError(f"register_rule: rule {name!r} is already registered")
        PLAIN_RULES[name] = fn
        RULES[name] = _plain_only(fn)
        return fn
    return deco


def register_strided(name: str) -> Callable[[Callable[..., SpmdResult]], Rule]:
    """Decorator giving the registered rule ``name`` a strided-aware front
    ``fn(metas, attrs, plain)`` (it answers every call), ``plain`` being the rule that sees
    strided inputs as plain shards (the front's fallback)."""
    def deco(fn: Callable[..., SpmdResult]) -> Rule:
        plain = _plain_only(PLAIN_RULES[name])

        @wraps(PLAIN_RULES[name])
        def rule(metas, attrs):
            return fn(metas, attrs, plain)
        RULES[name] = rule
        return rule
    return deco


def get_rule(name: str) -> Rule:
    try:
        return RULES[name]
    except KeyError:
        raise KeyError(f"no SPMD rule named {name!r}; known rules: {sorted(RULES)}") from None


def rule_coverage(op_to_rule: Mapping[str, str | None]) -> dict[str, list[str]]:
    """Split ops into ``"rule"`` (a real rule), ``"fallback"`` (the replicated rule, or none given)
    and ``"unknown"`` (a rule name that is not registered); each list sorted."""
    out: dict[str, list[str]] = {"rule": [], "fallback": [], "unknown": []}
    for op, rule in op_to_rule.items():
        if rule is None or rule == FALLBACK_RULE:
            out["fallback"].append(op)
        elif rule in RULES:
            out["rule"].append(op)
        else:
            out["unknown"].append(op)
    return {k: sorted(v) for k, v in out.items()}


# ---------------------------------------------------------------- shared checks

def op_name(attrs: Mapping[str, Any], default: str) -> str:
    return str(attrs.get("op", default))


def mesh_shape_of(op: str, metas: Sequence[TensorMeta | None],
                  attrs: Mapping[str, Any] | None = None
                  ) -> tuple[int, ...]:
    """The common mesh shape of the present inputs (ValueError if they differ or none is present,
    unless attrs gives "mesh_shape")."""
    shapes = {m.dist_attr.mesh_shape for m in metas if m is not None}
    if len(shapes) > 1:
        raise ValueError(f"{op}: inputs are on meshes of different shapes {sorted(shapes)}")
    if shapes:
        return shapes.pop()
    if attrs is not None and attrs.get("mesh_shape") is not None:
        return tuple(attrs["mesh_shape"])
    raise ValueError(f"{op}: no input tensor and no mesh_shape attribute")


def require(metas: Sequence[TensorMeta | None], op: str, count: int,
            optional: Sequence[int] = ()) -> None:
    """Check the number of inputs and that non-optional ones are present."""
    if len(metas) != count:
        raise ValueError(f"{op}: expected {count} inputs, got {len(metas)}")
    for i, m in enumerate(metas):
        if m is None and i not in optional:
            raise ValueError(f"{op}: input {i} is required")


def check_ndim(op: str, arg: str, meta: TensorMeta, ndims: Sequence[int] | None = None,
               min_ndim: int | None = None) -> None:
    if ndims is not None and meta.ndim not in ndims:
        raise ValueError(f"{op}: {arg} must have ndim in {list(ndims)}, got shape {meta.shape}")
    if min_ndim is not None and meta.ndim < min_ndim:
        raise ValueError(f"{op}: {arg} must have at least {min_ndim} dims, got shape {meta.shape}")


def check_axis(op: str, name: str, axis: Any, ndim: int, allow_end: bool = False) -> int:
    """A non-negative axis < ndim (<= ndim with allow_end)."""
    hi = ndim + 1 if allow_end else ndim
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < hi:
        raise ValueError(f"{op}: {name}={axis!r} out of range for ndim {ndim}")
    return axis


def prod(values: Sequence[int]) -> int:
    n = 1
    for v in values:
        n *= v
    return n
