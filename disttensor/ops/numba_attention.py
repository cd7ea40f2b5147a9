"""Compiled row passes of fused attention's key blocks (numba; see :mod:`.attention` and
:mod:`.fast`), built on the vectorizable ``exp`` and ``maxnum`` of :mod:`.numba_loops`. The
loops take C-contiguous ``[rows, kb]`` tiles and ``[rows]`` vectors of one dtype, float32 or
float64, and write in place."""
from __future__ import annotations

import numpy as np
from numba import njit

from .numba_loops import _JIT, _exp, _maxnum


@njit(**_JIT)
def attention_softmax(s, m, lsum, alpha):
    """One key block of the online softmax, per row of the score tile ``s`` [rows, kb] (masked
    scores -inf): the new running max ``m`` (shift 0 while a row has no kept key),
    ``s = exp(s - shift)``, ``alpha = exp(m_old - shift)`` and ``lsum = lsum * alpha +
    sum(s)``, all in place."""
    rows, n = s.shape
    zero = s.dtype.type(0.0)
    for i in range(rows):
        mi = m[i]
        for j in range(n):
            mi = _maxnum(mi, s[i, j])
        shift = zero if mi == -np.inf else mi
        for j in range(n):
            s[i, j] = _exp(s[i, j] - shift)
        t = zero
        for j in range(n):
            t += s[i, j]
        a = _exp(m[i] - shift)
        alpha[i] = a
        lsum[i] = lsum[i] * a + t
        m[i] = mi


@njit(**_JIT)
def attention_grad_rows(p, dp, lse, delta):
    """One key block of attention's backward, per row: ``p = exp(p - lse)`` (the scores'
    probabilities; lse +inf for rows with no kept key) and ``dp = p * (dp - delta)``, in
    place."""
    rows, n = p.shape
    for i in range(rows):
        li, di = lse[i], delta[i]
        for j in range(n):
            v = _exp(p[i, j] - li)
            p[i, j] = v
            dp[i, j] = v * (dp[i, j] - di)
