"""Data types: Paddle-style names mapped to numpy dtypes (cupy uses the same)."""
from __future__ import annotations

from typing import Any

import numpy as np

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)
int32 = np.dtype(np.int32)
int64 = np.dtype(np.int64)
bool_ = np.dtype(np.bool_)

_NAMES = {"float16": float16, "float32": float32, "float64": float64, "int32": int32,
          "int64": int64, "bool": bool_, "uint8": np.dtype(np.uint8), "int8": np.dtype(np.int8)}


def to_np_dtype(dtype: Any) -> np.dtype:
    """Normalize a dtype given as a name ("float32"), a numpy dtype or a Python type."""
    if isinstance(dtype, str):
        if dtype not in _NAMES:
            raise TypeError(f"dtype: unsupported dtype name {dtype!r}; expected one of "
                            f"{sorted(_NAMES)}")
        return _NAMES[dtype]
    try:
        d = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype: cannot interpret {dtype!r} as a dtype") from e
    if d.kind not in "biuf":
        raise TypeError(f"dtype: unsupported dtype {d}")
    return d
