"""Dropout with a counter-based mask. Rule: ``elementwise`` (the mask is laid out like x).

The keep-mask is a pure function of (seed, global linear index of the element): a splitmix64
hash of ``key(seed) + (index + 1) * golden`` turned into a uniform in [0, 1) and compared with
``p``. The kernel builds the global indices of its piece from ``ctx.offset``/``ctx.global_shape``,
so a distributed dropout draws exactly the dense mask for the same seed, whatever the placements.
Without an explicit seed the kernel draws one from the global generator when it runs (a rank
outside the mesh draws too), so a replayed program advances the generator as eager mode does.
"""
from __future__ import annotations

import numpy as np

from ..dispatch import apply
from ..dtype import is_floating
from ..generator import default_generator
from ..schema import OPS, public, register, same_dtype
from ..tensor import Tensor
from .common import as_tensor, normalize_axes
from .elementwise import assign, multiply, scale

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_MODES = ("upscale_in_train", "downscale_in_infer")


def _splitmix_int(z: int) -> int:
    """splitmix64 of a Python int (used to turn the seed into a key)."""
    z = (z + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def _mix(z):
    """The splitmix64 finalizer on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
    return z ^ (z >> np.uint64(31))


def keep_mask(xp, seed: int, p: float, local_shape, global_shape, offsets):
    """Bool keep-mask (``uniform >= p``) of a piece of ``local_shape`` starting at ``offsets`` in a
    tensor of ``global_shape``, from the global row-major index of each element."""
    return xp.broadcast_to(uniforms(xp, seed, local_shape, global_shape, offsets) >= p,
                           tuple(local_shape))


def uniforms(xp, seed: int, local_shape, global_shape, offsets):
    """float64 uniforms in [0, 1) of a piece of ``local_shape`` starting at ``offsets`` in a
    tensor of ``global_shape``: a hash of (seed, the global row-major index of each element), so
    any piece of the same tensor draws the same values where it overlaps."""
    ndim = len(local_shape)
    lin = xp.zeros((), dtype=xp.uint64)
    stride = 1
    for d in reversed(range(ndim)):
        idx = (xp.arange(local_shape[d], dtype=xp.uint64) + np.uint64(offsets[d])) \
            * np.uint64(stride & _M64)
        lin = lin + idx.reshape([-1 if i == d else 1 for i in range(ndim)])
        stride *= int(global_shape[d])
    z = (lin + np.uint64(1)) * np.uint64(_GOLDEN) + np.uint64(_splitmix_int(seed))
    return (_mix(z) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _dropout_kernel(xp, x, p, mode, seed, axis, ctx):
    """(out, mask): mask (x's dtype, 0/1) is drawn per element, or per index of ``axis`` and
    broadcast over the other axes; ``seed`` None draws one from the global generator."""
    if seed is None:
        seed = default_generator.next_seed()
    gshape = ctx.global_shape(0, x.shape)
    axes = range(x.ndim) if axis is None else axis
    mshape = [n if d in axes else 1 for d, n in enumerate(x.shape)]
    gmshape = [n if d in axes else 1 for d, n in enumerate(gshape)]
    offs = [ctx.offset(0, d) if d in axes else 0 for d in range(x.ndim)]
    keep = xp.broadcast_to(keep_mask(xp, seed, p, mshape, gmshape, offs), x.shape)
    mask = keep.astype(x.dtype)
    if mode == "upscale_in_train" and p < 1.0:
        out = xp.where(keep, x * (1.0 / (1.0 - p)), 0).astype(x.dtype, copy=False)
    else:
        out = xp.where(keep, x, 0).astype(x.dtype, copy=False)
    return out, mask


def _dropout_bwd(node, g, _):
    p = node.attrs["p"]
    gx = multiply(g, node.saved_tensor(0))
    if node.attrs["mode"] == "upscale_in_train" and p < 1.0:
        gx = scale(gx, 1.0 / (1.0 - p))
    return gx


register("dropout", _dropout_kernel, backward=_dropout_bwd, rule="elementwise", n_out=2,
         save_outputs=(1,), nondiff_outputs=frozenset({1}), needs_ctx=True, random=True,
         no_need_buffer=(0,), dtype=same_dtype(0, n_out=2), rule_attrs={"num_outputs": 2})


@public()
def dropout(x: Tensor, p: float = 0.5, axis: int | list[int] | None = None,
            training: bool = True, mode: str = "upscale_in_train", name: str | None = None,
            seed: int | None = None) -> Tensor:
    """Zero each element (or each index of ``axis``) with probability ``p`` (Paddle
    ``F.dropout``).

    ``upscale_in_train``: kept values are scaled by ``1 / (1 - p)`` in training, identity in
    inference. ``downscale_in_infer``: no scaling in training, ``x * (1 - p)`` in inference.
    ``seed`` defaults to a draw from the global generator (``dt.seed``); the same seed gives the
    same mask, dense or distributed. p = 0 or inference returns a copy; p = 1 gives zeros.
    """
    x = as_tensor(x)
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating, np.integer)) \
            or not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"dropout: p must be a number in [0, 1], got {p!r}")
    if mode not in _MODES:
        raise ValueError(f"dropout: mode must be one of {list(_MODES)}, got {mode!r}")
    if not is_floating(x.dtype):
        raise TypeError(f"dropout: x must be floating, got {np.dtype(x.dtype).name}")
    axes = None if axis is None else normalize_axes("dropout", axis, x.ndim)
    p = float(p)
    if not training:
        return assign(x) if mode == "upscale_in_train" else scale(x, 1.0 - p)
    if p == 0.0:
        return assign(x)
    attrs = {"p": p, "mode": mode, "seed": None if seed is None else int(seed) & _M64,
             "axis": axes}
    return apply(OPS["dropout"], (x,), attrs)[0]
