"""A checkpoint's ``metadata.json`` read as untrusted input.

The file comes from disk and may be corrupted or hostile: :func:`read_metadata` checks its
whole structure (tensor shapes, dtypes from the safetensors set, chunk index ranges inside the
global shape, chunk files that are plain names) before any tensor byte is read, and
:func:`file_in` resolves a chunk's (or the metadata's) file only to a regular file inside the
checkpoint directory. Every violation is a ValueError naming the file, the entry and the bad
field.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .safetensors_format import NUMPY_DTYPES, is_count

__all__ = ["read_metadata", "file_in", "VALUE_TYPES"]

#: The plain (non-tensor) values a checkpoint holds.
VALUE_TYPES = (bool, int, float, str, type(None))


def _is_path(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(k, str) for k in v)


def _check_name(where: str, name: Any) -> None:
    if not (isinstance(name, str) and name and name not in (".", "..") and "\0" not in name
            and os.sep not in name and (os.altsep is None or os.altsep not in name)
            and "/" not in name):
        raise ValueError(f"{where}: chunk file {name!r} is not a plain file name inside the "
                         "checkpoint directory")


def _check_tensor(where: str, t: Any) -> None:
    if not isinstance(t, dict):
        raise ValueError(f"{where}: the record is a {type(t).__name__}, not an object")
    shape, dtype, chunks = t.get("shape"), t.get("dtype"), t.get("chunks")
    if not _is_path(t.get("path")):
        raise ValueError(f"{where}: path {t.get('path')!r} is not a non-empty list of str")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {sorted(NUMPY_DTYPES)}")
    if not isinstance(chunks, list):
        raise ValueError(f"{where}: chunks {chunks!r} is not a list")
    for k, c in enumerate(chunks):
        if not isinstance(c, dict):
            raise ValueError(f"{where}: chunk {k} is a {type(c).__name__}, not an object")
        _check_name(f"{where}: chunk {k}", c.get("file"))
        index = c.get("index")
        if not (isinstance(index, list) and len(index) == len(shape) and all(
                isinstance(ab, list) and len(ab) == 2 and all(map(is_count, ab))
                and ab[0] <= ab[1] <= n for ab, n in zip(index, shape))):
            raise ValueError(f"{where}: chunk {k} has index {index!r}; expected one "
                             f"[start, stop] with 0 <= start <= stop <= size per dim of "
                             f"shape {shape}")


def read_metadata(meta_path: str, fmt: str) -> dict:
    """The checked content of the metadata file at ``meta_path`` (format name ``fmt``)."""
    where = f"checkpoint metadata {meta_path}"
    try:
        with open(meta_path, "rb") as f:
            md = json.loads(f.read())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(md, dict) or md.get("format") != fmt:
        raise ValueError(f"{where} is not a {fmt} metadata file")
    tensors, values = md.get("tensors"), md.get("values")
    if not isinstance(tensors, dict) or not isinstance(values, dict):
        raise ValueError(f"{where}: 'tensors' and 'values' must both be objects")
    for name, t in tensors.items():
        _check_tensor(f"{where}: tensor '{name}'", t)
    for name, v in values.items():
        if not (isinstance(v, dict) and _is_path(v.get("path")) and "value" in v
                and isinstance(v["value"], VALUE_TYPES)):
            raise ValueError(f"{where}: value '{name}' is not {{'path': [str, ...], 'value': "
                             "bool | int | float | str | null}")
    return md


def file_in(fn: str, directory: str, name: str) -> str:
    """The regular file ``name`` (a chunk file or the metadata file) inside ``directory``; no
    link may lead outside it. Errors start with ``fn``."""
    _check_name(f"{fn}: checkpoint {directory}", name)
    path = os.path.realpath(os.path.join(directory, name))
    if os.path.dirname(path) != os.path.realpath(directory):
        raise ValueError(f"{fn}: checkpoint {directory}: file {name!r} is a link leading "
                         f"outside the checkpoint directory (to {path})")
    if not os.path.isfile(path):
        raise ValueError(f"{fn}: checkpoint {directory}: file {name!r} is missing or not a "
                         "regular file")
    return path
