"""The safetensors file format, written and read with numpy alone.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (padded with spaces
to a multiple of 8), then the raw little-endian bytes of every tensor, back to back. The JSON
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
byte buffer after the header) and may hold ``"__metadata__"``: a str -> str map.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

import numpy as np

__all__ = ["write_file", "read_header", "read_block", "to_safetensors_dtype", "NUMPY_DTYPES",
           "is_count"]

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
          "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
          "uint8": "U8", "bool": "BOOL"}
_CODES["bfloat16"] = "BF16"  # ml_dtypes' bfloat16 (numpy knows the name once it is imported)
_DTYPES = {v: np.dtype(k) for k, v in _CODES.items()}
#: The numpy dtype names a checkpoint may hold (those with a safetensors code).
NUMPY_DTYPES = frozenset(_CODES)
_MAX_HEADER = 100 * 1024 * 1024


def to_safetensors_dtype(dtype) -> str:
    """The safetensors code of a numpy dtype (ValueError for dtypes the format lacks)."""
    name = np.dtype(dtype).name
    if name not in _CODES:
        raise ValueError(f"safetensors: dtype {name} has no safetensors code (supported: "
                         f"{sorted(_CODES)})")
    return _CODES[name]


def _little_endian(a: np.ndarray) -> np.ndarray:
    if not a.flags.c_contiguous:
        a = np.array(a, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def write_file(path: str, tensors: Mapping[str, Any],
               metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` and fsync it; returns the number of bytes written.

    A tensor is a host array, or a source with ``dtype``, ``shape`` and ``blocks()`` yielding
    host arrays whose bytes, one after the other, are the tensor in row-major order (so a large
    tensor never needs one host copy of its own size)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, src in tensors.items():
        if name == "__metadata__":
            raise ValueError("safetensors: '__metadata__' is reserved and cannot name a tensor")
        dtype, shape = np.dtype(src.dtype), [int(d) for d in src.shape]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": to_safetensors_dtype(dtype), "shape": shape,
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, src in tensors.items():
            blocks = [src] if isinstance(src, np.ndarray) else src.blocks()
            written = 0
            for block in blocks:
                a = _little_endian(np.asarray(block, dtype=src.dtype))
                if a.nbytes:
                    f.write(a.reshape(-1).view(np.uint8).data)  # (bfloat16 has no buffer code)
                written += a.nbytes
            begin, end = header[name]["data_offsets"]
            if written != end - begin:
                raise ValueError(f"safetensors: '{name}' gave {written} bytes for shape "
                                 f"{header[name]['shape']} of {header[name]['dtype']} "
                                 f"({end - begin} bytes)")
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset


def is_count(v: Any) -> bool:
    """A non-negative int (not a bool): a valid size, offset or index from an untrusted file."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_entry(path: str, name: str, entry: Any, data_bytes: int) -> None:
    """A header record must name a known dtype, a shape of non-negative ints, and data offsets
    inside the file that fit the shape exactly."""
    where = f"safetensors: {path}: tensor '{name}'"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: its header record is a {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end] with "
                         "0 <= begin <= end")
    if offsets[1] > data_bytes:
        raise ValueError(f"{where}: data_offsets {offsets} run past the end of the data "
                         f"({data_bytes} bytes); the file is truncated or corrupt")
    nbytes = _DTYPES[dtype].itemsize
    for d in shape:
        nbytes *= d  # Python ints: no overflow on hostile shapes
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"{where}: data_offsets {offsets} ({offsets[1] - offsets[0]} bytes) do "
                         f"not fit shape {shape} of {dtype} ({nbytes} bytes)")


def read_header(path: str) -> tuple[dict, int]:
    """(the JSON header, the file offset where the tensor bytes start).

    The file is untrusted: the header length, the JSON, every record's dtype (safetensors codes
    only), shape and data offsets are checked against the file's size before any tensor byte is
    read; anything else raises ValueError naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"safetensors: {path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"safetensors: {path} declares a {n}-byte header but holds "
                             f"{size} bytes; not a safetensors file (truncated or corrupt)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"safetensors: {path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"safetensors: {path}: the header is a {type(header).__name__}, not an "
                         "object")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, size - 8 - n)
    return header, 8 + n


def read_block(path: str, entry: Mapping, data_start: int, index: tuple[slice, ...],
               out: np.ndarray) -> None:
    """Copy ``tensor[index]`` of one tensor of the file (``entry`` is its header record, as
    checked by :func:`read_header`) into ``out``, reading only the pages that hold the block (a
    memory map of the file). ``index`` must lie inside the tensor's shape."""
    dtype = _DTYPES[entry["dtype"]]
    shape = tuple(entry["shape"])
    if len(index) != len(shape) or any(not 0 <= s.start <= s.stop <= d
                                       for s, d in zip(index, shape)):
        raise ValueError(f"safetensors: {path}: index {[(s.start, s.stop) for s in index]} "
                         f"lies outside the tensor's shape {list(shape)}")
    begin, end = entry["data_offsets"]
    if end > begin:
        out[...] = np.memmap(path, dtype=dtype, mode="r", offset=data_start + begin,
                             shape=shape)[index]
