"""numpy-only references of the vision ops: convolution, transposed convolution and pooling
as loops over kernel offsets or output positions, resampling from its per-axis formulas,
padding from ``np.pad`` and index maps (no code shared with the kernels)."""
from __future__ import annotations

import math

import numpy as np


def _out(n, k, s, p0, p1, d=1):
    return (n + p0 + p1 - d * (k - 1) - 1) // s + 1


def _conv2d(a, k, o):
    x, w = a
    (sh, sw), (dh, dw), g = k["stride"], k["dilation"], k["groups"]
    pt, pb, pl, pr = k["padding"]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    n, c, h, wd = x.shape
    oc, cg, kh, kw = w.shape
    ho, wo = _out(h, kh, sh, pt, pb, dh), _out(wd, kw, sw, pl, pr, dw)
    out = np.zeros((n, oc, ho, wo))
    og = oc // g
    for gi in range(g):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, gi * cg:(gi + 1) * cg, i * dh:i * dh + sh * (ho - 1) + 1:sh,
                           j * dw:j * dw + sw * (wo - 1) + 1:sw]
                out[:, gi * og:(gi + 1) * og] += np.einsum(
                    "nchw,oc->nohw", patch, w[gi * og:(gi + 1) * og, :, i, j])
    return (out,)


def _conv2d_grad(a, k, o):
    x, w, dout = a
    (sh, sw), (dh, dw), g = k["stride"], k["dilation"], k["groups"]
    pt, pb, pl, pr = k["padding"]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    dxp = np.zeros_like(xp)
    dwt = np.zeros_like(w)
    oc, cg, kh, kw = w.shape
    ho, wo = dout.shape[2:]
    og = oc // g
    for gi in range(g):
        cs, os_ = slice(gi * cg, (gi + 1) * cg), slice(gi * og, (gi + 1) * og)
        for i in range(kh):
            for j in range(kw):
                hs = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
                ws = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
                dxp[:, cs, hs, ws] += np.einsum("nohw,oc->nchw", dout[:, os_], w[os_, :, i, j])
                dwt[os_, :, i, j] = np.einsum("nohw,nchw->oc", dout[:, os_], xp[:, cs, hs, ws])
    h, wd = x.shape[2:]
    return dxp[:, :, pt:pt + h, pl:pl + wd], dwt


def _transpose_slices(k, x_hw, i, j):
    """The rows and columns of the uncropped transposed-conv output kernel offset (i, j)
    writes."""
    (sh, sw), (dh, dw) = k["stride"], k["dilation"]
    h, w = x_hw
    return (slice(i * dh, i * dh + sh * (h - 1) + 1, sh),
            slice(j * dw, j * dw + sw * (w - 1) + 1, sw))


def _transpose_full(x, w, k):
    """The uncropped output size and the crop giving the output."""
    (sh, sw), (dh, dw), (eh, ew) = k["stride"], k["dilation"], k["output_padding"]
    pt, pb, pl, pr = k["padding"]
    kh, kw = w.shape[2:]
    h, wd = x.shape[2:]
    full = ((h - 1) * sh + dh * (kh - 1) + 1 + eh, (wd - 1) * sw + dw * (kw - 1) + 1 + ew)
    crop = (slice(pt, full[0] - pb), slice(pl, full[1] - pr))
    return full, crop


def _conv2d_transpose(a, k, o):
    x, w = a
    g = k["groups"]
    c, og, kh, kw = w.shape
    cg = c // g
    full, (ch, cw) = _transpose_full(x, w, k)
    out = np.zeros((x.shape[0], og * g) + full)
    for gi in range(g):
        cs, os_ = slice(gi * cg, (gi + 1) * cg), slice(gi * og, (gi + 1) * og)
        for i in range(kh):
            for j in range(kw):
                hs, ws = _transpose_slices(k, x.shape[2:], i, j)
                out[:, os_, hs, ws] += np.einsum("nchw,co->nohw", x[:, cs], w[cs, :, i, j])
    return (out[:, :, ch, cw],)


def _conv2d_transpose_grad(a, k, o):
    x, w, dout = a
    g = k["groups"]
    c, og, kh, kw = w.shape
    cg = c // g
    full, (ch, cw) = _transpose_full(x, w, k)
    dfull = np.zeros(dout.shape[:2] + full)
    dfull[:, :, ch, cw] = dout
    dx, dwt = np.zeros_like(x), np.zeros_like(w)
    for gi in range(g):
        cs, os_ = slice(gi * cg, (gi + 1) * cg), slice(gi * og, (gi + 1) * og)
        for i in range(kh):
            for j in range(kw):
                hs, ws = _transpose_slices(k, x.shape[2:], i, j)
                dx[:, cs] += np.einsum("nohw,co->nchw", dfull[:, os_, hs, ws], w[cs, :, i, j])
                dwt[cs, :, i, j] = np.einsum("nchw,nohw->co", x[:, cs], dfull[:, os_, hs, ws])
    return dx, dwt


def _pool_out(n, k, s, p0, p1, ceil):
    span = n + p0 + p1 - k
    m = (math.ceil(span / s) if ceil else span // s) + 1
    return m - 1 if ceil and (m - 1) * s >= n + p0 else m


def _windows(x, k):
    """Yield (i, j, h-range, w-range) of every pooling window, clipped to x."""
    (kh, kw), (sh, sw) = k["kernel_size"], k["stride"]
    pt, pb, pl, pr = k["padding"]
    h, w = x.shape[2:]
    ho, wo = (_pool_out(h, kh, sh, pt, pb, k["ceil_mode"]),
              _pool_out(w, kw, sw, pl, pr, k["ceil_mode"]))
    for i in range(ho):
        for j in range(wo):
            h0, w0 = i * sh - pt, j * sw - pl
            yield i, j, (h0, h0 + kh), (w0, w0 + kw), (ho, wo)


def _max_pool2d(a, k, o):
    (x,) = a
    res = None
    for i, j, (h0, h1), (w0, w1), shape in _windows(x, k):
        res = np.zeros(x.shape[:2] + shape) if res is None else res
        res[:, :, i, j] = x[:, :, max(h0, 0):h1, max(w0, 0):w1].max(axis=(2, 3))
    return (res,)


def _argmax_add(dx, x, hs, ws, g):
    """Add g[n, c] at the first maximum of x[n, c, hs, ws]."""
    win = x[:, :, hs, ws]
    flat = win.reshape(win.shape[0], win.shape[1], -1)
    for n in range(flat.shape[0]):
        for c in range(flat.shape[1]):
            r, q = divmod(int(np.argmax(flat[n, c])), win.shape[3])
            dx[n, c, hs.start + r, ws.start + q] += g[n, c]


def _max_pool2d_grad(a, k, o):
    x, dout = a
    dx = np.zeros_like(x)
    for i, j, (h0, h1), (w0, w1), _ in _windows(x, k):
        _argmax_add(dx, x, slice(max(h0, 0), h1), slice(max(w0, 0), w1), dout[:, :, i, j])
    return (dx,)


def _avg_count(x, k, h0, h1, w0, w1):
    h, w = x.shape[2:]
    pt, pb, pl, pr = k["padding"]
    if k["exclusive"]:
        return (min(h1, h) - max(h0, 0)) * (min(w1, w) - max(w0, 0))
    return (min(h1, h + pb) - h0) * (min(w1, w + pr) - w0)


def _avg_pool2d(a, k, o):
    (x,) = a
    res = None
    for i, j, (h0, h1), (w0, w1), shape in _windows(x, k):
        res = np.zeros(x.shape[:2] + shape) if res is None else res
        res[:, :, i, j] = x[:, :, max(h0, 0):h1, max(w0, 0):w1].sum(axis=(2, 3)) / \
            _avg_count(x, k, h0, h1, w0, w1)
    return (res,)


def _avg_pool2d_grad(a, k, o):
    x, dout = a
    dx = np.zeros_like(x)
    for i, j, (h0, h1), (w0, w1), _ in _windows(x, k):
        dx[:, :, max(h0, 0):h1, max(w0, 0):w1] += \
            dout[:, :, i, j][:, :, None, None] / _avg_count(x, k, h0, h1, w0, w1)
    return (dx,)


def _weights_1d(mode, n, m, align, ratio):
    """For each output index: the (input index, weight) pairs it reads."""
    out = []
    for i in range(m):
        if mode == "area":
            lo, hi = math.floor(i * n / m), math.ceil((i + 1) * n / m)
            out.append([(t, 1.0 / (hi - lo)) for t in range(lo, hi)])
            continue
        if align:
            src = i * (n - 1) / (m - 1) if m > 1 else 0.0
        else:
            r = ratio if ratio is not None else n / m
            src = i * r if mode == "nearest" else max((i + 0.5) * r - 0.5, 0.0)
        if mode == "nearest":
            out.append([(min(int(math.floor(src + 0.5)) if align else int(math.floor(src)),
                             n - 1), 1.0)])
        else:
            i0 = min(int(math.floor(src)), n - 1)
            lam = src - i0
            out.append([(i0, 1.0 - lam), (min(i0 + 1, n - 1), lam)])
    return out


def _resample_weights(x_hw, k):
    ratio = k["ratio"] or (None, None)
    return [_weights_1d(k["mode"], n, m, k["align_corners"], r)
            for n, m, r in zip(x_hw, k["out_hw"], ratio)]


def _resample2d(a, k, o):
    (x,) = a
    wh, ww = _resample_weights(x.shape[2:], k)
    res = np.zeros(x.shape[:2] + tuple(k["out_hw"]))
    for i, rows in enumerate(wh):
        for j, cols in enumerate(ww):
            for r, a_r in rows:
                for c, a_c in cols:
                    res[:, :, i, j] += a_r * a_c * x[:, :, r, c]
    return (res,)


def _resample2d_grad(a, k, o):
    x, dout = a
    wh, ww = _resample_weights(x.shape[2:], k)
    dx = np.zeros(x.shape)
    for i, rows in enumerate(wh):
        for j, cols in enumerate(ww):
            for r, a_r in rows:
                for c, a_c in cols:
                    dx[:, :, r, c] += a_r * a_c * dout[:, :, i, j]
    return (dx,)


def _bins(n, m):
    return [(math.floor(i * n / m), math.ceil((i + 1) * n / m)) for i in range(m)]


def _adaptive_max_pool2d(a, k, o):
    (x,) = a
    res = np.zeros(x.shape[:2] + tuple(k["out_hw"]))
    for i, (h0, h1) in enumerate(_bins(x.shape[2], k["out_hw"][0])):
        for j, (w0, w1) in enumerate(_bins(x.shape[3], k["out_hw"][1])):
            res[:, :, i, j] = x[:, :, h0:h1, w0:w1].max(axis=(2, 3))
    return (res,)


def _adaptive_max_pool2d_grad(a, k, o):
    x, dout = a
    dx = np.zeros_like(x)
    for i, (h0, h1) in enumerate(_bins(x.shape[2], k["out_hw"][0])):
        for j, (w0, w1) in enumerate(_bins(x.shape[3], k["out_hw"][1])):
            _argmax_add(dx, x, slice(h0, h1), slice(w0, w1), dout[:, :, i, j])
    return (dx,)


_NP_MODE = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


def _pad(a, k, o):
    (x,) = a
    if k["mode"] == "constant":
        return (np.pad(x, k["pads"], constant_values=k["value"]),)
    return (np.pad(x, k["pads"], mode=_NP_MODE[k["mode"]]),)


def _pad_grad(a, k, o):
    """Scatter-add dout back through the per-axis index map of the padding."""
    (g,) = a
    mode = "constant" if k["mode"] == "constant" else _NP_MODE[k["mode"]]
    for axis, (lo, hi) in enumerate(k["pads"]):
        n = g.shape[axis] - lo - hi
        src = np.pad(np.arange(n), (lo, hi), constant_values=-1) if mode == "constant" \
            else np.pad(np.arange(n), (lo, hi), mode=mode)
        moved = np.moveaxis(g, axis, 0)
        out = np.zeros((n,) + moved.shape[1:])
        for p, s in enumerate(src):
            if s >= 0:
                out[s] += moved[p]
        g = np.moveaxis(out, 0, axis)
    return (g,)


REFERENCES = {
    "conv2d": _conv2d, "conv2d_grad": _conv2d_grad,
    "conv2d_transpose": _conv2d_transpose, "conv2d_transpose_grad": _conv2d_transpose_grad,
    "max_pool2d": _max_pool2d, "max_pool2d_grad": _max_pool2d_grad,
    "avg_pool2d": _avg_pool2d, "avg_pool2d_grad": _avg_pool2d_grad,
    "resample2d": _resample2d, "resample2d_grad": _resample2d_grad,
    "adaptive_max_pool2d": _adaptive_max_pool2d,
    "adaptive_max_pool2d_grad": _adaptive_max_pool2d_grad,
    "pad": _pad, "pad_grad": _pad_grad,
}
