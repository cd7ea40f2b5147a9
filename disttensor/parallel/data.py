"""``shard_dataloader``: batches as distributed tensors, each rank loading only its own rows.

For every global batch (an index list from the loader's batch sampler, the same on every rank)
a rank takes its piece of the list — ``numpy.array_split`` into the size of its mesh's data
dim, piece number its coordinate along that dim — loads and collates only those samples, and
builds each field with ``dtensor_from_local`` as ``Shard(0)`` on the data dim (Replicate on the
others). The global batch equals the dense loader's batch, row for row.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import numpy as np

from spmd_rules import ProcessMesh, Replicate, Shard

from ..distributed.api import dtensor_from_local
from ..io.dataloader import DataLoader
from ..layout.mesh_groups import get_rank
from ..tensor import Tensor
from .mesh import mesh_coord, mesh_dim_index

__all__ = ["ShardDataloader", "shard_dataloader"]


class ShardDataloader:
    """Iterates a :class:`~disttensor.io.DataLoader` as distributed batches; see
    :func:`shard_dataloader`.

    Example::

        for x, y in dt.shard_dataloader(loader, mesh, shard_dims="dp"):
            loss = loss_fn(model(x), y)   # x: Shard(0) on "dp"
    """

    def __init__(self, dataloader: Any, meshes: ProcessMesh | Sequence[ProcessMesh],
                 input_keys: Sequence[str] | None = None,
                 shard_dims: str | int | Sequence[str | int | None] | None = "dp",
                 is_dataset_splitted: bool = False):
        fn = "shard_dataloader"
        self._meshes = [meshes] if isinstance(meshes, ProcessMesh) else list(meshes)
        if not self._meshes or not all(isinstance(m, ProcessMesh) for m in self._meshes):
            raise TypeError(f"{fn}: meshes must be a ProcessMesh or a non-empty list of them, "
                            f"got {meshes!r}")
        dims = shard_dims if isinstance(shard_dims, (list, tuple)) else \
            [shard_dims] * len(self._meshes)
        if len(dims) != len(self._meshes):
            raise ValueError(f"{fn}: {len(dims)} shard_dims for {len(self._meshes)} meshes")
        self._dims = [None if d is None else mesh_dim_index(fn, m, d)
                      for m, d in zip(self._meshes, dims)]
        self._input_keys = None if input_keys is None else list(input_keys)
        if self._input_keys is not None and len(self._meshes) > 1 \
                and len(self._input_keys) != len(self._meshes):
            raise ValueError(f"{fn}: {len(self._input_keys)} input_keys for "
                             f"{len(self._meshes)} meshes")
        members = [k for k, m in enumerate(self._meshes) if mesh_coord(m) is not None]
        if len({(self._meshes[k], self._dims[k]) for k in members}) > 1:
            raise ValueError(f"{fn}: rank {get_rank()} is in more than one of the meshes "
                             f"{self._meshes}")
        self._home = members[0] if members else None  # this rank's mesh (index)
        self._splitted = bool(is_dataset_splitted)
        self._loader = dataloader
        if self._splitted:
            if self._home is None:
                raise ValueError(f"{fn}: with is_dataset_splitted=True every rank must be in "
                                 f"a mesh; rank {get_rank()} is in none of {self._meshes}")
            return
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"{fn}: dataloader must be a disttensor.io.DataLoader (or pass "
                            f"is_dataset_splitted=True), got {type(dataloader).__name__}")
        if dataloader.splits_by_rank:
            raise ValueError(f"{fn}: the loader's DistributedBatchSampler or "
                             "DistributedSampler already splits the data by rank; use a "
                             "BatchSampler of the global batch, or pass "
                             "is_dataset_splitted=True")
        self._check_sizes(dataloader)

    def _check_sizes(self, loader: DataLoader) -> None:
        """Every data rank must get rows: the dataset holds at least one global batch and the
        global batch has a row for every rank of the data dim."""
        batch = loader.batch_size
        n = len(loader.dataset)
        ranks = max([m.shape[d] for m, d in zip(self._meshes, self._dims) if d is not None],
                    default=1)
        if batch is not None and batch < ranks:
            raise ValueError(f"shard_dataloader: the batch size {batch} is smaller than the "
                             f"{ranks} ranks of the data dim; use a global batch of at least "
                             f"{ranks} rows")
        if batch is not None and n < batch:
            raise ValueError(f"shard_dataloader: the dataset has {n} samples, fewer than one "
                             f"global batch of {batch} ({batch // ranks} per rank on {ranks} "
                             "data ranks)")
        if len(loader) == 0:
            raise ValueError(f"shard_dataloader: the loader yields no batch (dataset of {n} "
                             "samples)")

    @property
    def dataset(self) -> Any:
        return self._loader.dataset

    def __len__(self) -> int:
        return len(self._loader)

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        if self._splitted:
            for batch in self._loader:
                yield self._place(batch, None)
            return
        for indices in self._loader.batch_sampler:
            indices = list(indices)
            local = self._load_local(indices)
            yield self._place(local, len(indices))

    def _load_local(self, indices: list[int]) -> Any:
        """This rank's rows of the global batch ``indices``, collated (numpy leaves). A rank
        with no rows (outside every mesh, or an empty piece of a short batch) collates the
        first sample only, to learn the fields, and keeps zero rows of it."""
        rows = indices
        if self._home is not None and self._dims[self._home] is not None:
            mesh, d = self._meshes[self._home], self._dims[self._home]
            rows = np.array_split(np.asarray(indices), mesh.shape[d])[mesh_coord(mesh)[d]]
            rows = rows.tolist()
        if self._home is None or not rows:
            return _take_rows(self._loader.load(indices[:1]), 0)
        return self._loader.load(rows)

    def _place(self, batch: Any, nrows: int | None) -> Any:
        """Each leaf as a distributed tensor on its field's mesh."""
        if isinstance(batch, Mapping):
            keys = list(batch)
            order = self._input_keys if self._input_keys is not None else keys
            missing = [k for k in order if k not in batch]
            if missing:
                raise KeyError(f"shard_dataloader: input_keys {missing} are not in the batch "
                               f"(keys {keys})")
            if len(self._meshes) > 1 and self._input_keys is None:
                raise ValueError("shard_dataloader: a dict batch on several meshes needs "
                                 "input_keys naming the key of each mesh")
            return {k: self._leaves(batch[k], self._field(order.index(k) if k in order else 0),
                                    nrows) for k in keys}
        if isinstance(batch, (list, tuple)):
            if len(self._meshes) > 1 and len(batch) != len(self._meshes):
                raise ValueError(f"shard_dataloader: the batch has {len(batch)} fields but "
                                 f"{len(self._meshes)} meshes were given (one per field)")
            return [self._leaves(v, self._field(i), nrows) for i, v in enumerate(batch)]
        return self._leaves(batch, self._field(0), nrows)

    def _field(self, i: int) -> int:
        return i if len(self._meshes) > 1 else 0

    def _leaves(self, value: Any, k: int, nrows: int | None) -> Any:
        if isinstance(value, Mapping):
            return {key: self._leaves(v, k, nrows) for key, v in value.items()}
        if isinstance(value, (list, tuple)) and not _is_str_list(value):
            return [self._leaves(v, k, nrows) for v in value]
        if not isinstance(value, (np.ndarray, Tensor)):
            return value
        mesh, d = self._meshes[k], self._dims[k]
        placements = [Shard(0) if m == d else Replicate() for m in range(mesh.ndim)]
        arr = value.numpy() if isinstance(value, Tensor) else value
        if mesh_coord(mesh) is None:
            shape = None if nrows is None else (nrows,) + tuple(arr.shape[1:])
            if shape is None:
                raise ValueError(f"shard_dataloader: rank {get_rank()} is not in {mesh}")
            return dtensor_from_local(arr[:0], mesh, placements, shape=shape)
        return dtensor_from_local(arr, mesh, placements)


def _is_str_list(v: Sequence) -> bool:
    return bool(v) and isinstance(v[0], (str, bytes))


def _take_rows(batch: Any, n: int) -> Any:
    """The first ``n`` rows of every array leaf of a collated batch."""
    if isinstance(batch, np.ndarray):
        return batch[:n]
    if isinstance(batch, Mapping):
        return {k: _take_rows(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not _is_str_list(batch):
        return [_take_rows(v, n) for v in batch]
    return batch


def shard_dataloader(dataloader: Any, meshes: ProcessMesh | Sequence[ProcessMesh],
                     input_keys: Sequence[str] | None = None,
                     shard_dims: str | int | Sequence[str | int | None] | None = "dp",
                     is_dataset_splitted: bool = False) -> ShardDataloader:
    """Hand out ``dataloader``'s batches as distributed tensors (Paddle's
    ``dist.shard_dataloader``).

    Each batch field goes to a mesh: one mesh for all fields, or ``meshes[i]`` for field ``i``
    (list batches) / for key ``input_keys[i]`` (dict batches). On its mesh a field is
    ``Shard(0)`` along the mesh dim ``shard_dims`` (a name or index; one for all meshes or one
    per mesh; None: not split, Replicate) and Replicate elsewhere. The loader's batch size is
    the GLOBAL batch: each rank loads and collates only its ``numpy.array_split`` piece of the
    batch's indices, so the distributed batch equals the dense loader's batch. With
    ``is_dataset_splitted=True`` the loader already yields this rank's rows (e.g. through a
    ``DistributedBatchSampler``) and they are only wrapped.

    Collective: one small all-gather per field per batch (``dtensor_from_local``'s shape
    check). Raises on every rank, before loading anything, when the dataset is shorter than one
    global batch, when the global batch has fewer rows than the data dim has ranks, when a rank
    is in two of the meshes, or when ``shard_dims`` names a dim a mesh lacks. Iterate it, or
    call it (``for x, y in loader()``), as Paddle does.

    Example::

        mesh = dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        loader = dt.io.DataLoader(dataset, batch_size=8, shuffle=True)
        for x, y in dt.shard_dataloader(loader, mesh, shard_dims="dp"):
            ...   # x: [8, ...] as [Shard(0), Replicate()]; each rank read 4 rows
    """
    return ShardDataloader(dataloader, meshes, input_keys, shard_dims, is_dataset_splitted)
