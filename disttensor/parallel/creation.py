"""``dtensor_from_fn``: build a distributed tensor piece by piece, never the global one.

Deterministic creation functions (``ones``, ``zeros``, ``full``...) are called with the piece's
shape. Random ones draw from the global generator (``dt.seed``), whose numbers depend on where
an element sits in the whole tensor; so while ``fn`` runs, the generator is replaced by a
*piece generator* that hands each draw of the whole piece's shape the exact slice of the draw
the dense call would make, and leaves the global generator where the dense call leaves it:

* uniform draws (``random``, ``uniform``: one 64-bit step per element) jump ahead to each run of
  the piece (``PCG64.advance``): time and memory of the piece only;
* other draws (``standard_normal``, ``normal``: a variable number of steps per element) replay
  the dense stream in bounded chunks and keep the piece's elements: memory of the piece plus a
  chunk, time of the whole tensor on every rank.

So ``dtensor_from_fn(dt.randn, mesh, pl, shape)`` equals ``shard_tensor(dt.randn(shape), mesh,
pl)`` for the same seed, element for element, and later draws agree too.
"""
from __future__ import annotations

from contextlib import contextmanager
from itertools import product
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from spmd_rules import DistAttr, Partial, Placement, ProcessMesh, local_slices

from ..distributed.api import dtensor_from_local
from ..layout.mesh_groups import get_rank
from ..ops import creation as _creation
from ..tensor import Tensor

__all__ = ["dtensor_from_fn"]

_CHUNK = 1 << 20          # elements per replayed chunk
_MAX_RUNS = 1 << 14       # more contiguous runs than this: replay instead of jumping
# method -> its positional parameters (``size`` among them)
_PARAMS = {"random": ("size", "dtype", "out"), "standard_normal": ("size", "dtype", "out"),
           "uniform": ("low", "high", "size"), "normal": ("loc", "scale", "size")}
_JUMPABLE = {"random", "uniform"}


def _runs(shape: tuple[int, ...], region: tuple[slice, ...]) -> tuple[list[int], int]:
    """Row-major starts of the contiguous runs of ``region`` in a tensor of ``shape``, and the
    run length."""
    full_from = len(shape)
    while full_from > 0 and region[full_from - 1] == slice(0, shape[full_from - 1]):
        full_from -= 1
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    if full_from == 0:
        return [0], int(np.prod(shape, dtype=np.int64))
    j = full_from - 1
    length = (region[j].stop - region[j].start) * strides[j]
    outer = [range(s.start, s.stop) for s in region[:j]]
    starts = [sum(i * strides[d] for d, i in enumerate(idx)) + region[j].start * strides[j]
              for idx in product(*outer)]
    return starts, length


class _PieceGenerator:
    """Stands in for the global ``numpy.random.Generator`` while ``fn`` builds one piece."""

    def __init__(self, real: np.random.Generator, shape: tuple[int, ...],
                 region: tuple[slice, ...]):
        self._real, self._shape, self._region = real, shape, region
        self._piece = tuple(s.stop - s.start for s in region)

    def __getattr__(self, method: str) -> Callable:
        if method not in _PARAMS:
            raise NotImplementedError(
                f"dtensor_from_fn: fn calls generator.{method}, which cannot be split into "
                f"pieces; supported draws: {sorted(_PARAMS)} of the piece's shape (use "
                "shard_tensor(fn(shape), ...) to build the global tensor instead)")
        return lambda *args, **kwargs: self._draw(method, list(args), kwargs)

    def _draw(self, method: str, args: list, kwargs: dict) -> np.ndarray:
        kwargs = dict(zip(_PARAMS[method], args), **kwargs)
        size = kwargs.pop("size", None)
        size = () if size is None else (tuple(size) if np.iterable(size) else (int(size),))
        if tuple(int(s) for s in size) != self._piece:
            raise ValueError(f"dtensor_from_fn: fn drew {method} of shape {list(size)} but the "
                             f"piece has shape {list(self._piece)}; only draws of the whole "
                             "piece can equal the dense call's slice")

        def call(gen: np.random.Generator, n: tuple[int, ...]) -> np.ndarray:
            return np.asarray(getattr(gen, method)(size=n, **kwargs))

        bitgen = self._real.bit_generator
        state = bitgen.state
        jump = (method in _JUMPABLE and isinstance(bitgen, np.random.PCG64)
                and not state["has_uint32"] and kwargs.get("dtype", np.float64) == np.float64)
        out = self._jump(call, state) if jump else self._replay(call)
        if jump:
            end = np.random.PCG64()
            end.state = state
            end.advance(int(np.prod(self._shape, dtype=np.int64)))
            bitgen.state = end.state
        return out

    def _jump(self, call, state: dict) -> np.ndarray:
        starts, length = _runs(self._shape, self._region)
        if len(starts) > _MAX_RUNS:
            return self._replay(call)
        bg = np.random.PCG64()
        bg.state = state
        gen, pos, parts = np.random.Generator(bg), 0, []
        for s in starts:
            bg.advance(s - pos)
            parts.append(call(gen, (length,)))
            pos = s + length
        flat = np.concatenate(parts) if parts else call(gen, (0,))
        return flat.reshape(self._piece)

    def _replay(self, call) -> np.ndarray:
        """Draw the whole tensor in chunks of leading rows from the real generator (advancing
        it exactly as the dense call) and keep the piece's elements."""
        shape, region = self._shape, self._region
        if not shape:
            return call(self._real, ())
        row = int(np.prod(shape[1:], dtype=np.int64))
        step = max(1, _CHUNK // max(row, 1))
        parts, dtype = [], None
        for r0 in range(0, shape[0], step):
            r1 = min(shape[0], r0 + step)
            block = call(self._real, (r1 - r0,) + shape[1:])
            dtype = block.dtype
            a, b = max(r0, region[0].start), min(r1, region[0].stop)
            if a < b:
                parts.append(block[(slice(a - r0, b - r0),) + region[1:]])
        if parts:
            return np.concatenate(parts, axis=0)
        if dtype is None:  # a tensor with no rows: nothing to draw, only the dtype to learn
            dtype = call(self._real, (0,)).dtype
        return np.zeros(self._piece, dtype)


@contextmanager
def _piece_generator(shape: tuple[int, ...], region: tuple[slice, ...]) -> Iterator[None]:
    """Swap the global generator (``dt.seed``'s) for a piece generator while ``fn`` runs.

    The runtime exposes no hook for this yet: it is the one place that reaches into
    ``disttensor.ops.creation.default_generator``."""
    gen = _creation.default_generator
    real = gen.rng
    gen.rng = _PieceGenerator(real, shape, region)
    try:
        yield
    finally:
        gen.rng = real


def dtensor_from_fn(fn: Callable[..., Any], mesh: ProcessMesh, placements: Sequence[Placement],
                    *args: Any, **kwargs: Any) -> Tensor:
    """A distributed tensor whose pieces ``fn`` builds, each rank only its own (Paddle's
    ``dist.dtensor_from_fn``): ``fn(shape, *rest, **kwargs)`` is a creation function taking the
    shape first (``dt.ones``, ``dt.full``, ``dt.rand``, ``dt.randn``, ``dt.uniform``, or a
    function of a shape built from them), ``args[0]`` is the GLOBAL shape, and each rank calls
    ``fn`` with its piece's shape. No rank ever holds the global tensor.

    Random draws from the global generator are made equal to the matching slice of the dense
    call with the same seed, and the generator ends where the dense call leaves it (see the
    module notes for the cost of ``randn``); a function that draws in another way raises. A
    function that is not a pure function of the shape and the generator (one that depends on
    the rank, say) gives the pieces it returns. Ranks outside ``mesh`` still call ``fn`` (with
    an empty shape) so that every rank's generator stays in step.

    Collective: one small all-gather over the mesh (``dtensor_from_local``'s shape check).

    Example::

        dt.seed(0)
        w = dt.dtensor_from_fn(dt.randn, mesh, [dt.Replicate(), dt.Shard(1)], [1024, 4096])
        # equals dt.shard_tensor(dt.randn([1024, 4096]), mesh, ...) after dt.seed(0)
    """
    fname = "dtensor_from_fn"
    if not callable(fn):
        raise TypeError(f"{fname}: fn must be callable, got {type(fn).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{fname}: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    if not args:
        raise TypeError(f"{fname}: pass the global shape after placements: "
                        "dtensor_from_fn(fn, mesh, placements, shape, ...)")
    shape_arg = args[0]
    shape_arg = [shape_arg] if isinstance(shape_arg, (int, np.integer)) else shape_arg
    shape = tuple(int(s) for s in shape_arg)
    placements = list(placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{fname}: placements {placements} contain Partial; a created tensor "
                         "is a value, not per-rank addends")
    try:
        attr = DistAttr.from_placements(placements, len(shape), mesh.shape)
    except ValueError as e:
        raise ValueError(f"{fname}: shape {list(shape)}: {e}") from None
    coord = mesh.get_coord(get_rank())
    region = tuple(slice(0, 0) for _ in shape) if coord is None else \
        tuple(slice(int(s.start), int(s.stop)) for s in local_slices(shape, attr, coord))
    piece = [s.stop - s.start for s in region]
    with _piece_generator(shape, region):
        local = fn(piece, *args[1:], **kwargs)
    if isinstance(local, Tensor) and local.is_dist():
        raise TypeError(f"{fname}: fn returned a distributed tensor; it must build a dense piece")
    if list(np.shape(local) if not isinstance(local, Tensor) else local.shape) != piece:
        raise ValueError(f"{fname}: fn returned shape "
                         f"{list(local.shape if isinstance(local, Tensor) else np.shape(local))}"
                         f" for a piece of shape {piece}")
    return dtensor_from_local(local, mesh, placements, shape=shape)
