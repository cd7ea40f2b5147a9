"""The shared result pool and the streaming row copy of ``collectives._shared``, in one process
(the process maps its own segments through /proc as a peer would)."""
import os
import sys

import numpy as np
import pytest

from collectives import _shared

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or
                                not hasattr(os, "memfd_create"), reason="Linux memfd only")


def rows_oracle(dst, dpos, src, spos, rows, run, stride):
    for i in range(rows):
        dst[dpos + i * run:dpos + (i + 1) * run] = src[spos + i * stride:spos + i * stride + run]


@pytest.mark.parametrize("kernel", ["streaming", "numpy"])
def test_copy_rows_equals_slicing(monkeypatch, kernel):
    """Every alignment of source and destination, runs shorter and longer than 16 bytes,
    empty copies; bytes outside the destination range stay as they were."""
    if kernel == "numpy":
        monkeypatch.setattr(_shared, "_kernel", [_shared._numpy_rows])
    pool = _shared.SharedResults([os.getpid()])
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, stride = int(rng.integers(0, 7)), int(rng.integers(1, 90))
        run, spos, dpos = int(rng.integers(0, stride + 1)), int(rng.integers(0, 40)), \
            int(rng.integers(0, 40))
        src = rng.integers(0, 256, spos + rows * stride + 3, dtype=np.uint8)
        dst, _ = pool.result((dpos + rows * run + 8,), np.uint8)
        dst[:] = 7
        expect = dst.copy()
        rows_oracle(expect, dpos, src, spos, rows, run, stride)
        _shared.copy_rows(dst, dpos, src, spos, rows, run, stride)
        np.testing.assert_array_equal(dst, expect)


def test_results_are_pooled_and_mapped_by_serial():
    """A segment returns to the pool when the last view dies and serves the next result that
    fits (not one more than twice its size); a peer mapping (here of this process's own
    segment) sees the result's memory, and a token with a new serial maps afresh."""
    pool = _shared.SharedResults([os.getpid()])
    a, tok = pool.result((1000, 3), np.float64)
    assert a.shape == (1000, 3) and a.flags.c_contiguous and a.flags.writeable
    view = pool.peer(0, tok)
    view[:24] = np.arange(3, dtype=np.float64).view(np.uint8)
    np.testing.assert_array_equal(a[0], [0, 1, 2])
    assert pool.peer(0, tok) is view
    addr = a.__array_interface__["data"][0]
    b = a[1:]
    del a
    c, _ = pool.result((1000, 3), np.float64)
    assert c.__array_interface__["data"][0] != addr  # b keeps the segment
    del b
    small, _ = pool.result((10,), np.float64)  # the free segment is over twice as big
    assert small.__array_interface__["data"][0] != addr
    again, tok2 = pool.result((999, 3), np.float64)
    assert again.__array_interface__["data"][0] == addr and tok2 == tok
    stale = (tok[0], tok[1] + 1, tok[2])
    assert pool.peer(0, stale) is not view


def test_pool_limit_closes_segments(monkeypatch):
    """Past POOL_BYTES a dead result's segment is closed, not kept."""
    monkeypatch.setattr(_shared, "POOL_BYTES", 0)
    pool = _shared.SharedResults([os.getpid()])
    a, (fd, _, _) = pool.result((4096,), np.uint8)
    del a
    assert pool._owned == 0 and not pool._free
    with pytest.raises(OSError):
        os.fstat(fd)


def test_mapping_a_missing_segment_names_the_member():
    pool = _shared.SharedResults([os.getpid(), 2**22 + 12345])
    with pytest.raises(OSError, match=r"cannot map the result segment of group member 1 "
                                      r"\(/proc/\d+/fd/5\)"):
        pool.peer(1, (5, 1, 4096))
