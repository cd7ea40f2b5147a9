"""Samples of the vision ops (conv2d, conv2d_transpose, pooling, resampling, padding): uneven
sizes, strides, dilation, groups (depthwise included), ceil mode; pooling inputs have well
separated values (no ties for max)."""
from __future__ import annotations

import numpy as np


def _n(rng, *shape):
    return rng.standard_normal(shape)


def _distinct(rng, *shape):
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.37 - n * 0.15).reshape(shape)


def _conv(xs, ws, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1), groups=1):
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return lambda rng: ([_n(rng, *xs), _n(rng, *ws)], dict(attrs))


def _transpose(xs, ws, stride=(1, 1), padding=(0, 0, 0, 0), output_padding=(0, 0),
               dilation=(1, 1), groups=1):
    attrs = {"stride": stride, "padding": padding, "output_padding": output_padding,
             "dilation": dilation, "groups": groups}
    return lambda rng: ([_n(rng, *xs), _n(rng, *ws)], dict(attrs))


def _window(op_attrs, shape=(2, 3, 5, 6)):
    return lambda rng: ([_distinct(rng, *shape)], dict(op_attrs))


def _pool(k, s, p, ceil, **extra):
    return {"kernel_size": k, "stride": s, "padding": p, "ceil_mode": ceil, **extra}


def _resample(mode, out_hw, shape, align=False, ratio=None):
    attrs = {"out_hw": out_hw, "mode": mode, "align_corners": align, "ratio": ratio}
    return lambda rng: ([_n(rng, *shape)], attrs)


def _pad(shape, pads, mode, value=0.0):
    return lambda rng: ([_n(rng, *shape)], {"pads": pads, "mode": mode, "value": value})


SAMPLES: dict[str, list] = {
    "conv2d": [
        _conv((3, 3, 5, 6), (4, 3, 3, 3), padding=(1, 1, 1, 1)),
        _conv((2, 4, 7, 9), (6, 2, 3, 2), stride=(2, 1), padding=(0, 1, 2, 0), dilation=(1, 2),
              groups=2),
        _conv((2, 3, 5, 5), (3, 1, 3, 3), stride=(2, 2), padding=(1, 1, 1, 1), groups=3),
        _conv((3, 5, 4, 3), (2, 5, 1, 1)),
    ],
    "conv2d_transpose": [
        _transpose((3, 3, 5, 4), (3, 4, 3, 3), stride=(2, 2), padding=(1, 1, 1, 1),
                   output_padding=(1, 0)),
        _transpose((2, 4, 3, 5), (4, 3, 2, 3), stride=(2, 3), padding=(0, 1, 2, 0),
                   output_padding=(1, 2), dilation=(2, 1), groups=2),
        _transpose((3, 2, 4, 3), (2, 5, 3, 1), padding=(1, 0, 0, 0), dilation=(1, 1)),
        _transpose((2, 3, 3, 3), (3, 1, 3, 3), stride=(2, 2), padding=(1, 1, 1, 1), groups=3),
    ],
    "max_pool2d": [
        _window(_pool((2, 2), (2, 2), (0, 0, 0, 0), True)),
        _window(_pool((3, 3), (2, 1), (1, 1, 1, 1), False)),
    ],
    "avg_pool2d": [
        _window(_pool((3, 3), (2, 2), (1, 1, 1, 1), True, exclusive=True)),
        _window(_pool((2, 3), (1, 2), (0, 0, 1, 0), False, exclusive=False), (3, 2, 4, 5)),
    ],
    "resample2d": [
        _resample("area", (2, 3), (2, 3, 5, 7)),
        _resample("nearest", (7, 4), (3, 2, 3, 5)),
        _resample("bilinear", (4, 9), (2, 3, 3, 5)),
        _resample("bilinear", (5, 3), (2, 2, 3, 4), align=True),
        _resample("nearest", (6, 10), (2, 2, 3, 5), ratio=(0.5, 0.5)),
    ],
    "adaptive_max_pool2d": [_window({"out_hw": (2, 3)}, (2, 3, 5, 7))],
    "pad": [
        _pad((3, 4, 5), ((0, 0), (1, 2), (2, 0)), "constant", 0.5),
        _pad((2, 3, 4, 5), ((0, 0), (0, 0), (2, 1), (1, 3)), "reflect"),
        _pad((2, 3, 4, 3), ((0, 0), (0, 0), (1, 2), (3, 1)), "replicate"),
    ],
}
