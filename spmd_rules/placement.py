"""Placements: how one mesh dimension lays out a tensor (Shard / Replicate / Partial)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["ReduceType", "Placement", "Shard", "Replicate", "Partial", "LINEAR_REDUCE_TYPES",
           "LOGICAL_REDUCE_TYPES"]


class ReduceType(str, Enum):
    """How the pending values of a Partial placement combine (compares equal to the plain
    string)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    ANY = "any"  # logical or (bool tensors)
    ALL = "all"  # logical and (bool tensors)
    # Paddle-style aliases (same members).
    kRedSum = "sum"
    kRedAvg = "avg"
    kRedMax = "max"
    kRedMin = "min"
    kRedProd = "prod"
    kRedAny = "any"
    kRedAll = "all"

    def __str__(self) -> str:
        return self.value


#: Reduce types under which a pending value is a linear combination of the pieces, so that
#: linear ops (add, scale, matmul by a non-partial operand, sum, reshape...) commute with it.
LINEAR_REDUCE_TYPES = frozenset({ReduceType.SUM, ReduceType.AVG})

#: Reduce types that only a bool tensor may carry (logical or / and of the pieces).
LOGICAL_REDUCE_TYPES = frozenset({ReduceType.ANY, ReduceType.ALL})


@dataclass(frozen=True)
class Placement:
    """Base class of the three placements."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicated(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True, repr=False)
class Shard(Placement):
    """The mesh dim splits tensor dim ``dim`` (numpy.array_split, uneven allowed).

    Args:
        dim (int): the tensor dim to split.
        shard_order (int, optional): Paddle's co-shard order: where this mesh dim's split comes
            when several mesh dims shard the same tensor dim: 0 splits the whole dim, 1 splits
            each of those pieces, and so on. Either every Shard of one tensor dim gives it (a
            permutation of 0..k-1) or none does (then mesh dims split in ascending mesh-dim
            order, the default). ``[Shard(0, shard_order=1), Shard(0, shard_order=0)]`` on a
            [dp, tp] mesh splits dim 0 over tp first and each tp piece over dp (FSDP over TP).
        split_factor (int, optional): the *strided* shard (PyTorch's ``_StridedShard``): the
            dim (or the piece an outer mesh dim left) is cut into ``split_factor`` sections by
            numpy.array_split, each section is split over the mesh dim as ``Shard`` splits a
            dim, and coordinate r holds the r-th piece of every section, in section order.
            The layout of a fused projection: a ``[h, 3h]`` QKV weight placed
            ``Shard(1, split_factor=3)`` gives rank r the r-th column block of each of Q, K
            and V, so splitting the output in three gives plain ``Shard`` pieces. Default 1
            (plain).

    Examples:
        .. code-block:: python

            >>> import disttensor as dt
            >>> dt.Shard(1, split_factor=3)
            Shard(dim=1, split_factor=3)
            >>> dt.Shard(0, split_factor=1) == dt.Shard(0)
            True
    """

    dim: int
    shard_order: int | None = None
    split_factor: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"Shard(dim): dim must be an int, got {self.dim!r}")
        o = self.shard_order
        if o is not None and (isinstance(o, bool) or not isinstance(o, int) or o < 0):
            raise ValueError(f"Shard(shard_order): must be None or an int >= 0, got {o!r}")
        k = self.split_factor
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Shard(split_factor): must be an int >= 1, got {k!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def is_strided(self) -> bool:
        """True for a strided shard (``split_factor > 1``)."""
        return self.split_factor > 1

    def get_dim(self) -> int:
        """The tensor dim this placement splits (Paddle's ``Shard.get_dim``)."""
        return self.dim

    def __repr__(self) -> str:
        extra = "" if self.shard_order is None else f", shard_order={self.shard_order}"
        extra += "" if self.split_factor == 1 else f", split_factor={self.split_factor}"
        return f"Shard(dim={self.dim}{extra})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every coordinate of the mesh dim holds the whole tensor (along that mesh dim)."""

    def is_replicated(self) -> bool:
        return True


@dataclass(frozen=True, repr=False)
class Partial(Placement):
    """Every coordinate holds a pending value; the real value is their reduction by
    ``reduce_type``."""

    reduce_type: ReduceType = ReduceType.SUM

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "reduce_type", ReduceType(self.reduce_type))
        except ValueError:
            raise ValueError(
                f"Partial(reduce_type): unknown reduce type {self.reduce_type!r}; "
                f"expected one of {[r.value for r in ReduceType]}") from None

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_type.value})"
