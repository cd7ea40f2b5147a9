"""Rank agreement where metadata enters a program.

``shard_tensor``, ``dtensor_from_local``, ``reshard`` and ``init_parallel_env`` call
:func:`agree` with a fingerprint of what they were given (global shape, dtype, mesh, layouts).
The ranks concerned compare their fingerprints with one small all-gather and, when they differ,
raise the same ``ValueError`` on every rank listing each rank's view. Ops after these entry points
derive their metadata from them, so they need no check.

A fingerprint agreed on once is remembered (keys built from interned meshes and layouts): a
steady-state loop pays one dict lookup per entry point and no collective. Each group of ranks
has its own LRU of ``CACHE_LIMIT`` keys: its members see the same agreements in the same order,
so they keep and evict the same keys. (One LRU over all groups evicted differently on ranks that
take part in different groups, and a rank that had forgotten a key then checked it alone.)
If a rank later diverges, it alone runs the check while the others run the op's own collective;
the two travel on different communicators, so both block and the watchdog reports the two calls
after a few seconds (see :mod:`collectives.failure`).

``DISTTENSOR_CHECK_COLLECTIVES=1`` also compares a checksum of the data given to
``shard_tensor`` (every rank must pass the same global array), and never caches.

Data checks on ids, labels and indices agree later, in :mod:`disttensor.ops.data_checks`.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

import collectives
from collectives._common import CHECK_COLLECTIVES
from spmd_rules import ProcessMesh

from ..layout.dist_tensor import _CANON_IDS, _MESH_IDS, canonical, canonical_mesh
from ..layout.mesh_groups import get_rank, get_world_size

__all__ = ["RankDisagreementError", "agree", "agreement_cache_info", "broadcast_from",
           "check_shard_tensor",
           "check_from_local", "check_reshard", "CACHE_LIMIT"]

CACHE_LIMIT = 4096
_AGREED: dict[tuple, OrderedDict] = {}   # key -> the LRU of its group of ranks (holding it)
_LRUS: dict[tuple, OrderedDict] = {}     # sorted ranks -> their agreed keys, oldest first


class RankDisagreementError(ValueError):
    """Ranks passed different metadata to an entry point; ``failing_ranks`` are those that
    differ from the most common view (the failure report blames the first)."""

    def __init__(self, message: str, failing_ranks: list[int]):
        super().__init__(message)
        self.failing_ranks = failing_ranks


def agreement_cache_info() -> dict:
    """Size of the cache of agreed fingerprints and its limit per group of ranks (a debugging
    aid)."""
    return {"size": len(_AGREED), "limit": CACHE_LIMIT}


def _group(ranks) -> Any:
    return collectives.new_group(sorted(set(ranks)))


def _known(key: tuple) -> bool:
    """True when ``key`` was agreed on before (never in debug mode); marks it recently used."""
    lru = _AGREED.get(key)
    if CHECK_COLLECTIVES or lru is None:
        return False
    lru.move_to_end(key)
    return True


_TENSOR_METADATA = ("the tensor's metadata (every rank must pass the same global shape, dtype, "
                    "mesh and placements)")


def agree(op: str, ranks, key: tuple, describe, what: str = _TENSOR_METADATA) -> None:
    """Check that every rank in ``ranks`` (this one among them) passed the same ``key`` to
    ``op``; ``describe()`` gives this rank's view for the error message. Raises ValueError on
    every rank when they differ."""
    if _known(key) or get_world_size() == 1:
        return
    text = describe()
    views = _group(ranks).exchange_metadata(text)
    if any(v != views[0] for v in views):
        members = sorted(set(ranks))
        common = max(views, key=views.count)  # ties: the lowest rank's view (same on all ranks)
        odd = [r for r, v in zip(members, views) if v != common]
        lines = "\n".join(f"  rank {r}: {v}" for r, v in zip(members, views))
        raise RankDisagreementError(
            f"{op}: ranks disagree on {what}; rank(s) {odd} differ from the others:\n{lines}",
            odd)
    lru = _LRUS.setdefault(tuple(sorted(set(ranks))), OrderedDict())
    lru[key] = True
    _AGREED[key] = lru
    if len(lru) > CACHE_LIMIT:
        del _AGREED[lru.popitem(last=False)[0]]


def checksum(arr) -> str:
    """crc32 of the array's bytes (debug mode: replicated data must agree)."""
    a = np.ascontiguousarray(arr if isinstance(arr, np.ndarray) else arr.get())
    return f"{zlib.crc32(a.view(np.uint8).reshape(-1)):08x}"


def broadcast_from(data: Any, src_rank: int, mesh: ProcessMesh, op: str) -> np.ndarray:
    """The global array held by ``src_rank`` on every rank of ``mesh`` (and ``src_rank``): other
    ranks' ``data`` is ignored (it may be None)."""
    ranks = sorted(set(mesh.process_ids) | {int(src_rank)})
    me = get_rank()
    if not 0 <= src_rank < get_world_size():
        raise ValueError(f"{op}: src_rank={src_rank} is not a rank of the world (size "
                         f"{get_world_size()})")
    if me not in ranks:
        return np.asarray(data) if data is not None else np.zeros(0)
    g = _group(ranks)
    if me == src_rank:
        arr = np.ascontiguousarray(np.asarray(data))
        meta = (tuple(arr.shape), arr.dtype.str)
    else:
        arr, meta = None, None
    metas = g.exchange_metadata(meta)
    shape, dtype = metas[ranks.index(src_rank)]
    if arr is None:
        arr = np.empty(shape, dtype=dtype)
    return g.broadcast(arr, ranks.index(src_rank))


# -- the entry points' fingerprints ------------------------------------------------------------

def _layout(mesh: ProcessMesh, attr) -> str:
    return f"placements {attr.to_placements()} on mesh {mesh.shape} {mesh.process_ids}"


def check_shard_tensor(mesh: ProcessMesh, attr, arr) -> None:
    """The ranks of ``mesh`` passed the same global shape, dtype and layout (and, in debug
    mode, the same data)."""
    shape, dtype = arr.shape, arr.dtype
    key = ("shard_tensor", id(canonical_mesh(mesh)), id(canonical(attr)), shape, dtype)
    if _known(key) or not mesh.contains(get_rank()):
        return

    def describe():
        extra = f", data crc32 {checksum(arr)}" if CHECK_COLLECTIVES else ""
        return f"shape {list(shape)} dtype {dtype.name} {_layout(mesh, attr)}{extra}"
    agree("shard_tensor", mesh.process_ids, key, describe)


def check_from_local(mesh: ProcessMesh, attr, shape) -> None:
    """The ranks of ``mesh`` passed the same layout and global shape argument (the pieces'
    shapes and dtypes are checked by the caller's own all-gather)."""
    shape = None if shape is None else tuple(int(s) for s in shape)
    key = ("dtensor_from_local", id(canonical_mesh(mesh)), id(canonical(attr)), shape)
    agree("dtensor_from_local", mesh.process_ids, key,
          lambda: f"{_layout(mesh, attr)}, shape={None if shape is None else list(shape)}")


def check_reshard(value, mesh: ProcessMesh, attr) -> None:
    """The ranks of both meshes agree on the source tensor and the target layout."""
    # the steady-state path: one tuple and one lookup (the target's mesh and attr are
    # normally interned already, so their ids are stable keys)
    key = ("reshard", id(value.mesh), id(value.dist_attr), value.shape, value.dtype,
           id(mesh) if id(mesh) in _MESH_IDS else id(canonical_mesh(mesh)),
           id(attr) if id(attr) in _CANON_IDS else id(canonical(attr)))
    if _known(key):
        return
    ranks = set(value.mesh.process_ids) | set(mesh.process_ids)
    if get_rank() not in ranks:
        return
    agree("reshard", ranks, key,
          lambda: f"source shape {list(value.shape)} dtype {np.dtype(value.dtype).name} "
                  f"{_layout(value.mesh, value.dist_attr)} -> target {_layout(mesh, attr)}")
