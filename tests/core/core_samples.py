"""Sample inputs for every differentiable op, shared by the finite-difference and GPU tests.

``SAMPLES[op_name]`` is a list of builders ``rng -> (inputs, attrs)``: ``inputs`` are numpy
arrays (float64 for differentiable inputs, int64 ids/labels, bool conditions) or None, ``attrs``
are normalized the way the public function normalizes them. Values stay away from kinks and
ties (abs, relu, max, clip, maximum, ...). ``OPTIONS`` overrides the finite-difference step and
tolerances for an op where float64 is not used end to end.
"""
from __future__ import annotations

import numpy as np

from disttensor.ops.shape import normalize_index


def _n(rng, *shape):
    return rng.standard_normal(shape)


def _away(rng, *shape, margin=0.2):
    """Normal samples with |value| >= margin (away from 0 kinks)."""
    x = rng.standard_normal(shape)
    return np.where(x >= 0, x + margin, x - margin)


def _pos(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def _distinct(rng, *shape):
    """A permutation of well separated values (no ties for max/min)."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.37 - n * 0.15).reshape(shape)


def _unary(gen=_n, shape=(3, 4), **attrs):
    return lambda rng: ([gen(rng, *shape)], dict(attrs))


def _binary(gx=_n, gy=_n, sx=(3, 4), sy=(3, 4)):
    return lambda rng: ([gx(rng, *sx), gy(rng, *sy)], {})


def _minmax(sx, sy):
    def build(rng):
        x = _n(rng, *sx)
        y = _n(rng, *sy)
        if sx == sy:  # push apart wherever they come close
            y = np.where(np.abs(x - y) < 0.2, x + 0.5, y)
        return [x, y], {}
    return build


def _matmul(sx, sy, tx=False, ty=False):
    return lambda rng: ([_n(rng, *sx), _n(rng, *sy)],
                        {"transpose_x": tx, "transpose_y": ty})


def _reduce(shape, axis, keepdim, gen=_n, **extra):
    return lambda rng: ([gen(rng, *shape)], {"axis": axis, "keepdim": keepdim, **extra})


def _slice(shape, index):
    return lambda rng: ([_n(rng, *shape)], {"index": normalize_index("slice", index, shape)})


def _set_value(shape, index, vshape):
    return lambda rng: ([_n(rng, *shape), _n(rng, *vshape)],
                        {"index": normalize_index("__setitem__", index, shape)})


def _where(rng):
    c = rng.random((3, 4)) < 0.5
    return [c, _n(rng, 3, 4), _n(rng, 1, 4)], {}


def _layer_norm(shape, begin, affine=(True, True)):
    def build(rng):
        tail = shape[begin:]
        w = _n(rng, *tail) if affine[0] else None
        b = _n(rng, *tail) if affine[1] else None
        return [_n(rng, *shape), w, b], {"begin_norm_axis": begin, "epsilon": 1e-5}
    return build


def _batch_norm(shape, fmt, training, affine=True):
    def build(rng):
        c = shape[1] if fmt in ("NC", "NCL", "NCHW", "NCDHW") else shape[-1]
        w = _n(rng, c) if affine else None
        b = _n(rng, c) if affine else None
        return ([_n(rng, *shape), rng.normal(size=c) * 0.1, rng.uniform(0.5, 1.5, c), w, b],
                {"training": training, "momentum": 0.9, "epsilon": 1e-5, "data_format": fmt})
    return build


def _cross_entropy(shape, axis, keep_label):
    def build(rng):
        c = shape[axis]
        batch = shape[:axis] + shape[axis + 1:]
        lab = rng.integers(0, c, batch)
        lab.reshape(-1)[0] = -100  # one ignored row
        if keep_label:
            lab = np.expand_dims(lab, axis)
        return [_n(rng, *shape), lab.astype(np.int64)], {"axis": axis, "ignore_index": -100}
    return build


def _embedding(padding_idx):
    def build(rng):
        ids = np.array([[0, 3, 5], [3, 1, 3]], dtype=np.int64)
        return [ids, _n(rng, 6, 4)], {"padding_idx": padding_idx}
    return build


def _dropout(shape, p, mode, axis=None):
    return lambda rng: ([_n(rng, *shape)], {"p": p, "mode": mode, "seed": 1234, "axis": axis})


def _gather(shape, index, axis):
    return lambda rng: ([_n(rng, *shape), np.array(index, dtype=np.int64)], {"axis": axis})


SAMPLES: dict[str, list] = {
    "add": [_binary(), _binary(sx=(2, 3, 4), sy=(4,)), _binary(sx=(3, 1), sy=(1, 4))],
    "subtract": [_binary(), _binary(sx=(3, 4), sy=(1, 4))],
    "multiply": [_binary(), _binary(sx=(2, 1, 4), sy=(3, 1))],
    "divide": [_binary(gy=_pos), _binary(sx=(3, 4), sy=(4,), gy=_pos)],
    "pow": [_binary(gx=_pos, gy=_n), _binary(gx=_pos, gy=_n, sx=(3, 4), sy=(1,))],
    "maximum": [_minmax((3, 4), (3, 4)), _minmax((3, 4), (4,))],
    "minimum": [_minmax((3, 4), (3, 4)), _minmax((2, 3), (2, 1))],
    "neg": [_unary()],
    "abs": [_unary(_away)],
    "exp": [_unary()],
    "log": [_unary(_pos)],
    "sqrt": [_unary(_pos)],
    "rsqrt": [_unary(_pos)],
    "tanh": [_unary()],
    "sigmoid": [_unary()],
    "relu": [_unary(_away)],
    "silu": [_unary()],
    "gelu": [_unary(approximate=False), _unary(approximate=True)],
    "scale": [_unary(scale=2.5, bias=0.5, bias_after_scale=True),
              _unary(scale=-1.5, bias=1.0, bias_after_scale=False)],
    "cast": [lambda rng: ([_n(rng, 3, 4)], {"dtype": np.dtype(np.float32),
                                            "src_dtype": np.dtype(np.float64)}),
             lambda rng: ([_n(rng, 3, 4).astype(np.float32)],
                          {"dtype": np.dtype(np.float64), "src_dtype": np.dtype(np.float32)})],
    "clip": [lambda rng: ([np.array([[-2.0, -0.7, 0.1], [0.4, 0.9, 3.0]])],
                          {"min": -0.5, "max": 0.6}),
             lambda rng: ([np.array([-2.0, -0.7, 0.1, 1.3])], {"min": None, "max": 0.6})],
    "where": [_where],
    "matmul": [_matmul((3, 4), (4, 2)), _matmul((4,), (4,)), _matmul((4,), (4, 3)),
               _matmul((3, 4), (4,)), _matmul((2, 1, 3, 4), (3, 4, 2)),
               _matmul((4, 3), (4, 2), tx=True), _matmul((3, 4), (2, 4), ty=True),
               _matmul((2, 4, 3), (2, 5, 4), tx=True, ty=True), _matmul((4,), (2, 3, 4), ty=True)],
    "sum": [_reduce((3, 4), (1,), False), _reduce((2, 3, 4), (0, 2), True),
            _reduce((3, 4), (0, 1), False), _reduce((), (), False, dtype=None)],
    "max": [_reduce((3, 4), (1,), False, _distinct), _reduce((2, 3, 4), (0, 2), True, _distinct),
            _reduce((3, 4), (0, 1), False, _distinct)],
    "min": [_reduce((3, 4), (0,), True, _distinct), _reduce((2, 3, 4), (0, 1, 2), False,
                                                            _distinct)],
    "reshape": [lambda rng: ([_n(rng, 3, 4)], {"shape": (2, 6)}),
                lambda rng: ([_n(rng, 2, 3, 2)], {"shape": (12,)})],
    "transpose": [lambda rng: ([_n(rng, 2, 3, 4)], {"perm": (2, 0, 1)})],
    "slice": [_slice((4, 5), (slice(1, 3), slice(None, None, 2))),
              _slice((3, 4, 2), (1, Ellipsis, None)), _slice((5,), slice(0, 0))],
    "set_value": [_set_value((4, 5), (slice(1, 3), 2), (2,)),
                  _set_value((3, 4), (Ellipsis, slice(1, 4, 2)), (1, 2))],
    "split": [lambda rng: ([_n(rng, 5, 3)], {"sections": (2, 0, 3), "axis": 0}),
              lambda rng: ([_n(rng, 2, 6)], {"sections": (3, 3), "axis": 1}),
              lambda rng: ([_n(rng, 5, 3)], {"sections": (5,), "axis": 0})],  # chunk(x, 1)
    "concat": [lambda rng: ([_n(rng, 2, 3), _n(rng, 1, 3), _n(rng, 0, 3)], {"axis": 0}),
               lambda rng: ([_n(rng, 2, 3), _n(rng, 2, 2)], {"axis": 1})],
    "stack": [lambda rng: ([_n(rng, 2, 3), _n(rng, 2, 3)], {"axis": 1})],
    "expand": [lambda rng: ([_n(rng, 3, 1)], {"shape": (2, 3, 4)})],
    "tile": [lambda rng: ([_n(rng, 2, 3)], {"repeat_times": (2, 1, 2)})],
    "softmax": [_unary(shape=(3, 5), axis=1), _unary(shape=(4, 3, 2), axis=0)],
    "log_softmax": [_unary(shape=(3, 5), axis=1), _unary(shape=(2, 3, 4), axis=1)],
    "layer_norm": [_layer_norm((3, 4), 1), _layer_norm((2, 3, 4), 1),
                   _layer_norm((3, 5), 1, (False, False)), _layer_norm((2, 5), 1, (True, False))],
    "batch_norm": [_batch_norm((4, 3), "NC", True), _batch_norm((3, 2, 2, 2), "NCHW", True),
                   _batch_norm((2, 3, 3), "NLC", True, affine=False)],
    "batch_norm_infer": [_batch_norm((4, 3, 2), "NCL", False),
                         _batch_norm((2, 2, 2, 3), "NHWC", False)],
    "embedding": [_embedding(None), _embedding(3)],
    # (5, 1): a class axis split over ranks that one rank holds whole
    "cross_entropy": [_cross_entropy((4, 5), 1, False), _cross_entropy((3, 4), 1, True),
                      _cross_entropy((3, 4, 2), 1, True), _cross_entropy((5, 1), 1, False)],
    "cross_entropy_mean": [_cross_entropy((4, 5), 1, False), _cross_entropy((3, 4), 1, True),
                           _cross_entropy((3, 4, 2), 1, True), _cross_entropy((2, 3), 0, False),
                           _cross_entropy((5, 1), 1, False)],
    "dropout": [_dropout((4, 5), 0.5, "upscale_in_train"),
                _dropout((4, 5), 0.3, "downscale_in_infer"),
                _dropout((3, 4, 2), 0.5, "upscale_in_train", axis=(0, 2)),
                _dropout((2, 3), 1.0, "upscale_in_train")],
    "gather": [_gather((5, 3), [4, 0, 4, 2], 0), _gather((2, 4, 3), [3, 3, 1], 1)],
}

# op -> FD step and tolerances where float32 is involved on purpose
OPTIONS: dict[str, dict] = {
    "cast": {"h": 1e-3, "rtol": 1e-3, "atol": 1e-3},
}


def _merge_families() -> None:
    """Op families keep their samples in ``samples_<family>.py`` beside this file: each defines
    ``SAMPLES`` (differentiable ops) and may define ``OPTIONS`` and ``FORWARD_ONLY`` (ops the
    oracle runs without gradients); they are merged here so every test sees one registry."""
    import importlib
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    for fname in sorted(os.listdir(here)):
        if fname.startswith("samples_") and fname.endswith(".py"):
            mod = importlib.import_module(fname[:-3])
            for target, name in ((SAMPLES, "SAMPLES"), (OPTIONS, "OPTIONS"),
                                 (FORWARD_ONLY, "FORWARD_ONLY")):
                for op, value in getattr(mod, name, {}).items():
                    if op in target:
                        raise ValueError(f"{fname}: {name}[{op!r}] is defined twice")
                    target[op] = value


# forward-only samples of the families (the oracle's own list is in oracle_util.py)
FORWARD_ONLY: dict[str, list] = {}
_merge_families()
