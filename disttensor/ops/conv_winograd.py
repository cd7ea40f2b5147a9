"""Winograd F(2x2, 3x3) convolution: a 3x3, stride-1, undilated, ungrouped conv2d as 16 GEMMs
of ``[O, C] @ [C, tiles]`` — 2.25 times fewer multiplications than im2col's GEMM. Each 4x4
input tile (every second row and column) is transformed to ``B^T d B``, each weight to
``G g G^T``; the 16 products of the transformed entries, summed over the channels, give each
2x2 output block as ``A^T M A``. The weight gradient is the
adjoint: ``G^T (sum of (A dY A^T) * (B^T d B)) G``, 16 GEMMs over the tiles.

The tile transforms are numba loops (:mod:`.numba_winograd`), so this path runs only where
numba is the kernel backend (:data:`.fast.BACKEND`) and the channels are many enough for the
GEMMs to dominate; :func:`fits` says when, and conv2d falls back to im2col otherwise.
Results equal im2col's within rounding (the transforms add and halve).
"""
from __future__ import annotations

import functools

import numpy as np

from . import fast

__all__ = ["fits", "conv3x3", "weight_grad3x3"]

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


def fits(xp, x, other, w_shape, stride, dilation, groups) -> bool:
    """Whether :func:`conv3x3` (``other`` the weight) or :func:`weight_grad3x3` (``other``
    dout) serves this conv2d call or its weight gradient (weight of ``w_shape``)."""
    return (fast.BACKEND == "numba" and xp is np and type(x) is np.ndarray
            and x.dtype in (np.float32, np.float64) and other.dtype == x.dtype
            and tuple(w_shape[2:]) == (3, 3) and tuple(stride) == (1, 1)
            and tuple(dilation) == (1, 1) and groups == 1 and x.shape[0] > 0
            and min(x.shape[1], w_shape[0]) >= MIN_CHANNELS)


def _tiling(x: np.ndarray, padding) -> tuple[int, int, int, int]:
    """(Ho, Wo, tiles down, tiles across) of x with ``padding``."""
    pt, pb, pl, pr = padding
    ho, wo = x.shape[2] + pt + pb - 2, x.shape[3] + pl + pr - 2
    return ho, wo, -(-ho // 2), -(-wo // 2)


def _step(n: int, channels: int, tiles: int, itemsize: int) -> int:
    return min(n, max(1, CHUNK_BYTES // (16 * channels * tiles * itemsize)))


def conv3x3(x: np.ndarray, weight: np.ndarray, padding) -> np.ndarray:
    """``conv2d(x [N, C, H, W], weight [O, C, 3, 3])`` with padding (top, bottom, left,
    right), stride and dilation 1."""
    loops = _loops()
    n, c = x.shape[:2]
    o = weight.shape[0]
    ho, wo, th, tw = _tiling(x, padding)
    x = np.ascontiguousarray(x)
    u = np.einsum("ai,ocij,bj->aboc", _G, weight, _G).astype(x.dtype).reshape(16, 1, o, c)
    out = np.empty((n, o, ho, wo), dtype=x.dtype)
    tiles = th * tw
    step = _step(n, max(c, o), tiles, x.dtype.itemsize)
    v = m = None
    for start in range(0, n, step):
        stop = min(n, start + step)
        if v is None or v.shape[1] != stop - start:
            v = np.empty((16, stop - start, c, tiles), dtype=x.dtype)
            m = np.empty((16, stop - start, o, tiles), dtype=x.dtype)
        loops.input_tiles(x[start:stop], v, th, tw, padding[0], padding[2])
        np.matmul(u, v, out=m)
        loops.output_tiles(m, out[start:stop], tw)
    return out


def weight_grad3x3(x: np.ndarray, dout: np.ndarray, padding) -> np.ndarray:
    """The weight gradient ``[O, C, 3, 3]`` of :func:`conv3x3` for ``dout [N, O, Ho, Wo]``:
    ``G^T (sum over samples and tiles of (A dY A^T) * (B^T d B)) G`` per entry, the 16
    channel products as GEMMs ``[O, tiles] @ [tiles, C]``."""
    loops = _loops()
    n, c = x.shape[:2]
    o = dout.shape[1]
    ho, wo, th, tw = _tiling(x, padding)
    x = np.ascontiguousarray(x)
    tiles = th * tw
    step = _step(n, max(c, o), tiles, x.dtype.itemsize)
    du = np.zeros((16, o, c), dtype=x.dtype)
    v = dm = None
    for start in range(0, n, step):
        stop = min(n, start + step)
        if v is None or v.shape[1] != stop - start:
            v = np.empty((16, stop - start, c, tiles), dtype=x.dtype)
            dm = np.empty((16, stop - start, o, tiles), dtype=x.dtype)
        loops.input_tiles(x[start:stop], v, th, tw, padding[0], padding[2])
        loops.grad_tiles(np.ascontiguousarray(dout[start:stop]), dm, th, tw)
        for k in range(stop - start):
            du += np.matmul(dm[:, k], v[:, k].transpose(0, 2, 1))
    return np.einsum("ai,aboc,bj->ocij", _G, du.reshape(4, 4, o, c), _G).astype(x.dtype)
