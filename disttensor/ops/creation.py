"""Creation ops (dense, no tensor inputs): ``assign_value`` (a copy of host data, behind
``to_tensor`` and every Python constant), ``host_scalar`` (a 0-d tensor holding what a Python
callback returns *when the op runs*: a replayed program reads the current learning rate through
it), ``full``, ``arange`` and the random ``rand``,
``randn``, ``uniform``, whose kernels draw from the global generator when they run. Each takes a
``place`` attr ("cpu", "gpu:N") that picks the array module. No rule: they have no inputs."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..dispatch import apply
from ..dtype import is_floating, to_np_dtype
from ..generator import Generator, default_generator
from ..schema import OPS, attr_dtype, public, register
from ..tensor import Tensor
from .common import constant

__all__ = ["seed", "to_tensor", "full", "zeros", "ones", "arange", "rand", "randn", "uniform",
           "numel", "host_scalar"]


def _to_host(a: Any):
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        return a.get()
    return a


def _assign_value_kernel(xp, value, dtype, place=None):
    if xp is np:
        return np.array(_to_host(value), dtype=dtype, order="C", copy=True)
    return xp.array(value, dtype=dtype, order="C", copy=True)


register("assign_value", _assign_value_kernel, rule=None, dtype=attr_dtype())
register("full", lambda xp, shape, fill_value, dtype, place=None: xp.full(shape, fill_value,
                                                                       dtype=dtype),
         rule=None, dtype=attr_dtype())
register("arange", lambda xp, start, end, step, dtype, place=None: xp.arange(start, end, step,
                                                                          dtype=dtype),
         rule=None, dtype=attr_dtype())


register("host_scalar", lambda xp, fn, dtype, place=None: xp.asarray(fn(), dtype=dtype),
         rule=None, dtype=attr_dtype())


def _draw(xp, host: np.ndarray):
    return host if xp is np else xp.asarray(host)


register("rand", lambda xp, shape, dtype, place=None: _draw(
    xp, default_generator.rng.random(shape).astype(dtype)), rule=None,
         dtype=attr_dtype())
register("randn", lambda xp, shape, dtype, place=None: _draw(
    xp, default_generator.rng.standard_normal(shape).astype(dtype)), rule=None,
         dtype=attr_dtype())
register("uniform", lambda xp, shape, dtype, min, max, place=None: _draw(
    xp, default_generator.rng.uniform(min, max, shape).astype(dtype)), rule=None,
         dtype=attr_dtype())


@public()
def seed(s: int) -> Generator:
    """Seed the global generator (rand, randn, initializers, dropout); every rank must use the
    same seed."""
    return default_generator.manual_seed(s)


def _shape(op: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, Tensor):
        shape = shape.tolist()
    if isinstance(shape, (int, np.integer)):
        shape = [shape]
    if not isinstance(shape, (list, tuple)):
        raise TypeError(f"{op}: argument 'shape' must be an int or a sequence of ints, got "
                        f"{type(shape).__name__} {shape!r}")
    try:
        out = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: argument 'shape' must be a sequence of ints, got "
                        f"{list(shape)!r}") from None
    if any(s < 0 for s in out):
        raise ValueError(f"{op}: argument 'shape' {list(out)} has a negative dim")
    return out


def _place_attr(op: str, place: Any) -> str | None:
    if place is None or place == "cpu" or (isinstance(place, str) and (
            place == "gpu" or place.startswith("gpu:"))):
        return place
    raise ValueError(f"{op}: place must be 'cpu', 'gpu' or 'gpu:N', got {place!r}")


def _place_of(a: Any) -> str | None:
    """The place of an array-like: "gpu:N" for cupy arrays, None otherwise."""
    dev = getattr(a, "device", None)
    return f"gpu:{dev.id}" if hasattr(dev, "id") else None


@public()
def to_tensor(data: Any, dtype: Any = None, place: str | None = None,
              stop_gradient: bool = True) -> Tensor:
    """A new dense Tensor holding a copy of ``data`` (scalar, list, numpy/cupy array, Tensor).

    Floating data defaults to float32 (like Paddle) unless it is a typed array, whose dtype is
    kept; integers default to int64; bools stay bool."""
    if isinstance(data, Tensor):
        if data.is_dist():
            raise ValueError("to_tensor: data is a distributed tensor; use dtensor_to_local or "
                             "unshard_dtensor first")
        data = data._value.array
    place = _place_attr("to_tensor", place if place is not None or isinstance(data, np.ndarray)
                        else _place_of(data))
    if dtype is not None:
        npd = to_np_dtype(dtype)
    else:
        arr = data if hasattr(data, "dtype") else np.asarray(data)
        npd = np.dtype(arr.dtype)
        if not hasattr(data, "dtype"):  # Python data: Paddle's defaults
            if npd.kind == "f":
                npd = np.dtype(np.float32)
            elif npd.kind in "iu":
                npd = np.dtype(np.int64)
    if npd.kind not in "biuf" and not is_floating(npd):
        raise TypeError(f"to_tensor: unsupported dtype {npd} of data {type(data).__name__}")
    out = apply(OPS["assign_value"], (), {"value": data, "dtype": npd, "place": place})
    out.stop_gradient = bool(stop_gradient)
    return out


@public()
def full(shape: Sequence[int], fill_value: Any, dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    """A new tensor of ``shape`` filled with ``fill_value`` (float32 unless dtype is given)."""
    if isinstance(fill_value, Tensor):
        fill_value = fill_value.item()
    return _full("full", shape, fill_value, dtype, place)


def _full(op: str, shape: Any, fill_value: Any, dtype: Any, place: str | None) -> Tensor:
    """``full`` on behalf of ``op`` (zeros, ones), whose name the errors carry."""
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return apply(OPS["full"], (), {"shape": _shape(op, shape), "fill_value": fill_value,
                                   "dtype": d, "place": _place_attr(op, place)})


@public()
def zeros(shape: Sequence[int], dtype: Any = None, place: str | None = None,
          name: str | None = None) -> Tensor:
    """A new tensor of zeros (float32 unless dtype is given)."""
    return _full("zeros", shape, 0, dtype, place)


@public()
def ones(shape: Sequence[int], dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    """A new tensor of ones (float32 unless dtype is given)."""
    return _full("ones", shape, 1, dtype, place)


@public()
def arange(start: float = 0, end: float | None = None, step: float = 1, dtype: Any = None,
           place: str | None = None, name: str | None = None) -> Tensor:
    """Values from start (inclusive) to end (exclusive); int64 for integer arguments."""
    if end is None:
        start, end = 0, start
    for arg, v in (("start", start), ("end", end), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"arange: {arg} must be a number, got {type(v).__name__} {v!r}")
    if step == 0:
        raise ValueError("arange: step must not be 0")
    if dtype is None:
        ints = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
        dtype = "int64" if ints else "float32"
    return apply(OPS["arange"], (), {"start": start, "end": end, "step": step,
                                     "dtype": to_np_dtype(dtype),
                                     "place": _place_attr("arange", place)})


def _random(op: str, shape, dtype, place, **extra) -> Tensor:
    d = to_np_dtype(dtype if dtype is not None else "float32")
    return apply(OPS[op], (), {"shape": _shape(op, shape), "dtype": d,
                               "place": _place_attr(op, place), **extra})


@public()
def rand(shape: Sequence[int], dtype: Any = None, place: str | None = None,
         name: str | None = None) -> Tensor:
    """Uniform [0, 1) samples from the global generator."""
    return _random("rand", shape, dtype, place)


@public()
def randn(shape: Sequence[int], dtype: Any = None, place: str | None = None,
          name: str | None = None) -> Tensor:
    """Standard normal samples from the global generator."""
    return _random("randn", shape, dtype, place)


@public()
def uniform(shape: Sequence[int], dtype: Any = None, min: float = -1.0, max: float = 1.0,
            place: str | None = None) -> Tensor:
    """Uniform [min, max) samples from the global generator."""
    return _random("uniform", shape, dtype, place, min=float(min), max=float(max))


def host_scalar(fn, dtype: Any = "float64") -> Tensor:
    """A 0-d tensor of ``fn()`` (called when the op runs, also on replay)."""
    return apply(OPS["host_scalar"], (), {"fn": fn, "dtype": to_np_dtype(dtype), "place": None})


@public()
def numel(x: Tensor, name: str | None = None) -> Tensor:
    """The (global) number of elements of ``x`` as a 0-d int64 tensor on x's device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"numel: x must be a Tensor, got {type(x).__name__}")
    return constant(x.size, np.int64, x)
