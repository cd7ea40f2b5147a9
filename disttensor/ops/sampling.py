"""multinomial: category samples per row (rule ``along_axes`` on the category axis: a row is
always whole on a rank, rows keep their shards).

The draws are a hash of (seed, global row, column) (:func:`~disttensor.ops.random.uniforms`),
so a row draws the same samples whatever the placement; without an explicit seed the kernel
draws one from the global generator when it runs (``dt.seed`` fixes it). With replacement a
row's uniforms are looked up in its normalised cumulative sums; without, the ``num_samples``
smallest keys ``-log(1 - u) / p`` are taken (exponential races: each draw picks a remaining
category with probability proportional to its weight)."""
from __future__ import annotations

import numpy as np

from ..dispatch import apply
from ..generator import default_generator
from ..schema import OPS, fixed_dtype, public, register
from ..tensor import Tensor
from .common import as_tensor
from .random import uniforms

_WHY = {1: "has a negative, NaN or infinite probability",
        2: "has a row of all-zero probabilities",
        3: "has a row with fewer non-zero probabilities than num_samples (replacement=False)"}


def _check_rows(xp, x, num_samples: int, replacement: bool, ctx) -> None:
    """Raise on every rank of the op when a row is invalid: the worst code of this piece is
    max-reduced over the ranks holding other rows (none when rows are not sharded)."""
    code = 0
    if x.size:
        if not bool(xp.all(xp.isfinite(x) & (x >= 0))):
            code = 1
        else:
            nonzero = (x > 0).sum(axis=-1)
            if bool((nonzero == 0).any()):
                code = 2
            elif not replacement and bool((nonzero < num_samples).any()):
                code = 3
    flag = ctx.allreduce(xp.full(1, code, dtype=np.int64), "max", 0, tuple(range(x.ndim)))
    code = int(flag[0])
    if code:
        raise ValueError(f"multinomial: x of shape {list(ctx.global_shape(0, x.shape))} "
                         f"{_WHY[code]}")


def _multinomial_kernel(xp, x, axis, num_samples, replacement, seed, ctx):
    if seed is None:
        seed = default_generator.next_seed()
    _check_rows(xp, x, num_samples, replacement, ctx)
    rows = x.reshape(-1, x.shape[-1])
    row0 = ctx.offset(0, 0) if x.ndim == 2 else 0
    n_rows = ctx.global_shape(0, x.shape)[0] if x.ndim == 2 else 1
    p = rows.astype(np.float64)
    if replacement:
        u = uniforms(xp, seed, (rows.shape[0], num_samples), (n_rows, num_samples), (row0, 0))
        cdf = xp.cumsum(p, axis=1)
        cdf /= cdf[:, -1:]
        out = (u[:, :, None] >= cdf[:, None, :]).sum(axis=2)
    else:
        u = uniforms(xp, seed, rows.shape, (n_rows, rows.shape[1]), (row0, 0))
        with np.errstate(divide="ignore"):
            keys = -xp.log1p(-u) / p
        kw = {"kind": "stable"} if xp is np else {}
        out = xp.argsort(keys, axis=1, **kw)[:, :num_samples]
    return out.astype(np.int64).reshape(x.shape[:-1] + (num_samples,))


register("multinomial", _multinomial_kernel, rule="along_axes", needs_ctx=True, random=True,
         dtype=fixed_dtype(np.int64),
         rule_attrs=lambda a: {"out_size": a["num_samples"]})


@public(methods=True)
def multinomial(x: Tensor, num_samples: int = 1, replacement: bool = False,
                name: str | None = None) -> Tensor:
    """int64 category indices drawn from the rows of ``x`` (1-d or 2-d non-negative weights,
    normalised per row): shape ``[num_samples]`` or ``[rows, num_samples]``. Seeded by
    ``dt.seed``; the same seed gives the same samples dense or distributed.
    Example: ``next_id = dt.multinomial(dt.softmax(logits, -1), 1)``."""
    x = as_tensor(x)
    if x.ndim not in (1, 2):
        raise ValueError(f"multinomial: x must be 1-d or 2-d, got shape {x.shape}")
    if np.dtype(x.dtype).kind != "f":
        raise TypeError(f"multinomial: x must be floating, got {np.dtype(x.dtype).name}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) \
            or num_samples < 1:
        raise ValueError(f"multinomial: num_samples must be a positive int, got "
                         f"{num_samples!r}")
    if not replacement and num_samples > x.shape[-1]:
        raise ValueError(f"multinomial: num_samples={num_samples} exceeds the {x.shape[-1]} "
                         f"categories of x (shape {x.shape}) without replacement")
    return apply(OPS["multinomial"], (x,), {"axis": x.ndim - 1, "num_samples": int(num_samples),
                                            "replacement": bool(replacement), "seed": None})
