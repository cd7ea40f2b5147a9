"""Data types: Paddle-style names mapped to numpy dtypes (cupy uses the same).

``bfloat16`` is ``ml_dtypes.bfloat16`` (a numpy dtype whose ``kind`` is ``"V"``, not ``"f"``):
ask :func:`is_floating` rather than ``dtype.kind == "f"``."""
from __future__ import annotations

import functools
from typing import Any, Callable

import ml_dtypes
import numpy as np

float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)

_NAMES = {"float16": float16, "bfloat16": bfloat16, "float32": float32, "float64": float64,
          "int32": int32, "int64": int64, "bool": bool_, "uint8": np.dtype(np.uint8),
          "int8": np.dtype(np.int8)}

#: the floating dtypes narrower than float32 (autocast's low precision)
LOW_PRECISION = (float16, bfloat16)


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating dtype (float16, bfloat16, float32, float64)."""
    d = np.dtype(dtype)
    return d.kind == "f" or d == bfloat16


def to_np_dtype(dtype: Any) -> np.dtype:
    """Normalize a dtype given as a name ("float32", "bfloat16"), a numpy dtype or a Python
    type."""
    if isinstance(dtype, str):
        if dtype not in _NAMES:
            raise TypeError(f"dtype: unsupported dtype name {dtype!r}; expected one of "
                            f"{sorted(_NAMES)}")
        return _NAMES[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype: cannot interpret {dtype!r} as a dtype") from e
    if d.kind not in "biuf" and d != bfloat16:
        raise TypeError(f"dtype: unsupported dtype {d}")
    return d


def promote_floating(a: Any, b: Any) -> np.dtype:
    """Paddle's promotion of two floating dtypes: the wider one; float16 with bfloat16 gives
    float32 (neither holds the other)."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.itemsize > b.itemsize else b


def float32_compute(kernel: Callable, name: str, spec: dict, dtype_rule: Callable) -> Callable:
    """``kernel`` made to run bfloat16 numpy inputs in float32 and round its floating results
    to the op's output dtypes (numpy has no bfloat16 arithmetic of its own: ml_dtypes' loops are
    slow, and its matmul returns float32). Other calls go straight to ``kernel``. Views and casts
    run as they are (they move bytes, or convert themselves); inputs the op mutates get the
    float32 result written back."""
    if name == "cast" or spec.get("view"):
        return kernel
    mutated = tuple(i for i, _ in spec.get("mutates", ()))
    bf16 = bfloat16  # a closure cell: the check below runs on every kernel call

    @functools.wraps(kernel)
    def run(xp, *arrays, **attrs):
        for a in arrays:
            if a is not None and a.dtype is bf16:
                break
        else:
            return kernel(xp, *arrays, **attrs)
        wide = tuple(a.astype(float32) if a is not None and a.dtype is bfloat16 else a
                     for a in arrays)
        out = attrs.pop("out", None)
        res = kernel(xp, *wide, **attrs)
        attrs.pop("ctx", None)
        want = dtype_rule([None if a is None else a.dtype for a in arrays], attrs)
        single = not isinstance(res, tuple)
        results = list((res,) if single else res)
        for i in mutated:
            if wide[i] is not arrays[i]:
                np.copyto(arrays[i], wide[i], casting="unsafe")
                results = [arrays[i] if r is wide[i] else r for r in results]
        for k, r in enumerate(results):
            if k < len(want) and r is not None and r.dtype != want[k]:
                results[k] = r.astype(want[k])
        if out is not None and single:
            np.copyto(out, results[0], casting="unsafe")
            return out
        return results[0] if single else tuple(results)
    return run
