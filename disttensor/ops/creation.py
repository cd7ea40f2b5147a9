"""Creation ops (dense): zeros, ones, full, arange, rand, randn, and the seeded generator."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dtype import to_np_dtype
from ..tensor import DenseTensor, Tensor, _resolve_place


class _Generator:
    """The global seeded generator (``dt.seed``) behind rand/randn and dropout seeds."""

    def __init__(self, seed: int = 0):
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)

    def next_seed(self) -> int:
        return int(self.rng.integers(0, 2**62))


default_generator = _Generator(0)


def seed(s: int) -> _Generator:
    """Seed the global generator (rand, randn, dropout); every rank must use the same seed."""
    default_generator.manual_seed(s)
    return default_generator


def numel(x: Tensor, name: str | None = None) -> Tensor:
    """The (global) number of elements of ``x`` as a 0-d int64 tensor on x's device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"numel: x must be a Tensor, got {type(x).__name__}")
    arr = np.asarray(x.size, dtype=np.int64)
    local = x._local_array()
    if not isinstance(local, np.ndarray):
        with local.device:
            arr = __import__("cupy").asarray(arr)
    return Tensor(DenseTensor(arr))


def _shape(op: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, Tensor):
        shape = shape.tolist()
    if isinstance(shape, (int, np.integer)):
        shape = [shape]
    out = tuple(int(s) for s in shape)
    if any(s < 0 for s in out):
        raise ValueError(f"{op}: shape {list(out)} has a negative dim")
    return out


def _new(arr, place) -> Tensor:
    xp, dev = _resolve_place(place)
    if xp is not np:
        with xp.cuda.Device(dev):
            arr = xp.asarray(arr)
    return Tensor(DenseTensor(arr))


def full(shape: Sequence[int], fill_value: Any, dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    """A new tensor of ``shape`` filled with ``fill_value`` (float32 unless dtype is given)."""
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return _new(np.full(_shape("full", shape), fill_value, dtype=d), place)


def zeros(shape: Sequence[int], dtype: Any = None, place: str | None = None,
          name: str | None = None) -> Tensor:
    return full(shape, 0, dtype, place)


def ones(shape: Sequence[int], dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    return full(shape, 1, dtype, place)


def arange(start: float = 0, end: float | None = None, step: float = 1, dtype: Any = None,
           place: str | None = None, name: str | None = None) -> Tensor:
    """Values from start (inclusive) to end (exclusive); int64 for integer arguments."""
    if end is None:
        start, end = 0, start
    if step == 0:
        raise ValueError("arange: step must not be 0")
    if dtype is None:
        ints = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
        dtype = "int64" if ints else "float32"
    return _new(np.arange(start, end, step, dtype=to_np_dtype(dtype)), place)


def rand(shape: Sequence[int], dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    """Uniform [0, 1) samples from the global generator."""
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return _new(default_generator.rng.random(_shape("rand", shape)).astype(d), place)


def randn(shape: Sequence[int], dtype: Any = None, place: str | None = None,
          name: str | None = None) -> Tensor:
    """Standard normal samples from the global generator."""
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return _new(default_generator.rng.standard_normal(_shape("randn", shape)).astype(d), place)


def uniform(shape: Sequence[int], dtype: Any = None, min: float = -1.0, max: float = 1.0,
            place: str | None = None) -> Tensor:
    """Uniform [min, max) samples from the global generator."""
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return _new(default_generator.rng.uniform(min, max, _shape("uniform", shape)).astype(d), place)
