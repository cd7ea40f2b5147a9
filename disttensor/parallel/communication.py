"""Collectives on dense tensors, with ``paddle.distributed``'s names and signatures:
``all_reduce``, ``all_gather``, ``broadcast``, ``reduce_scatter``, ``barrier`` and
``new_group``.

They take dense Tensors (numpy- or cupy-backed) or raw numpy/cupy arrays and run over the world
or a :class:`Group`. Results go into the given tensors in place (``all_reduce``, ``broadcast``,
``reduce_scatter``) or into ``tensor_list`` (``all_gather``). A rank that is not in ``group``
returns at once, as in Paddle. A distributed tensor is refused: its collectives come from
``reshard``. Raw arrays travel as they are (cupy arrays through NCCL or host-staged MPI); a
Tensor's value travels through a host copy (the runtime gives no zero-copy view of a dense
Tensor's array yet).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

import collectives

from ..autograd import no_grad
from ..ops import to_tensor
from ..tensor import Tensor

__all__ = ["ReduceOp", "Group", "new_group", "all_reduce", "all_gather", "broadcast",
           "reduce_scatter", "barrier"]


class ReduceOp:
    """Reduce operations (Paddle's ``paddle.distributed.ReduceOp``).

    Example::

        dt.all_reduce(t, op=dt.ReduceOp.MAX)
    """

    SUM = 0
    MAX = 1
    MIN = 2
    PROD = 3
    AVG = 4


_OP_NAMES = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
             ReduceOp.PROD: "prod", ReduceOp.AVG: "avg"}


class Group:
    """A set of global ranks that run collectives together (Paddle's ``Group``).

    ``ranks`` (global ranks, in group order), ``nranks``, ``rank`` (this process's rank in the
    group, -1 when it is not a member), ``process_group`` (the ``collectives`` group, None for
    non-members).

    Example::

        g = dt.new_group([0, 1])
        dt.all_reduce(t, group=g)        # only ranks 0 and 1 call it
    """

    def __init__(self, ranks: Sequence[int], process_group: Any):
        self.ranks = list(ranks)
        self.nranks = len(self.ranks)
        self.process_group = process_group
        self.rank = process_group.rank if process_group is not None else -1

    @property
    def world_size(self) -> int:
        return self.nranks

    def is_member(self) -> bool:
        return self.process_group is not None

    def get_group_rank(self, rank: int) -> int:
        """The group rank of global ``rank`` (-1 when it is not in the group)."""
        return self.ranks.index(rank) if rank in self.ranks else -1

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks}, rank={self.rank})"


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None,
              timeout: Any = None) -> Group:
    """The group of global ``ranks`` (default: every rank). Every member must call it (creating
    the group is collective over the members); other ranks may call it and get a group they are
    not in. ``backend`` and ``timeout`` are accepted for compatibility and ignored (the group
    uses the runtime's backend).

    Example::

        g = dt.new_group([0, 1])
        dt.all_reduce(t, group=g)       # only ranks 0 and 1 communicate
    """
    world = collectives.init()
    key = list(range(world.size)) if ranks is None else [r for r in ranks]
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in key):
        raise TypeError(f"new_group: ranks must be ints, got {ranks!r}")
    key = [int(r) for r in key]
    if not key or len(set(key)) != len(key) or not all(0 <= r < world.size for r in key):
        raise ValueError(f"new_group: ranks {key} must be distinct ranks of the world "
                         f"[0, {world.size})")
    me = world.ranks[world.rank]
    return Group(key, collectives.new_group(key) if me in key else None)


def _group(fn: str, group: Group | None) -> Group:
    if group is None:
        world = collectives.init()
        return Group(world.ranks, world)
    if not isinstance(group, Group):
        raise TypeError(f"{fn}: group must be a Group from new_group, got {type(group).__name__}")
    return group


def _array(fn: str, arg: str, t: Any):
    """The array to send: a raw numpy/cupy array as is, a dense Tensor's value (host copy)."""
    if isinstance(t, Tensor):
        if t.is_dist():
            raise TypeError(f"{fn}: {arg} is a distributed tensor; collectives here take dense "
                            "tensors (use reshard for distributed ones)")
        return t.numpy()
    if isinstance(t, np.ndarray) or type(t).__module__.startswith("cupy"):
        return t
    raise TypeError(f"{fn}: {arg} must be a dense Tensor or a numpy/cupy array, got "
                    f"{type(t).__name__}")


def _write(t: Any, value) -> None:
    """Put ``value`` into ``t`` in place (a Tensor keeps its identity, dtype and place)."""
    if isinstance(t, Tensor):
        with no_grad():
            t.copy_(to_tensor(value, dtype=t.dtype, place=t.place))
    else:
        t[...] = value


def _like(t: Any, value) -> Any:
    """A new object of ``t``'s kind (Tensor or array) holding ``value``."""
    return to_tensor(value, place=t.place) if isinstance(t, Tensor) else value


def _op(fn: str, op: Any) -> str:
    if op not in _OP_NAMES:
        raise ValueError(f"{fn}: op must be a ReduceOp (SUM, MAX, MIN, PROD, AVG), got {op!r}")
    return _OP_NAMES[op]


def _run(group: Group, call):
    """Issue one collective on ``group``'s process group.

    AGREEMENT CHECK: the opt-in per-call check of ``collectives`` (every rank of the group
    calls the same collective with the same op, shape and dtype) is switched on here, for every
    tensor collective of this module, once ``collectives`` takes it per call (today it is on
    for the whole job with ``DISTTENSOR_CHECK_COLLECTIVES=1``)."""
    return call(group.process_group)


def all_reduce(tensor: Any, op: int = ReduceOp.SUM, group: Group | None = None,
               sync_op: bool = True) -> None:
    """Reduce ``tensor`` elementwise over ``group`` (default: the world) with ``op``; every
    member gets the result in ``tensor`` in place. Collective: one all-reduce.

    Example::

        t = dt.to_tensor([float(dt.get_rank())])
        dt.all_reduce(t)          # t == 0 + 1 + ... + (world - 1) on every rank
    """
    g = _group("all_reduce", group)
    if not g.is_member():
        return
    x, red = _array("all_reduce", "tensor", tensor), _op("all_reduce", op)
    _write(tensor, _run(g, lambda pg: pg.all_reduce(x, red)))


def all_gather(tensor_list: list, tensor: Any, group: Group | None = None,
               sync_op: bool = True) -> None:
    """Gather every member's ``tensor`` (same shape and dtype on every rank) into
    ``tensor_list`` in group-rank order: an empty list is filled with new tensors, a list of
    ``nranks`` tensors is written in place. Collective: one all-gather.

    Example::

        out = []
        dt.all_gather(out, dt.to_tensor([dt.get_rank()]))   # out[i] == [i]
    """
    g = _group("all_gather", group)
    if not g.is_member():
        return
    if not isinstance(tensor_list, list) or len(tensor_list) not in (0, g.nranks):
        raise ValueError(f"all_gather: tensor_list must be an empty list or a list of "
                         f"{g.nranks} tensors, got {type(tensor_list).__name__} of length "
                         f"{len(tensor_list) if isinstance(tensor_list, list) else '?'}")
    x = _array("all_gather", "tensor", tensor)
    out = _run(g, lambda pg: pg.all_gather(x[None], axis=0, sizes=[1] * g.nranks))
    if tensor_list:
        for t, v in zip(tensor_list, out):
            _write(t, v)
    else:
        tensor_list.extend(_like(tensor, v.copy()) for v in out)


def broadcast(tensor: Any, src: int, group: Group | None = None, sync_op: bool = True) -> None:
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every member (same shape and
    dtype everywhere). Collective: one broadcast.

    Example::

        t = dt.to_tensor([1.0 if dt.get_rank() == 0 else 0.0])
        dt.broadcast(t, src=0)    # t == [1.0] everywhere
    """
    g = _group("broadcast", group)
    if not g.is_member():
        return
    root = g.get_group_rank(int(src))
    if root < 0:
        raise ValueError(f"broadcast: src rank {src} is not in the group {g.ranks}")
    x = _array("broadcast", "tensor", tensor)
    _write(tensor, _run(g, lambda pg: pg.broadcast(x, src=root)))


def reduce_scatter(tensor: Any, tensor_list: Sequence[Any], op: int = ReduceOp.SUM,
                   group: Group | None = None, sync_op: bool = True) -> None:
    """Reduce ``tensor_list[i]`` over the members with ``op`` and put the result in ``tensor``
    on group rank ``i`` (``tensor_list`` has ``nranks`` tensors of ``tensor``'s shape).
    Collective: one reduce-scatter.

    Example::

        parts = [dt.full([2], float(i)) for i in range(dt.get_world_size())]
        out = dt.zeros([2])
        dt.reduce_scatter(out, parts)     # out == world * rank on each rank
    """
    g = _group("reduce_scatter", group)
    if not g.is_member():
        return
    red = _op("reduce_scatter", op)
    if len(tensor_list) != g.nranks:
        raise ValueError(f"reduce_scatter: tensor_list has {len(tensor_list)} tensors, the "
                         f"group {g.nranks} ranks")
    mine = _array("reduce_scatter", "tensor", tensor)
    parts = [_array("reduce_scatter", f"tensor_list[{i}]", t) for i, t in enumerate(tensor_list)]
    for i, p in enumerate(parts):
        if tuple(p.shape) != tuple(mine.shape):
            raise ValueError(f"reduce_scatter: tensor_list[{i}] has shape {list(p.shape)}, "
                             f"tensor {list(mine.shape)}")
    xp = np if isinstance(parts[0], np.ndarray) else __import__("cupy")
    stacked = xp.stack(parts)
    out = _run(g, lambda pg: pg.reduce_scatter(stacked, red, axis=0, sizes=[1] * g.nranks))
    _write(tensor, out[0])


def barrier(group: Group | None = None) -> None:
    """Block until every member of ``group`` (default: the world) has called it.

    Example::

        dt.barrier()                       # every rank waits for the others
    """
    g = _group("barrier", group)
    if g.is_member():
        _run(g, lambda pg: pg.barrier())
