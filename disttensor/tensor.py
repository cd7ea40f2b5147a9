"""The three objects behind a user's tensor (DESIGN §2).

* :class:`Holder` — one allocation (the base array) plus the inplace version counter that every
  view of it shares.
* :class:`DenseTensor` — an n-d window (dtype, shape, strides, offset) onto a holder; its
  ``array`` is a numpy/cupy view of the holder's buffer.
* :class:`Tensor` — what users hold: a DenseTensor or a DistTensor plus autograd state.

Ops and methods are attached to :class:`Tensor` by :mod:`disttensor.ops`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .dtype import to_np_dtype

__all__ = ["Holder", "DenseTensor", "Tensor", "to_tensor", "is_tensor"]


class Holder:
    """One buffer and its inplace version counter (shared by all views of the buffer)."""

    __slots__ = ("buffer", "version")

    def __init__(self, buffer: Any):
        self.buffer = buffer
        self.version = 0


class DenseTensor:
    """A strided view (``array``) onto a :class:`Holder`'s buffer."""

    __slots__ = ("array", "holder")

    def __init__(self, array: Any, holder: Holder | None = None):
        self.array = array
        self.holder = Holder(array) if holder is None else holder

    def view(self, array: Any) -> "DenseTensor":
        """A DenseTensor over ``array`` (a view of this one's buffer) sharing the holder."""
        return DenseTensor(array, self.holder)

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements (not bytes)."""
        item = self.array.itemsize
        return tuple(s // item for s in self.array.strides)

    @property
    def offset(self) -> int:
        """Offset in elements of the first element from the start of the holder's buffer."""
        base = self.holder.buffer
        return (_address(self.array) - _address(base)) // max(self.array.itemsize, 1)


def _address(a: Any) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return int(a.data.ptr)


def array_module(a: Any):
    """numpy for numpy arrays, cupy for cupy arrays."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


class Tensor:
    """A (possibly distributed) tensor with autograd state.

    ``_value`` is a :class:`DenseTensor` or a :class:`disttensor.distributed.DistTensor`.
    ``_node``/``_slot`` name the grad node output that produced this tensor (None for leaves).
    """

    __slots__ = ("_value", "stop_gradient", "grad", "_node", "_slot", "name", "persistable",
                 "_is_view", "__weakref__")
    _name_counter = 0

    def __init__(self, value: Any, stop_gradient: bool = True, name: str | None = None):
        self._value = value
        self.stop_gradient = stop_gradient
        self.grad = None
        self._node = None
        self._slot = 0
        self.name = name
        self.persistable = False
        self._is_view = False

    # -- metadata ---------------------------------------------------------------------------
    def is_dist(self) -> bool:
        """True when this tensor is distributed over a ProcessMesh."""
        return type(self._value) is not DenseTensor

    @property
    def shape(self) -> list[int]:
        """The (global) shape, as a list like Paddle."""
        return list(self._value.shape)

    @property
    def ndim(self) -> int:
        return len(self._value.shape)

    def dim(self) -> int:
        return len(self._value.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._value.shape, dtype=np.int64))

    def numel(self) -> int:
        return self.size

    @property
    def dtype(self):
        return self._value.dtype

    @property
    def place(self) -> str:
        arr = self._local_array()
        if isinstance(arr, np.ndarray):
            return "cpu"
        return f"gpu:{arr.device.id}"

    @property
    def is_leaf(self) -> bool:
        return self._node is None

    @property
    def inplace_version(self) -> int:
        """The version counter of this tensor's buffer (bumped by every inplace write)."""
        return self._local_dense().holder.version

    def _local_dense(self) -> DenseTensor:
        v = self._value
        return v if type(v) is DenseTensor else v.local

    def _local_array(self):
        return self._local_dense().array

    def _label(self) -> str:
        if self.name is None:
            Tensor._name_counter += 1
            self.name = f"tensor_{Tensor._name_counter}"
        return self.name

    # -- conversion -------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The (global) value as a numpy array. On a distributed tensor this is a collective."""
        if self.is_dist():
            from .distributed.api import _global_numpy

            return _global_numpy(self)
        arr = self._value.array
        if isinstance(arr, np.ndarray):
            return arr.copy()
        return arr.get()

    def item(self):
        a = self.numpy()
        if a.size != 1:
            raise ValueError(f"item: tensor with shape {list(a.shape)} has {a.size} elements, "
                             "only a one-element tensor converts to a Python scalar")
        return a.reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def __len__(self) -> int:
        if not self._value.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._value.shape[0]

    def __bool__(self) -> bool:
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return int(self.item())

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        head = f"Tensor(shape={self.shape}, dtype={np.dtype(self.dtype).name}, place={self.place}"
        if self.is_dist():
            head += f", process_mesh={self._value.mesh}, placements={list(self._value.placements)}"
        head += f", stop_gradient={self.stop_gradient}"
        if self.is_dist():
            return head + f",\n       local={self._value.local.array!r})"
        return head + f",\n       {self._value.array!r})"

    # -- autograd ---------------------------------------------------------------------------
    def backward(self, grad_tensor: "Tensor | None" = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` (``grad_tensor`` defaults to
        ones for a one-element tensor)."""
        from .autograd import run_backward

        run_backward([self], [grad_tensor], retain_graph=retain_graph)

    def clear_grad(self) -> None:
        self.grad = None

    clear_gradient = clear_grad

    def detach(self) -> "Tensor":
        from .ops import detach

        return detach(self)

    def clone(self) -> "Tensor":
        from .ops import assign

        return assign(self)

    def _local_value(self) -> "Tensor":
        """This rank's local piece, as a dense Tensor sharing the buffer."""
        if not self.is_dist():
            return self
        return Tensor(self._value.local, stop_gradient=True)

    @property
    def process_mesh(self):
        return self._value.mesh if self.is_dist() else None

    @property
    def placements(self):
        return list(self._value.placements) if self.is_dist() else None

    @property
    def T(self) -> "Tensor":
        from .ops import transpose

        return transpose(self, list(range(self.ndim))[::-1])


def is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _resolve_place(place: str | None):
    """Array module for a place string: "cpu" -> numpy, "gpu"/"gpu:N" -> cupy on device N."""
    if place is None or place == "cpu":
        return np, None
    if isinstance(place, str) and (place == "gpu" or place.startswith("gpu:")):
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on machine
            raise ValueError(f"to_tensor: place={place!r} needs cupy, which is not installed") from e
        dev = int(place.split(":")[1]) if ":" in place else 0
        return cupy, dev
    raise ValueError(f"to_tensor: place must be 'cpu', 'gpu' or 'gpu:N', got {place!r}")


def to_tensor(data: Any, dtype: Any = None, place: str | None = None,
              stop_gradient: bool = True) -> Tensor:
    """A new dense Tensor holding a copy of ``data`` (scalar, list, numpy/cupy array, Tensor).

    Floating data defaults to float32 (like Paddle); integers keep int64; bools stay bool.
    """
    if isinstance(data, Tensor):
        if data.is_dist():
            raise ValueError("to_tensor: data is a distributed tensor; use dtensor_to_local or "
                             "unshard_dtensor first")
        data = data._value.array
    xp, dev = _resolve_place(place if place is not None or isinstance(data, np.ndarray)
                             else _place_of(data))
    typed = hasattr(data, "dtype")
    if dev is None:
        arr = np.asarray(_to_host(data))
    else:
        with xp.cuda.Device(dev):
            arr = xp.asarray(data)
    if dtype is not None:
        npd = to_np_dtype(dtype)
    elif typed:
        npd = arr.dtype  # numpy/cupy data keeps its dtype, as in Paddle
    elif arr.dtype.kind == "f":
        npd = np.dtype(np.float32)  # Python floats default to float32
    elif arr.dtype.kind in "iu":
        npd = np.dtype(np.int64)
    else:
        npd = arr.dtype
    if npd.kind not in "biuf":
        raise TypeError(f"to_tensor: unsupported dtype {npd} of data {type(data).__name__}")
    arr = xp.array(arr, dtype=npd, order="C", copy=True)  # keeps 0-d (ascontiguousarray won't)
    return Tensor(DenseTensor(arr), stop_gradient=stop_gradient)


def _place_of(a: Any) -> str | None:
    """The place of an array-like: "gpu:N" for cupy arrays, None otherwise."""
    dev = getattr(a, "device", None)
    return f"gpu:{dev.id}" if hasattr(dev, "id") else None


def _to_host(a: Any):
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        return a.get()
    return a
