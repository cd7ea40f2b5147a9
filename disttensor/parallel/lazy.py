"""``LazyGuard``: build a model without allocating its parameters (Paddle's ``LazyGuard``; the
meta device of PyTorch users).

Inside the guard, ``create_parameter`` (every layer's weights) returns a *lazy* parameter: the
right name, shape and dtype over a zero-byte placeholder (a broadcast NaN, so a use before
materialization shows as NaN, never as plausible numbers), plus a record of its initializer and
of the global generator's state at that moment. The generator is advanced as the dense sample
would advance it, without drawing the tensor (a jump for uniform draws; a chunked replay that
keeps nothing for normal ones), so the parameters and every later draw equal a run without the
guard.

A lazy parameter is materialized piece by piece when it is placed: ``parallelize``,
``shard_layer`` (also when its ``shard_fn`` calls ``shard_tensor`` on it) and
``dtensor_from_lazy`` sample only this rank's piece, with the same values the dense
initializer gives that slice. ``param.initialize()`` materializes an unplaced one whole.
The placeholder is the one tensor value made outside the dispatch seam: it has no buffer.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from spmd_rules import DistAttr, Placement, ProcessMesh, local_slices

from ..autograd import no_grad
from ..distributed.api import dtensor_from_local
from ..layout.mesh_groups import get_rank
from ..nn import layer as _layer
from ..nn.initializer import Constant, Initializer
from ..nn.layer import Parameter
from ..ops import creation as _creation
from ..ops import to_tensor
from ..tensor import DenseTensor, Tensor
from .creation import _PARAMS, _PieceGenerator

__all__ = ["LazyGuard", "is_lazy", "materialize", "initialize"]


class _Record:
    __slots__ = ("ref", "init", "shape", "dtype", "state")

    def __init__(self, param, init, shape, dtype, state):
        self.ref = weakref.ref(param, lambda _r, k=id(param): _LAZY.pop(k, None))
        self.init, self.shape, self.dtype, self.state = init, shape, dtype, state


_LAZY: dict[int, _Record] = {}   # id(lazy parameter) -> its record


class _WholeShapeDraws:
    """Hands ``init.sample``'s draws of the whole ``shape`` to a piece generator as draws of
    the piece (initializers need the whole shape for their fans)."""

    def __init__(self, pieces: _PieceGenerator, shape: tuple[int, ...], piece: tuple[int, ...]):
        self._pieces, self._shape, self._piece = pieces, shape, piece

    def __getattr__(self, method: str) -> Callable:
        draw = getattr(self._pieces, method)  # unsupported draws raise here

        def call(*args, **kwargs):
            kw = dict(zip(_PARAMS[method], args), **kwargs)
            size = kw.get("size")
            if size is not None and tuple(np.atleast_1d(size)) == self._shape:
                kw["size"] = self._piece
            return draw(**kw)
        return call


@contextmanager
def _drawing_piece(real: np.random.Generator, shape: tuple[int, ...],
                   region: tuple[slice, ...]) -> Iterator[None]:
    gen = _creation.default_generator
    saved = gen.rng
    piece = tuple(s.stop - s.start for s in region)
    gen.rng = _WholeShapeDraws(_PieceGenerator(real, shape, region), shape, piece)
    try:
        yield
    finally:
        gen.rng = saved


def _sample(rec: _Record, region: tuple[slice, ...]) -> np.ndarray:
    """The initializer's values of ``region`` (those the dense sample has there)."""
    piece = tuple(s.stop - s.start for s in region)
    if isinstance(rec.init, Constant):
        return np.full(piece, rec.init.value, dtype=rec.dtype)
    bg = np.random.PCG64()
    bg.state = rec.state
    with _drawing_piece(np.random.Generator(bg), rec.shape, region):
        return np.asarray(rec.init.sample(rec.shape, rec.dtype), dtype=rec.dtype)


def _make_lazy(shape: tuple[int, ...], dtype: np.dtype, init: Initializer, name: str,
               trainable: bool, learning_rate: float) -> Parameter:
    placeholder = np.broadcast_to(np.array(np.nan if dtype.kind == "f" else 0, dtype=dtype),
                                  shape)
    param = Parameter(DenseTensor(placeholder), name, trainable, learning_rate)
    gen = _creation.default_generator.rng
    state = gen.bit_generator.state
    if not isinstance(init, Constant):  # advance the generator past this sample
        with _drawing_piece(gen, shape, tuple(slice(0, 0) for _ in shape)):
            init.sample(shape, dtype)
    _LAZY[id(param)] = _Record(param, init, shape, dtype, state)
    return param


class LazyGuard:
    """Inside ``with dt.LazyGuard():`` layers create lazy parameters (no memory for values);
    ``parallelize``/``shard_layer`` materialize each rank's pieces, ``p.initialize()`` a whole
    one. Values equal a model built without the guard from the same seed.

    Example::

        with dt.LazyGuard():
            model = MyModel()            # nothing allocated
        model, opt = dt.parallelize(model, opt, mesh, config)   # pieces sampled here
    """

    def __enter__(self) -> "LazyGuard":
        _layer.lazy_parameter_factory.append(_make_lazy)
        return self

    def __exit__(self, *exc: Any) -> None:
        _layer.lazy_parameter_factory.remove(_make_lazy)


def is_lazy(t: Tensor) -> bool:
    """True for a parameter made under :class:`LazyGuard` and not materialized yet."""
    rec = _LAZY.get(id(t))
    return rec is not None and rec.ref() is t


def _region(shape, mesh: ProcessMesh, attr: DistAttr) -> tuple[slice, ...]:
    coord = mesh.get_coord(get_rank())
    if coord is None:
        return tuple(slice(0, 0) for _ in shape)
    return tuple(slice(int(s.start), int(s.stop)) for s in local_slices(shape, attr, coord))


def materialize(param: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> Parameter:
    """A new distributed Parameter laid out as ``placements`` on ``mesh`` whose pieces are
    sampled from lazy ``param``'s initializer (this rank's piece only). Collective: one small
    all-gather of piece shapes (``dtensor_from_local``)."""
    rec = _LAZY[id(param)]
    attr = DistAttr.from_placements(list(placements), len(rec.shape), mesh.shape)
    with no_grad():
        t = dtensor_from_local(_sample(rec, _region(rec.shape, mesh, attr)), mesh,
                               list(placements), shape=rec.shape)
    new = Parameter(t._value, name=param.name, trainable=not param.stop_gradient)
    new.optimize_attr = dict(param.optimize_attr)
    return new


def fill_placed(lazy: Tensor, placed: Tensor) -> None:
    """Write lazy ``lazy``'s sampled values into ``placed``, a distributed tensor made from it
    by ``shard_tensor`` (which sliced the placeholder): this rank's piece only, no
    communication beyond ``dtensor_from_local``'s shape check."""
    rec = _LAZY[id(lazy)]
    v = placed._value
    with no_grad():
        placed.copy_(dtensor_from_local(_sample(rec, _region(rec.shape, v.mesh, v.dist_attr)),
                                        v.mesh, placed.placements, shape=rec.shape))


def initialize(self: Tensor) -> Tensor:
    """``param.initialize()``: sample a lazy parameter's whole value in place (the same Tensor
    object); a materialized or ordinary tensor is left as it is.

    Example::

        with dt.LazyGuard():
            layer = dt.nn.Linear(8, 8)
        layer.weight.initialize()   # sampled now, whole
    """
    if is_lazy(self) and not self.is_dist():
        rec = _LAZY.pop(id(self))
        full = tuple(slice(0, n) for n in rec.shape)
        self._value = to_tensor(_sample(rec, full), dtype=rec.dtype)._value
    return self
