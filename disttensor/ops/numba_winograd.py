"""Compiled tile transforms of the Winograd F(2x2, 3x3) convolution (numba; see
:mod:`.conv_winograd`). Both loops take C-contiguous arrays of one dtype, float32 or float64,
and write their output in place; single-threaded, compiled once per dtype into numba's cache.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .numba_loops import _JIT


@njit(**_JIT)
def input_tiles(x, v, tiles_h, tiles_w, pad_top, pad_left):
    """``v[e, s, c, t] = (B^T d B)[e]`` for the 4x4 tile ``d`` at rows ``2 i``, columns
    ``2 j`` of ``x [n, C, H, W]`` zero-padded by ``pad_top`` rows and ``pad_left`` columns
    before (and as many as the tiles need after); ``t = i * tiles_w + j``, ``e`` the 16
    entries row-major, ``B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]``.
    Per row of tiles: its four input rows copied into a zero-padded buffer, their four row
    combinations of ``B^T d`` over the whole width, then the column combinations."""
    n, c, h, w = x.shape
    width = 2 * tiles_w + 2
    cols = min(w, width - pad_left)
    src = np.zeros((4, width), dtype=x.dtype)
    rows = np.empty((4, width), dtype=x.dtype)
    zero = x.dtype.type(0.0)
    for s in range(n):
        for ch in range(c):
            plane = x[s, ch]
            for i in range(tiles_h):
                for k in range(4):
                    row = 2 * i + k - pad_top
                    if 0 <= row < h:
                        for q in range(cols):
                            src[k, pad_left + q] = plane[row, q]
                    else:
                        for q in range(width):
                            src[k, q] = zero
                for q in range(width):
                    rows[0, q] = src[0, q] - src[2, q]
                    rows[1, q] = src[1, q] + src[2, q]
                    rows[2, q] = src[2, q] - src[1, q]
                    rows[3, q] = src[1, q] - src[3, q]
                t0 = i * tiles_w
                for k in range(4):
                    a = rows[k]
                    e = 4 * k
                    for j in range(tiles_w):
                        q = 2 * j
                        v[e, s, ch, t0 + j] = a[q] - a[q + 2]
                        v[e + 1, s, ch, t0 + j] = a[q + 1] + a[q + 2]
                        v[e + 2, s, ch, t0 + j] = a[q + 2] - a[q + 1]
                        v[e + 3, s, ch, t0 + j] = a[q + 1] - a[q + 3]


@njit(**_JIT)
def output_tiles(m, out, tiles_w):
    """``out[s, o, 2 i + a, 2 j + b] = (A^T M A)[a, b]`` for the tiles of ``m [16, n, O, T]``,
    ``A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]``; rows and columns past ``out``'s are dropped."""
    n, o = out.shape[:2]
    h, w = out.shape[2:]
    tiles = m.shape[3]
    zero = m.dtype.type(0.0)
    for s in range(n):
        for oc in range(o):
            for t in range(tiles):
                i, j = t // tiles_w, t % tiles_w
                y00 = y01 = y10 = y11 = zero
                for row in range(4):
                    b0 = m[4 * row, s, oc, t]
                    b1 = m[4 * row + 1, s, oc, t]
                    b2 = m[4 * row + 2, s, oc, t]
                    b3 = m[4 * row + 3, s, oc, t]
                    c0 = b0 + b1 + b2
                    c1 = b1 - b2 - b3
                    if row == 0:
                        y00 += c0
                        y01 += c1
                    elif row == 3:
                        y10 -= c0
                        y11 -= c1
                    else:
                        y00 += c0
                        y01 += c1
                        if row == 1:
                            y10 += c0
                            y11 += c1
                        else:
                            y10 -= c0
                            y11 -= c1
                r, q = 2 * i, 2 * j
                out[s, oc, r, q] = y00
                if q + 1 < w:
                    out[s, oc, r, q + 1] = y01
                if r + 1 < h:
                    out[s, oc, r + 1, q] = y10
                    if q + 1 < w:
                        out[s, oc, r + 1, q + 1] = y11


@njit(**_JIT)
def grad_tiles(dout, dm, tiles_h, tiles_w):
    """``dm[e, s, o, t] = (A dY A^T)[e]`` for the 2x2 block ``dY`` of ``dout [n, O, Ho, Wo]``
    at rows ``2 i``, columns ``2 j`` (zero past its edges), ``A = [[1, 0], [1, 1], [1, -1],
    [0, -1]]``: the adjoint of :func:`output_tiles`' transform."""
    n, o, h, w = dout.shape
    rows = np.zeros((4, 2 * tiles_w), dtype=dout.dtype)
    zero = dout.dtype.type(0.0)
    for s in range(n):
        for oc in range(o):
            g = dout[s, oc]
            for i in range(tiles_h):
                r = 2 * i
                has_next = r + 1 < h
                for q in range(w):
                    a = g[r, q]
                    b = g[r + 1, q] if has_next else zero
                    rows[0, q] = a
                    rows[1, q] = a + b
                    rows[2, q] = a - b
                    rows[3, q] = -b
                t0 = i * tiles_w
                for k in range(4):
                    row = rows[k]
                    e = 4 * k
                    for j in range(tiles_w):
                        a = row[2 * j]
                        b = row[2 * j + 1]
                        dm[e, s, oc, t0 + j] = a
                        dm[e + 1, s, oc, t0 + j] = a + b
                        dm[e + 2, s, oc, t0 + j] = a - b
                        dm[e + 3, s, oc, t0 + j] = -b
