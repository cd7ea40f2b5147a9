"""The three objects behind a user's tensor.

* :class:`Holder` — one allocation (the base array) plus the inplace version counter that every
  view of it shares.
* :class:`DenseTensor` — an n-d window onto a holder: its ``array`` is a numpy/cupy view of the
  holder's buffer (dtype, shape and strides are the array's).
* :class:`Tensor` — what users hold: a DenseTensor or a DistTensor plus autograd state.

Holders are created only by the dispatcher (:mod:`disttensor.dispatch`), the one seam every
tensor passes; ops and methods are attached to :class:`Tensor` by :mod:`disttensor.tensor_methods`
from the registry of public functions.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Holder", "DenseTensor", "Tensor", "is_tensor", "array_module"]


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

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape


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

    # -- autograd (``backward`` is bound by disttensor.autograd) ------------------------
    def clear_grad(self) -> None:
        self.grad = None

    clear_gradient = clear_grad

    @property
    def process_mesh(self):
        return self._value.mesh if self.is_dist() else None

    @property
    def placements(self):
        return list(self._value.placements) if self.is_dist() else None


def is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)
