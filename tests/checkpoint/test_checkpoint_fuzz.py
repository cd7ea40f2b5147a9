"""Checkpoints are untrusted input: a corrupted or hostile ``metadata.json`` or safetensors
file gives a clear error on every rank — never a crash, a hang, a wrong value or a read outside
the checkpoint directory — and leaves the target state dict unchanged."""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Shard

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

W = np.arange(24, dtype=np.float32).reshape(6, 4)
B = np.array([1.0, -2.0, 3.0], dtype=np.float32)
RANK0 = "rank_00000.safetensors"


def _mesh():
    return dt.ProcessMesh(list(range(collectives.init().size)), dim_names=["x"])


def _state(w, b, step):
    return {"w": dt.shard_tensor(w, _mesh(), [Shard(0)]), "b": dt.to_tensor(b), "step": step}


@pytest.fixture(scope="module")
def saved():
    """(scratch directory, a valid checkpoint inside it), shared by every case."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    root = comm.bcast(tempfile.mkdtemp(prefix="dt-fuzz-") if comm.rank == 0 else None)
    dt.save_state_dict(_state(W, B, 3), os.path.join(root, "good"))
    yield root
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


# -- corruptions (run on rank 0 only, on a fresh copy of the checkpoint) ------------------------

def _meta(fn):
    def apply(d):
        path = os.path.join(d, "metadata.json")
        with open(path) as f:
            md = json.load(f)
        fn(md)
        with open(path, "w") as f:
            json.dump(md, f)
    return apply


def _tensor(name, **fields):
    return _meta(lambda md: md["tensors"][name].update(fields))


def _chunk(name, **fields):
    return _meta(lambda md: md["tensors"][name]["chunks"][0].update(fields))


def _header(fn):
    def apply(d):
        path = os.path.join(d, RANK0)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header, data = json.loads(f.read(n)), f.read()
        fn(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text + data)
    return apply


def _bytes(fn):
    def apply(d):
        path = os.path.join(d, RANK0)
        with open(path, "rb") as f:
            raw = f.read()
        with open(path, "wb") as f:
            f.write(fn(raw))
    return apply


def _last_file_truncated(d):
    """Only the highest rank reads its own piece of "w" from the last file: the other ranks
    must learn its error."""
    last = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    with open(os.path.join(d, last), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(d, last)) - 4)


def _outside_copy(d):
    """A valid chunk file placed next to (outside) the checkpoint directory."""
    shutil.copy(os.path.join(d, RANK0), os.path.join(os.path.dirname(d), "x"))


def _file_outside(name):
    def apply(d):
        _outside_copy(d)
        _chunk("b", file=name)(d)
    return apply


def _symlink_outside(d):
    _outside_copy(d)
    os.remove(os.path.join(d, RANK0))
    os.symlink(os.path.join(os.path.dirname(d), "x"), os.path.join(d, RANK0))


def _metadata_symlink_outside(d):
    outside = os.path.join(os.path.dirname(d), "meta.json")
    shutil.move(os.path.join(d, "metadata.json"), outside)
    os.symlink(outside, os.path.join(d, "metadata.json"))


def _fifo(d):
    os.remove(os.path.join(d, RANK0))
    os.mkfifo(os.path.join(d, RANK0))


def _set_entry(**fields):
    return _header(lambda h: h["b"].update(fields))


def _truncate(path):
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw[:len(raw) // 2])


CASES = {
    "metadata_truncated": (lambda d: _truncate(os.path.join(d, "metadata.json")),
                           "not valid JSON"),
    "metadata_not_an_object": (_meta(lambda md: md.update(tensors=[1, 2])), "must both be"),
    "file_parent": (_file_outside("../x"), "not a plain file name"),
    "file_absolute": (_chunk("b", file="/etc/passwd"), "not a plain file name"),
    "file_dot": (_chunk("b", file="."), "not a plain file name"),
    "file_not_str": (_chunk("b", file=7), "not a plain file name"),
    "file_missing": (_chunk("b", file="rank_09999.safetensors"), "is missing; metadata.json"),
    "file_symlink_outside": (_symlink_outside, "leading outside"),
    "file_fifo": (_fifo, "is missing or not a regular file"),
    "metadata_symlink_outside": (_metadata_symlink_outside, "leading outside"),
    "meta_unknown_dtype": (_tensor("b", dtype="complex64"), "dtype 'complex64' is not one of"),
    "meta_object_dtype": (_tensor("b", dtype="object"), "dtype 'object' is not one of"),
    "meta_negative_shape": (_tensor("b", shape=[-3]), "not a list of non-negative ints"),
    "meta_float_shape": (_tensor("b", shape=[3.0]), "not a list of non-negative ints"),
    "meta_string_shape": (_tensor("b", shape="3"), "not a list of non-negative ints"),
    "meta_index_past_shape": (_chunk("b", index=[[0, 5]]), "expected one"),
    "meta_negative_index": (_chunk("b", index=[[-1, 3]]), "expected one"),
    "meta_index_wrong_rank": (_chunk("b", index=[[0, 3], [0, 1]]), "expected one"),
    "meta_value_list": (_meta(lambda md: md["values"]["step"].update(value=[1, 2])),
                        "value 'step'"),
    "last_rank_file_truncated": (_last_file_truncated, "run past the end"),
    "file_truncated": (_bytes(lambda raw: raw[:len(raw) - 8]), "run past the end"),
    "file_too_short": (_bytes(lambda raw: raw[:5]), "too short"),
    "header_length_huge": (_bytes(lambda raw: struct.pack("<Q", 2**63) + raw[8:]),
                           "-byte header but holds"),
    "header_length_past_end": (_bytes(lambda raw: struct.pack("<Q", len(raw)) + raw[8:]),
                               "-byte header but holds"),
    "header_garbage": (_bytes(lambda raw: raw[:8] + b"\xff" * (len(raw) - 8)), "not valid JSON"),
    "header_not_object": (_header(lambda h: (h.clear(), h.update({"b": 5}))),
                          "not an object"),
    "header_offsets_past_end": (_set_entry(data_offsets=[0, 10**12]), "run past the end"),
    "header_negative_offset": (_set_entry(data_offsets=[-4, 8]), "0 <= begin <= end"),
    "header_offsets_reversed": (_set_entry(data_offsets=[12, 0]), "0 <= begin <= end"),
    "header_offsets_misfit": (_set_entry(data_offsets=[0, 8]), "do not fit shape"),
    "header_unknown_dtype": (_set_entry(dtype="C64"), "dtype 'C64' is not one of"),
    "header_negative_shape": (_set_entry(shape=[-3]), "not a list of non-negative ints"),
    "header_float_shape": (_set_entry(shape=[1.5, 2]), "not a list of non-negative ints"),
    "header_huge_shape": (_set_entry(shape=[2**62, 2**62]), "do not fit shape"),
    "header_dtype_differs": (_set_entry(dtype="I32"), "places a float32 chunk"),
    "header_shape_differs": (_set_entry(shape=[1, 3]), "places a float32 chunk of shape"),
    "header_lacks_tensor": (_header(lambda h: h.pop("b")), "lacks 'b'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_corrupt_checkpoint_raises_on_every_rank(saved, comm, case):
    corrupt, expected = CASES[case]
    bad = os.path.join(saved, case, "ckpt")
    if comm.rank == 0:
        shutil.copytree(os.path.join(saved, "good"), bad)
        corrupt(bad)
    comm.barrier()
    target = _state(np.zeros_like(W), np.zeros_like(B), 0)
    with pytest.raises((ValueError, FileNotFoundError, RuntimeError)) as info:
        dt.load_state_dict(target, bad)
    msg = str(info.value)
    assert expected in msg, msg  # every rank names the problem (the failing rank's error)
    assert msg.startswith(("load_state_dict: ", "safetensors: ")), msg
    # nothing was modified
    assert target["step"] == 0
    np.testing.assert_array_equal(target["w"].to_local().numpy(), 0)
    np.testing.assert_array_equal(target["b"].numpy(), 0)


def test_the_untouched_checkpoint_loads(saved):
    target = _state(np.zeros_like(W), np.zeros_like(B), 0)
    dt.load_state_dict(target, os.path.join(saved, "good"))
    np.testing.assert_array_equal(target["w"].numpy(), W)
    np.testing.assert_array_equal(target["b"].numpy(), B)
    assert target["step"] == 3
