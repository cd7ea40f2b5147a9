"""Backend-independent helpers: reduce ops, argument checks, split sizes, counters.

Everything in here depends only on metadata (shapes, dtypes, ints), so every rank that calls a
collective with the same arguments raises the same error before any communication happens.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
COLLECTIVE_NAMES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
    "sendrecv",
    "barrier",
)

# --------------------------------------------------------------------------------------------
# counters
# --------------------------------------------------------------------------------------------

_counts: dict[str, int] = {name: 0 for name in COLLECTIVE_NAMES}


def count(name: str) -> None:
    _counts[name] += 1


def collective_counts() -> dict[str, int]:
    """Number of public collective calls made by this process, per op name (a copy)."""
    return dict(_counts)


def reset_collective_counts() -> None:
    for k in list(_counts):
        _counts[k] = 0


# --------------------------------------------------------------------------------------------
# arrays
# --------------------------------------------------------------------------------------------


def is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "cupy"


def as_array(x: Any, name: str, what: str):
    """numpy/cupy arrays pass through; other array-likes become numpy arrays."""
    if isinstance(x, np.ndarray) or is_cupy(x):
        return x
    try:
        return np.asarray(x)
    except Exception as e:  # pragma: no cover - defensive
        raise TypeError(f"{name}: argument '{what}' must be an array, got "
                        f"{type(x).__name__}") from e


def describe(x) -> str:
    return f"shape={tuple(x.shape)} dtype={np.dtype(x.dtype).name}"


def check_collectives_enabled() -> bool:
    """Debug mode (``DISTTENSOR_CHECK_COLLECTIVES``, read once at import): cross-rank
    agreement check before every collective, and checksums of replicated data."""
    return os.environ.get("DISTTENSOR_CHECK_COLLECTIVES", "0").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
        "off",
    )


CHECK_COLLECTIVES = check_collectives_enabled()


# --------------------------------------------------------------------------------------------
# reduce ops
# --------------------------------------------------------------------------------------------


def normalize_op(op: Any, name: str) -> str:
    """Accept 'sum', 'SUM', str-Enum members (value 'sum') ... and return the lower-case name."""
    val = getattr(op, "value", op)
    if not isinstance(val, str):
        val = str(val)
    s = val.strip().lower()
    if s not in REDUCE_OPS and "." in s:  # e.g. str(ReduceType.SUM) == 'ReduceType.SUM'
        s = s.rsplit(".", 1)[1]
    if s not in REDUCE_OPS:
        raise ValueError(f"{name}: unsupported reduce op {op!r}; expected one of "
                         f"{list(REDUCE_OPS)}")
    return s


_VALID_OPS: dict = {}  # (op as given, dtype) -> normalized op, for calls already validated


def reduce_op(op: Any, dtype, name: str, shape) -> str:
    """``normalize_op`` plus ``check_op_dtype``, cached per (op, dtype)."""
    try:
        return _VALID_OPS[op, dtype]
    except (KeyError, TypeError):
        pass
    s = normalize_op(op, name)
    check_op_dtype(s, dtype, name, shape)
    if len(_VALID_OPS) < 256:
        try:
            _VALID_OPS[op, dtype] = s
        except TypeError:
            pass
    return s


def check_op_dtype(op: str, dtype, name: str, shape) -> None:
    """Reduction semantics per dtype (documented in collectives/__init__.py).

    - float (bfloat16 included)/complex: all ops; complex has no max/min.
    - signed/unsigned integers: sum, prod, max, min. 'avg' raises TypeError (an integer mean is
      not an integer; cast to float first).
    - bool: like numpy ufuncs in bool dtype: sum/max = logical or, prod/min = logical and; 'avg'
      raises TypeError.
    - anything else (object, strings, structured): TypeError.
    """
    dt = np.dtype(dtype)
    where = f"{name}: reduce op '{op}' is not supported for dtype {dt.name} (shape={tuple(shape)})"
    if dt.kind in "iu":
        if op == "avg":
            raise TypeError(where + "; 'avg' needs a floating dtype (cast first)")
    elif dt.kind == "b":
        if op == "avg":
            raise TypeError(where + "; 'avg' needs a floating dtype (cast first)")
    elif dt.kind == "f" or dt.name == "bfloat16":
        pass
    elif dt.kind == "c":
        if op in ("max", "min"):
            raise TypeError(where + "; complex numbers have no order")
    else:
        raise TypeError(where)


# --------------------------------------------------------------------------------------------
# axes and sizes
# --------------------------------------------------------------------------------------------


def norm_axis(axis: Any, ndim: int, name: str, what: str, shape) -> int:
    try:
        a = int(axis)
    except Exception:
        raise TypeError(f"{name}: argument '{what}'={axis!r} must be an int (array "
                        f"shape={tuple(shape)})")
    if not -ndim <= a < ndim:
        raise ValueError(
            f"{name}: argument '{what}'={axis} is out of range for an array of shape "
            f"{tuple(shape)} (ndim={ndim})"
        )
    return a % ndim


def split_sizes(n: int, k: int) -> list[int]:
    """Sizes of numpy.array_split(range(n), k)."""
    q, r = divmod(n, k)
    return [q + 1 if i < r else q for i in range(k)]


def offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def check_sizes(sizes: Optional[Sequence[int]], k: int, name: str, what: str, total: Optional[int],
                shape) -> Optional[list[int]]:
    if sizes is None:
        return None
    try:
        lst = [int(s) for s in sizes]
    except Exception:
        raise TypeError(f"{name}: argument '{what}' must be a sequence of ints, got {sizes!r}")
    if len(lst) != k:
        raise ValueError(f"{name}: argument '{what}'={lst} must have one entry per group rank "
                         f"({k})")
    if any(s < 0 for s in lst):
        raise ValueError(f"{name}: argument '{what}'={lst} has a negative size")
    if total is not None and sum(lst) != total:
        raise ValueError(
            f"{name}: argument '{what}'={lst} sums to {sum(lst)} but the array "
            f"(shape={tuple(shape)}) has {total} along the split axis"
        )
    return lst


def check_peer(peer: Any, size: int, name: str, what: str) -> int:
    try:
        p = int(peer)
    except Exception:
        raise TypeError(f"{name}: argument '{what}'={peer!r} must be an int group rank")
    if not 0 <= p < size:
        raise ValueError(f"{name}: argument '{what}'={p} is out of range for a group of size "
                         f"{size}")
    return p


def check_out(out, shape, dtype, name: str, xp_is_cupy: bool):
    """Validate a user-given output buffer."""
    if out is None:
        return None
    if is_cupy(out) != xp_is_cupy:
        raise TypeError(f"{name}: argument 'out' must be the same array type as the input")
    if tuple(out.shape) != tuple(shape) or np.dtype(out.dtype) != np.dtype(dtype):
        raise ValueError(
            f"{name}: argument 'out' has {describe(out)} but the result has "
            f"shape={tuple(shape)} dtype={np.dtype(dtype).name}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"{name}: argument 'out' ({describe(out)}) must be C-contiguous")
    if not xp_is_cupy and not out.flags.writeable:
        raise ValueError(f"{name}: argument 'out' ({describe(out)}) is read-only")
    return out


class CollectiveMismatchError(RuntimeError):
    """Raised (on every rank) in debug mode when ranks call mismatching collectives."""
