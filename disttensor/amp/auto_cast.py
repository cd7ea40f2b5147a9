"""``auto_cast``: mixed precision as a dispatch-level policy.

Inside ``with dt.amp.auto_cast(...)`` every op call passes the policy before it runs
(:func:`disttensor.dispatch.set_amp_policy`). The op's ``amp`` class in the schema
(:data:`disttensor.schema.AMP_CLASSES`, or ``custom_white_list``/``custom_black_list``) decides:

* ``"white"`` (matmul, linear, attention, conv): float32 inputs are cast to the low dtype;
* ``"black"`` (softmax, layer_norm/rms_norm, cross entropy, reductions, exp/log/pow):
  float16/bfloat16 inputs are cast to float32;
* ``"promote"`` (concat, stack): floating inputs are cast to the widest of them;
* unlisted ops run as called (level O1); at level O2 an unlisted op given both low-precision
  and float32 inputs runs in the low dtype (the parameters are already low: ``decorate``).

On a mesh a white op runs in float32 on inputs rounded to the low dtype and its result is
rounded once: the rounding cast reduces a Partial result first, and in backward the gradients'
Partial pieces alike, so each value is rounded where the dense run rounds it (leaves held
Partial by ``no_sync`` or ZeRO-2 keep per-rank rounding).

Casts are ordinary ``cast`` ops (recorded by autograd, seen by capture and the memory plan).
Backward runs without the policy: each gradient op runs in the dtypes its forward saw, and a
cast's gradient casts back. Inputs an op updates in place (batch_norm's running statistics)
are never cast.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import numpy as np

from ..dispatch import apply, set_amp_policy
from ..dtype import LOW_PRECISION, float32, is_floating, to_np_dtype
from ..grad_sync import keeps_partial_grad
from ..ops.elementwise import cast
from ..schema import OpDef
from ..tape import _GradMode
from ..tensor import Tensor

__all__ = ["auto_cast", "amp_guard", "low_precision_dtype", "is_float16_supported",
           "is_bfloat16_supported", "set_round_after_reduction"]

LEVELS = ("O0", "O1", "O2")


def low_precision_dtype(dtype: Any, where: str) -> np.dtype:
    """``dtype`` ("float16" or "bfloat16") as a numpy dtype; anything else raises naming
    ``where``."""
    try:
        d = to_np_dtype(dtype)
    except TypeError:
        d = None
    if d not in LOW_PRECISION:
        raise ValueError(f"{where}: argument 'dtype' must be 'float16' or 'bfloat16', got "
                         f"{dtype!r}")
    return d


def check_level(level: Any, where: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"{where}: argument 'level' must be one of {list(LEVELS)}, got "
                         f"{level!r}")
    return level


def _op_names(names: Iterable[str] | None, arg: str) -> frozenset:
    if names is None:
        return frozenset()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"auto_cast: argument '{arg}' must be a list or set of op names, got "
                        f"{names!r}")
    return frozenset(names)


class _Policy:
    """The cast decision of one ``auto_cast`` block (see the module docstring)."""

    def __init__(self, level: str, low: np.dtype, white: frozenset, black: frozenset):
        self.level, self.low = level, low
        self.classes = {**dict.fromkeys(white, "white"), **dict.fromkeys(black, "black")}

    def __call__(self, op: OpDef, inputs: tuple, attrs: dict) -> Any:
        if _GradMode.backward_depth or op.name == "cast":
            return inputs
        cls = self.classes.get(op.name, op.amp)
        floats = [t is not None and is_floating(t.dtype) for t in inputs]
        if cls == "white":
            if _sums_over_ranks(op, inputs, floats):
                return self._round_after_reduction(op, inputs, attrs, floats)
            return self._cast(op, inputs, floats, lambda d: d == float32, self.low)
        if cls == "black":
            return self._cast(op, inputs, floats, lambda d: d in LOW_PRECISION, float32)
        dtypes = {np.dtype(t.dtype) for t, f in zip(inputs, floats) if f}
        if len(dtypes) < 2:
            return inputs
        if cls == "promote":
            widest = max(dtypes, key=lambda d: (d.itemsize, d == float32))
            return self._cast(op, inputs, floats, lambda d: d != widest, widest)
        if self.level == "O2" and self.low in dtypes and float32 in dtypes:
            return self._cast(op, inputs, floats, lambda d: d == float32, self.low)
        return inputs

    def _round_after_reduction(self, op: OpDef, inputs: tuple, attrs: dict,
                               floats: list) -> Tensor:
        """A white op on a mesh: the op runs in float32 on inputs rounded to the low dtype,
        and its result is rounded once, after any Partial sum is reduced (the rounding cast
        reduces first); in backward the gradients the op hands its inputs are likewise
        rounded after their reduction. Each value is then the one the dense run rounds."""
        low = tuple(cast(t, self.low) if f and np.dtype(t.dtype) == float32 else t
                    for t, f in zip(inputs, floats))
        wide = tuple(cast(t, float32) if f else t for t, f in zip(low, floats))
        prev = set_amp_policy(None)
        try:
            out = apply(op, wide, attrs)
        finally:
            set_amp_policy(prev)
        return cast(out, self.low)

    @staticmethod
    def _cast(op: OpDef, inputs: tuple, floats: list, which, to: np.dtype) -> tuple:
        mutated = {i for i, _ in op.mutates}
        return tuple(cast(t, to) if f and i not in mutated and which(np.dtype(t.dtype)) else t
                     for i, (t, f) in enumerate(zip(inputs, floats)))


_ROUND_ONCE = [False]


def set_round_after_reduction(enable: bool) -> bool:
    """Whether a white op on a mesh rounds its Partial sums once, after the float32 reduction
    (True: the dense run's values, at about twice the step time on a mesh) or on each rank
    before it (False, the default, as PyTorch's DDP with autocast: no float32 saved inputs,
    weight gradients synced in the overlapped buckets). Returns the previous setting.

    Example::

        dt.amp.set_round_after_reduction(True)   # a mesh run rounds where the dense run does
    """
    prev, _ROUND_ONCE[0] = _ROUND_ONCE[0], bool(enable)
    return prev


def _sums_over_ranks(op: OpDef, inputs: tuple, floats: list) -> bool:
    """Whether a white op runs on a mesh (its result or its gradients may be Partial sums over
    ranks) with float32 or low-precision inputs only, none updated in place, none a leaf whose
    gradient skips or reshapes the data-parallel sync (``no_sync``, ZeRO-2: their partial
    gradients stay per rank, rounded there)."""
    if op.n_out != 1 or op.mutates or not _ROUND_ONCE[0]:
        return False
    dist = False
    for t, f in zip(inputs, floats):
        if t is None:
            continue
        if f and np.dtype(t.dtype) not in (float32, *LOW_PRECISION):
            return False
        if t.is_dist():
            dist = True
            if t._node is None and not t.stop_gradient and keeps_partial_grad(t):
                return False
    return dist


@contextlib.contextmanager
def auto_cast(enable: bool = True, custom_white_list: Iterable[str] | None = None,
              custom_black_list: Iterable[str] | None = None, level: str = "O1",
              dtype: str = "float16", use_promote: bool = True) -> Iterator[None]:
    """Run the ops of the block in mixed precision (Paddle's ``paddle.amp.auto_cast``).

    ``level`` "O1": white-list ops in ``dtype`` ("float16" or "bfloat16"), black-list ops in
    float32, the rest as called; "O2": also unlisted ops given mixed inputs in ``dtype`` (use
    with :func:`decorate`); "O0" or ``enable=False``: no casts. ``custom_white_list`` /
    ``custom_black_list`` move op names between the lists. ``use_promote`` is accepted for
    Paddle's signature (promotion always applies). Blocks nest; the innermost decides.

    Example::

        with dt.amp.auto_cast(dtype="bfloat16"):
            y = model(x)              # matmuls in bfloat16, softmax/layer_norm in float32
        loss = F.cross_entropy(y, label)
    """
    check_level(level, "auto_cast")
    low = low_precision_dtype(dtype, "auto_cast")
    white = _op_names(custom_white_list, "custom_white_list")
    black = _op_names(custom_black_list, "custom_black_list")
    both = sorted(white & black)
    if both:
        raise ValueError(f"auto_cast: ops {both} are in both custom_white_list and "
                         f"custom_black_list")
    policy = _Policy(level, low, white, black) if enable and level != "O0" else None
    prev = set_amp_policy(policy)
    try:
        yield
    finally:
        set_amp_policy(prev)


#: Paddle's older name
amp_guard = auto_cast


def _device(device: str | None, where: str) -> str:
    place = "cpu" if device is None else str(device).replace("cuda", "gpu", 1)
    if place != "cpu" and not place.startswith("gpu"):
        raise ValueError(f"{where}: argument 'device' must be 'cpu', 'gpu' or 'gpu:N', got "
                         f"{device!r}")
    return place


def is_float16_supported(device: str | None = None) -> bool:
    """Whether float16 tensors run on ``device`` ("cpu" by default, "gpu[:N]"): always."""
    _device(device, "is_float16_supported")
    return True


def is_bfloat16_supported(device: str | None = None) -> bool:
    """Whether bfloat16 tensors run on ``device``: on the CPU (ml_dtypes), not on a GPU (cupy
    has no bfloat16 type)."""
    return _device(device, "is_bfloat16_supported") == "cpu"
