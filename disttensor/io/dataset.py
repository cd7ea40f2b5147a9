"""Map-style datasets: :class:`Dataset` (the base class) and :class:`TensorDataset`."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..tensor import Tensor

__all__ = ["Dataset", "TensorDataset"]


class Dataset:
    """A map-style dataset: subclasses define ``__getitem__(index)`` (one sample: an array, a
    number, or a tuple/list/dict of them) and ``__len__()``.

    Example::

        class Squares(dt.io.Dataset):
            def __getitem__(self, i):
                return np.array([i], "float32"), np.array([i * i], "float32")
            def __len__(self):
                return 10
    """

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define __getitem__")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not define __len__")


class TensorDataset(Dataset):
    """Samples are rows of equally long arrays: ``dataset[i] == (t0[i], t1[i], ...)`` as numpy
    arrays (Paddle's ``paddle.io.TensorDataset``). Accepts dense Tensors and arrays; no
    communication.

    Example::

        ds = dt.io.TensorDataset([np.arange(6).reshape(3, 2), np.arange(3)])
        ds[1]   # (array([2, 3]), array(1))
    """

    def __init__(self, tensors: Sequence[Any]):
        if isinstance(tensors, (Tensor, np.ndarray)) or not isinstance(tensors, (list, tuple)):
            raise TypeError("TensorDataset: tensors must be a list or tuple of Tensors/arrays, got "
                            f"{type(tensors).__name__}")
        arrays = []
        for i, t in enumerate(tensors):
            if isinstance(t, Tensor) and t.is_dist():
                raise TypeError(f"TensorDataset: tensors[{i}] is a distributed tensor; pass the "
                                "dense data every rank holds (shard_dataloader splits it)")
            a = t.numpy() if isinstance(t, Tensor) else np.asarray(t)
            if a.ndim == 0:
                raise ValueError(f"TensorDataset: tensors[{i}] is 0-d; every tensor needs a "
                                 "leading sample dim")
            arrays.append(a)
        if not arrays:
            raise ValueError("TensorDataset: tensors must not be empty")
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) > 1:
            raise ValueError(f"TensorDataset: tensors have different lengths {lengths} along "
                             "dim 0")
        self._arrays = arrays

    def __getitem__(self, index: int) -> tuple:
        return tuple(a[index] for a in self._arrays)

    def __len__(self) -> int:
        return len(self._arrays[0])
