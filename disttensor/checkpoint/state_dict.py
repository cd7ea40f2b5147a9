"""Distributed checkpoints: :func:`save_state_dict` and :func:`load_state_dict`.

A checkpoint is a directory:

* ``rank_<r>.safetensors`` — the pieces rank ``r`` wrote, one tensor per state entry, named by
  the entry's flat name (nested dict keys joined by "."). A piece held by several ranks
  (replicated) is written once, by the lowest rank holding it; dense tensors and numpy arrays
  (the same on every rank) by the coordinator rank.
* ``metadata.json`` — every tensor's global shape, dtype and its chunks (file and global index
  range ``[[start, stop], ...]`` per dim), and the non-tensor values (Python scalars and
  strings, such as a step count).

Saving is atomic: everything is written into ``<path>.tmp`` and swapped in with two renames
(``path -> path.old``, ``path.tmp -> path``); a crash at any moment leaves the previous
checkpoint loadable (at ``path``, or at ``path.old`` between the renames, where
``load_state_dict`` and the next save find it). Loading reads, on each rank, only the index
ranges of the pieces its target tensors need, from the files that hold them, and reshards
into the target layout: any mesh, placements or world size.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, MutableMapping
from dataclasses import replace
from functools import lru_cache
from itertools import product
from typing import Any, Callable

import numpy as np

import collectives
from spmd_rules import DistAttr, Partial, ProcessMesh, Replicate, local_ranges, local_slices

from ..autograd import no_grad
from ..distributed.api import dtensor_to_local, reshard
from ..layout.mesh_groups import get_rank
from ..tensor import Tensor
from .metadata import VALUE_TYPES, file_in, read_metadata
from .safetensors_format import read_block, read_header, to_safetensors_dtype, write_file

__all__ = ["save_state_dict", "load_state_dict", "METADATA_FILE"]

METADATA_FILE = "metadata.json"
_FORMAT, _VERSION = "disttensor-checkpoint", 1

Region = tuple[tuple[int, int], ...]  # a global index range per dim


# -- the state dict as flat entries ---------------------------------------------------------------

class _Entry:
    """One leaf of a (nested) state dict: a Tensor, a numpy array or a plain value."""

    def __init__(self, path: tuple[str, ...], value: Any):
        self.path, self.value = path, value
        self.name = ".".join(path)
        if isinstance(value, Tensor):
            self.kind = "tensor"
        elif isinstance(value, np.ndarray):
            self.kind = "array"
        else:
            self.kind = "value"

    @property
    def is_tensor(self) -> bool:
        return self.kind != "value"

    @property
    def shape(self) -> list[int]:
        return list(self.value.shape)

    @property
    def dtype(self) -> str:
        return np.dtype(self.value.dtype).name

    def layout(self) -> tuple[ProcessMesh, DistAttr] | None:
        """(mesh, layout) of a distributed tensor; None for dense tensors and arrays."""
        v = self.value
        if self.kind != "tensor" or not v.is_dist():
            return None
        mesh = v.process_mesh
        return mesh, DistAttr.from_placements(v.placements, v.ndim, mesh.shape)


def _flatten(fn: str, state_dict: Mapping) -> list[_Entry]:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"{fn}: state_dict must be a dict, got {type(state_dict).__name__}")
    out: list[_Entry] = []

    def walk(d: Mapping, prefix: tuple[str, ...]) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise TypeError(f"{fn}: key {k!r} under {'.'.join(prefix) or 'the top level'} "
                                "is not a str")
            if isinstance(v, Mapping):
                walk(v, prefix + (k,))
                continue
            e = _Entry(prefix + (k,), v)
            if e.kind == "value" and not isinstance(v, VALUE_TYPES):
                if isinstance(v, np.generic):
                    e.value = v.item()
                else:
                    raise TypeError(f"{fn}: '{e.name}' is a {type(v).__name__}; a state dict "
                                    "holds Tensors, numpy arrays, nested dicts and plain values "
                                    "(bool, int, float, str, None)")
            out.append(e)

    walk(state_dict, ())
    names = [e.name for e in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{fn}: nested keys collide with flat keys once joined by '.': {dup}")
    return out


def _signature(entries: list[_Entry], with_values: bool) -> bytes:
    """A digest of the entries' names, kinds, shapes, dtypes and layouts (and values)."""
    rows = []
    for e in entries:
        row: list[Any] = [e.name, e.kind]
        if e.is_tensor:
            lay = e.layout()
            row += [e.shape, e.dtype]
            if lay is not None:
                row += [lay[0].process_ids, lay[0].shape, repr(lay[1])]
        elif with_values:
            row.append(repr(e.value))
        rows.append(row)
    return hashlib.sha256(json.dumps(rows).encode()).digest()


# -- agreement across ranks -----------------------------------------------------------------------

def _world():
    return collectives.init()


def _agree_signature(fn: str, digest: bytes, what: str) -> None:
    """Every rank must hold the same entries: one all-gather of a 32-byte digest."""
    w = _world()
    mine = np.frombuffer(digest, dtype=np.uint8)
    rows = w.all_gather(mine, axis=0, sizes=[mine.size] * w.size).reshape(w.size, -1)
    bad = [w.ranks[i] for i in range(w.size) if not np.array_equal(rows[i], rows[0])]
    if bad:
        raise ValueError(f"{fn}: ranks {bad} hold a different {what} than rank {w.ranks[0]} "
                         "(keys, shapes, dtypes, meshes, placements or values); every rank must "
                         "pass the same state dict")


def _on_every_rank(fn: str, step: Callable[[], Any]) -> Any:
    """Run ``step`` here; if it raised on any rank, raise on every rank: the rank that failed
    re-raises its error, the others a RuntimeError quoting the lowest failing rank's message
    (one all-gather of message lengths; a second, of the messages, only after a failure)."""
    err: BaseException | None = None
    result = None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        err = e
    w = _world()
    text = b"" if err is None else (f"{type(err).__name__}: {err}".encode() or b"?")
    sizes = [int(n) for n in w.all_gather(np.array([len(text)], np.int64), axis=0,
                                          sizes=[1] * w.size)]
    if not any(sizes):
        return result
    texts = w.all_gather(np.frombuffer(text, np.uint8), axis=0, sizes=sizes).tobytes()
    if err is not None:
        raise err
    bad = [w.ranks[i] for i, n in enumerate(sizes) if n]
    first = sizes.index(next(n for n in sizes if n))
    start = sum(sizes[:first])
    message = texts[start:start + sizes[first]].decode(errors="replace")
    raise RuntimeError(f"{fn}: failed on rank(s) {bad}; rank {bad[0]}: {message}")


# -- which rank writes which piece ----------------------------------------------------------------

def _region_of(slices: tuple[slice, ...]) -> Region:
    return tuple((int(s.start), int(s.stop)) for s in slices)


def _size(region: Region) -> int:
    return int(np.prod([b - a for a, b in region], dtype=np.int64))


@lru_cache(maxsize=1024)
def _chunks(shape: tuple[int, ...], mesh: ProcessMesh, attr: DistAttr) -> tuple:
    """((writer rank, region), ...): every distinct non-empty piece of a tensor laid out as
    ``attr`` on ``mesh``, written by the lowest rank holding it."""
    writers: dict[Region, int] = {}
    for coord in product(*(range(s) for s in mesh.shape)):
        region = _region_of(local_slices(shape, attr, coord))
        if _size(region) == 0:
            continue
        r = mesh.rank_at(coord)
        writers[region] = min(r, writers.get(region, r))
    return tuple(sorted((r, reg) for reg, r in writers.items()))


def _entry_chunks(e: _Entry, coordinator: int) -> tuple:
    lay = e.layout()
    if lay is None:
        region = tuple((0, n) for n in e.shape)
        return ((coordinator, region),) if _size(region) else ()
    return _chunks(tuple(e.shape), lay[0], lay[1])


def _file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


class _LocalPiece:
    """This rank's piece of a tensor entry, handed to the file writer in row blocks of about
    ``_BLOCK_BYTES`` (host copies of one block at a time, never of the whole piece)."""

    def __init__(self, e: _Entry):
        v = e.value
        self._t = v if e.kind == "array" or not v.is_dist() else dtensor_to_local(v)
        self.dtype, self.shape = np.dtype(self._t.dtype), tuple(self._t.shape)

    def blocks(self):
        t = self._t
        if isinstance(t, np.ndarray) or not self.shape:
            yield t if isinstance(t, np.ndarray) else t.numpy()
            return
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        step = max(1, _BLOCK_BYTES // max(row, 1))
        for a in range(0, self.shape[0], step):
            yield t[a:a + step].numpy()


_BLOCK_BYTES = 16 << 20


# -- save ------------------------------------------------------------------------------------

def _paths(path: Any) -> tuple[str, str, str]:
    p = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    return p, p + ".tmp", p + ".old"


def _prepare_dir(fn: str, final: str, tmp: str, old: str) -> None:
    """Coordinator: settle an interrupted commit, then make an empty ``tmp``."""
    if not os.path.isdir(final) and os.path.isdir(old):
        os.rename(old, final)  # the crash came between the two renames of a commit
    elif os.path.isdir(final) and os.path.isdir(old):
        shutil.rmtree(old)     # the crash came after the commit, before the cleanup
    if os.path.exists(final):
        if not os.path.isdir(final):
            raise FileExistsError(f"{fn}: {final} exists and is not a directory")
        if os.listdir(final) and not os.path.isfile(os.path.join(final, METADATA_FILE)):
            raise FileExistsError(f"{fn}: {final} exists and is not a checkpoint (no "
                                  f"{METADATA_FILE}); refusing to replace it")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(final: str, tmp: str, old: str, metadata: dict) -> None:
    """Coordinator: write the metadata, then swap ``tmp`` in for ``final``."""
    with open(os.path.join(tmp, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if os.path.isdir(old):
        shutil.rmtree(old)


def save_state_dict(state_dict: Mapping, path: Any, coordinator_rank: int = 0) -> None:
    """Save a (nested) state dict of Tensors, numpy arrays and plain values to the checkpoint
    directory ``path`` (Paddle's ``dist.save_state_dict``); every rank of the world calls it.

    Each rank writes only its own pieces, as ``rank_<r>.safetensors`` (a replicated piece once,
    by the lowest rank holding it; dense tensors and arrays, assumed equal on every rank, by
    ``coordinator_rank``); ``coordinator_rank`` also writes ``metadata.json`` (global shapes,
    dtypes, the index range of every chunk, and the plain values) and commits. A Partial
    tensor is first resharded to Replicate on its Partial dims, a strided shard
    (``Shard(d, split_factor=k)``) to the plain shard of the same mesh dims (chunks are index
    boxes). Nothing is gathered to one rank.

    Atomic: a crash at any moment leaves the previous checkpoint at ``path`` loadable. Bad input
    (a value that is not a Tensor/array/dict/plain value, ranks passing different state dicts, a
    ``path`` that is a non-checkpoint directory) raises on every rank before any file is
    written. Collective: a few small all-gathers over the world, plus the reshards of Partial
    tensors.

    Example::

        dt.save_state_dict({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, "ckpt/step_100")
    """
    fn = "save_state_dict"
    entries = _flatten(fn, state_dict)
    w = _world()
    if not isinstance(coordinator_rank, int) or not 0 <= coordinator_rank < w.size:
        raise ValueError(f"{fn}: coordinator_rank must be a rank in [0, {w.size}), got "
                         f"{coordinator_rank!r}")
    for e in entries:
        if e.is_tensor:
            to_safetensors_dtype(e.value.dtype)
    _agree_signature(fn, _signature(entries, with_values=True), "state dict")
    for e in entries:  # Partial pieces are addends: make them values first (collective)
        if e.kind == "tensor" and e.value.is_dist() and \
                any(isinstance(p, Partial) or (p.is_shard() and p.split_factor > 1)
                    for p in e.value.placements):
            e.value = reshard(e.value, e.value.process_mesh,
                              [Replicate() if isinstance(p, Partial) else
                               replace(p, split_factor=1) if p.is_shard() else p
                               for p in e.value.placements])
    final, tmp, old = _paths(path)
    me = get_rank()
    _on_every_rank(fn, lambda: _prepare_dir(fn, final, tmp, old) if me == coordinator_rank
                   else None)

    chunks = {e.name: _entry_chunks(e, coordinator_rank) for e in entries if e.is_tensor}

    def write_mine() -> None:
        mine = {e.name: _LocalPiece(e) for e in entries if e.is_tensor
                and any(r == me for r, _ in chunks[e.name])}
        if mine:
            write_file(os.path.join(tmp, _file_name(me)), mine, {"format": _FORMAT})

    _on_every_rank(fn, write_mine)
    metadata = {
        "format": _FORMAT, "version": _VERSION, "world_size": w.size,
        "tensors": {e.name: {"path": list(e.path), "shape": e.shape, "dtype": e.dtype,
                             "chunks": [{"file": _file_name(r), "index": [list(b) for b in reg]}
                                        for r, reg in chunks[e.name]]}
                    for e in entries if e.is_tensor},
        "values": {e.name: {"path": list(e.path), "value": e.value}
                   for e in entries if not e.is_tensor},
    }
    _on_every_rank(fn, lambda: _commit(final, tmp, old, metadata) if me == coordinator_rank
                   else None)


# -- load ------------------------------------------------------------------------------------

def _read_metadata(fn: str, path: Any) -> tuple[str, dict]:
    final, _, old = _paths(path)
    for d in (final, old):
        meta = os.path.join(d, METADATA_FILE)
        if os.path.isfile(meta) and (d == final or not os.path.exists(final)):
            checked = file_in(fn, d, METADATA_FILE)
            try:
                return d, read_metadata(checked, _FORMAT)
            except ValueError as e:
                raise ValueError(f"{fn}: {e}") from None
    raise FileNotFoundError(f"{fn}: no checkpoint at {final} (no {METADATA_FILE})")


def _check_targets(fn: str, entries: list[_Entry], md: dict, where: str) -> None:
    problems = []
    for e in entries:
        saved = md["tensors"].get(e.name)
        if e.is_tensor:
            if saved is None:
                kind = "a plain value" if e.name in md["values"] else "missing"
                problems.append(f"'{e.name}': {kind} in the checkpoint")
            elif list(saved["shape"]) != e.shape:
                problems.append(f"'{e.name}': global shape {saved['shape']} in the checkpoint "
                                f"but {e.shape} in the state dict")
            elif e.kind == "tensor" and e.value.is_dist() and \
                    any(isinstance(p, Partial) for p in e.value.placements):
                problems.append(f"'{e.name}': the target is Partial {e.value.placements}; "
                                "load into a Shard/Replicate layout")
        elif e.name not in md["values"]:
            kind = "a tensor" if saved is not None else "missing"
            problems.append(f"'{e.name}': {kind} in the checkpoint (the state dict holds a "
                            f"plain value)")
    if problems:
        raise ValueError(f"{fn}: the checkpoint at {where} does not fit the state dict:\n  "
                         + "\n  ".join(problems))


def _target_regions(e: _Entry) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per dim the global index ranges this rank's piece of the target covers, in local order
    (one, possibly empty, except on a strided dim); None: it holds nothing."""
    lay = e.layout()
    if lay is None:
        return tuple(((0, n),) for n in e.shape)
    coord = lay[0].get_coord(get_rank())
    if coord is None:
        return None
    mesh, attr = lay
    plain = _region_of(local_slices(tuple(e.shape), attr.without_split_factors(), coord))
    strided = local_ranges(tuple(e.shape), attr, coord)
    return tuple(strided[d] if attr.is_strided(d) else (plain[d],) for d in range(len(plain)))


def _read_piece(fn: str, directory: str, e: _Entry, saved: dict, ranges, headers: dict
                ) -> np.ndarray:
    """The target's piece: one block per combination of its dims' ranges, joined in order."""
    if any(not r for r in ranges):  # a strided dim holding nothing here
        return np.zeros(0)

    def block(prefix: tuple) -> Any:
        d = len(prefix)
        if d == len(ranges):
            return _read_region(fn, directory, e, saved, prefix, headers)
        return [block(prefix + (r,)) for r in ranges[d]]
    if all(len(r) == 1 for r in ranges):
        return _read_region(fn, directory, e, saved, tuple(r[0] for r in ranges), headers)
    return np.block(block(()))


def _read_region(fn: str, directory: str, e: _Entry, saved: dict, region: Region,
                 headers: dict) -> np.ndarray:
    """The block ``region`` of a saved tensor, assembled from the chunks that overlap it. The
    chunks must cover the region exactly once (checked on the metadata before any file is
    opened), and each chunk's file must hold it with the dtype and shape the metadata gives."""
    parts: list[tuple[str, list, list]] = []  # (file, chunk index range, its part of region)
    covered = 0
    for chunk in saved["chunks"]:
        box = [tuple(ab) for ab in chunk["index"]]
        inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, box)]
        if any(a >= b for a, b in inter):
            continue
        for _, other, done in parts:
            if all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(inter, done)):
                raise ValueError(f"{fn}: the chunks {other} and {box} of '{e.name}' overlap in "
                                 f"{METADATA_FILE}; the checkpoint is corrupt")
        parts.append((chunk["file"], box, inter))
        covered += _size(tuple(inter))
    if covered != _size(region):
        raise ValueError(f"{fn}: the chunks of '{e.name}' cover {covered} of the "
                         f"{_size(region)} elements this rank needs; the checkpoint is incomplete")
    out = np.empty([b - a for a, b in region], dtype=np.dtype(saved["dtype"]))
    for name, box, inter in parts:  # name: a plain file name (checked with the metadata)
        if name not in headers:
            if not os.path.lexists(os.path.join(directory, name)):
                raise FileNotFoundError(f"{fn}: {os.path.join(directory, name)} is missing; "
                                        f"{METADATA_FILE} places the chunk {box} of '{e.name}' "
                                        "there")
            path = file_in(fn, directory, name)
            headers[name] = (path,) + read_header(path)
        path, header, start = headers[name]
        entry = header.get(e.name)
        if entry is None:
            raise ValueError(f"{fn}: {path} lacks '{e.name}', which {METADATA_FILE} places there")
        extent = [b - a for a, b in box]
        if entry["dtype"] != to_safetensors_dtype(saved["dtype"]) or entry["shape"] != extent:
            raise ValueError(f"{fn}: {path} holds '{e.name}' as {entry['dtype']} of shape "
                             f"{entry['shape']}, but {METADATA_FILE} places a {saved['dtype']} "
                             f"chunk of shape {extent} there")
        src = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, box))
        dst = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(inter, region))
        read_block(path, entry, start, src, out[dst])
    return out


def _write_target(e: _Entry, data: np.ndarray) -> None:
    v = e.value
    if data.size == 0:
        return
    if e.kind == "array":
        v[...] = data
        return
    local = dtensor_to_local(v) if v.is_dist() else v
    local.copy_(data.astype(local.dtype, copy=False))  # copied once, onto local's device


def _set_value(state_dict: MutableMapping, path: list[str], value: Any) -> None:
    d = state_dict
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def load_state_dict(state_dict: MutableMapping, path: Any) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (Paddle's
    ``dist.load_state_dict``); every rank of the world calls it.

    The target decides the layout: each tensor keeps its identity, mesh, placements and dtype
    (the saved values are cast), and each rank reads only the index ranges its piece needs, from
    the files that hold them; any mesh, placements or world size may differ from the saving
    run's. Dense tensors and arrays get the whole tensor. Plain values are replaced in the dict.
    Entries of the checkpoint that the state dict lacks are ignored. For an optimizer, load into
    ``opt.state_dict()`` and pass the result to ``opt.set_state_dict``.

    Bad input (no checkpoint at ``path``, a target tensor missing from the checkpoint, a global
    shape that differs, a Partial target, ranks passing different state dicts) raises on every
    rank before anything is modified; a failed read on any rank raises on every rank and leaves
    the state dict unchanged. Collective: small all-gathers over the world.

    Example::

        state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 0}
        dt.load_state_dict(state, "ckpt/step_100")
        opt.set_state_dict(state["opt"]); step = state["step"]
    """
    fn = "load_state_dict"
    entries = _flatten(fn, state_dict)
    _agree_signature(fn, _signature(entries, with_values=False), "state dict")
    directory, md = _on_every_rank(fn, lambda: _read_metadata(fn, path))
    _check_targets(fn, entries, md, directory)

    def read_all() -> list[tuple[_Entry, np.ndarray]]:
        headers: dict = {}
        out = []
        for e in entries:
            if not e.is_tensor:
                continue
            ranges = _target_regions(e)
            if ranges is not None:
                out.append((e, _read_piece(fn, directory, e, md["tensors"][e.name], ranges,
                                           headers)))
        return out

    blocks = _on_every_rank(fn, read_all)
    with no_grad():
        for e, data in blocks:
            _write_target(e, data)
    for e in entries:
        if not e.is_tensor:
            _set_value(state_dict, list(e.path), md["values"][e.name]["value"])
