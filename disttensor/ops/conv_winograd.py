"""Winograd F(2x2, 3x3) convolution: a 3x3, stride-1, undilated, ungrouped conv2d as 16 GEMMs
of ``[O, C] @ [C, tiles]`` — 2.25 times fewer multiplications than im2col's GEMM. Each 4x4
input tile (every second row and column) is transformed to ``B^T d B``, each weight to
``G g G^T``; the 16 products of the transformed entries, summed over the channels, give each
2x2 output block as ``A^T M A`` (Lavin and Gray's formulation).

The tile transforms are numba loops (:mod:`.numba_winograd`), so this path runs only where
numba is the kernel backend (:data:`.fast.BACKEND`) and the channels are many enough for the
GEMMs to dominate; :func:`fits` says when, and conv2d falls back to im2col otherwise.
Results equal im2col's within rounding (the transforms add and halve).
"""
from __future__ import annotations

import functools

import numpy as np

from . import fast

__all__ = ["fits", "conv3x3"]

#: channels (in and out) from which the transforms pay for themselves
MIN_CHANNELS = 16
#: bytes of transformed tiles made at once (samples are taken in chunks of about this size)
CHUNK_BYTES = 4 << 20

_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


@functools.cache
def _loops():
    fast._loops()  # numba's code generator set up as for the other compiled kernels
    from . import numba_winograd
    return numba_winograd


def fits(xp, x, weight, stride, dilation, groups) -> bool:
    """Whether :func:`conv3x3` serves this conv2d call."""
    return (fast.BACKEND == "numba" and xp is np and type(x) is np.ndarray
            and x.dtype in (np.float32, np.float64) and weight.dtype == x.dtype
            and tuple(weight.shape[2:]) == (3, 3) and tuple(stride) == (1, 1)
            and tuple(dilation) == (1, 1) and groups == 1 and x.shape[0] > 0
            and min(x.shape[1], weight.shape[0]) >= MIN_CHANNELS)


def conv3x3(x: np.ndarray, weight: np.ndarray, padding) -> np.ndarray:
    """``conv2d(x [N, C, H, W], weight [O, C, 3, 3])`` with padding (top, bottom, left,
    right), stride and dilation 1."""
    loops = _loops()
    n, c, h, w = x.shape
    o = weight.shape[0]
    pt, pb, pl, pr = padding
    ho, wo = h + pt + pb - 2, w + pl + pr - 2
    th, tw = -(-ho // 2), -(-wo // 2)
    xpad = np.zeros((n, c, 2 * th + 2, 2 * tw + 2), dtype=x.dtype)
    rows, cols = min(h, 2 * th + 2 - pt), min(w, 2 * tw + 2 - pl)
    xpad[:, :, pt:pt + rows, pl:pl + cols] = x[:, :, :rows, :cols]
    u = np.einsum("ai,ocij,bj->aboc", _G, weight, _G).astype(x.dtype).reshape(16, 1, o, c)
    out = np.empty((n, o, ho, wo), dtype=x.dtype)
    tiles = th * tw
    step = max(1, CHUNK_BYTES // (16 * max(c, o) * tiles * x.dtype.itemsize))
    v = m = None
    for start in range(0, n, step):
        stop = min(n, start + step)
        if v is None or v.shape[1] != stop - start:
            v = np.empty((16, stop - start, c, tiles), dtype=x.dtype)
            m = np.empty((16, stop - start, o, tiles), dtype=x.dtype)
        loops.input_tiles(xpad[start:stop], v, th, tw)
        np.matmul(u, v, out=m)
        loops.output_tiles(m, out[start:stop], tw)
    return out
