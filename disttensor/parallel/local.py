"""Plain per-rank code on local pieces: :func:`local_map` and :class:`LocalLayer`.

Distributed inputs enter the code as their local pieces (``dtensor_to_local``) and the code's
tensor results leave as distributed tensors with declared placements (``dtensor_from_local``).
Both conversions are differentiable, so gradients flow through the per-rank code to the
distributed inputs.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

import collectives
from spmd_rules import Placement, ProcessMesh

from ..distributed.api import dtensor_from_local, dtensor_to_local, reshard
from ..layout.mesh_groups import get_rank
from ..nn.layer import Layer
from ..tensor import Tensor

__all__ = ["local_map", "LocalLayer"]


def _same_placements(a: Sequence[Placement], b: Sequence[Placement]) -> bool:
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def _to_local(fn: str, args: Sequence[Any], in_placements: Sequence | None,
              mesh: ProcessMesh | None, reshard_inputs: bool) -> tuple[list, ProcessMesh | None]:
    """The local pieces of the distributed args (others unchanged) and the mesh they share."""
    if in_placements is not None and len(in_placements) != len(args):
        raise ValueError(f"{fn}: {len(in_placements)} in_placements for {len(args)} inputs")
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.is_dist():
            if mesh is None:
                mesh = a.process_mesh
            elif a.process_mesh != mesh:
                raise ValueError(f"{fn}: input {i} is on {a.process_mesh}, another input (or "
                                 f"process_mesh) on {mesh}; all must share one mesh")
    out = []
    for i, a in enumerate(args):
        want = None if in_placements is None else in_placements[i]
        if not (isinstance(a, Tensor) and a.is_dist()):
            if want is not None:
                raise ValueError(f"{fn}: input {i} is not a distributed tensor but "
                                 f"in_placements[{i}] is {want}")
            out.append(a)
            continue
        if want is not None and not _same_placements(a.placements, want):
            if not reshard_inputs:
                raise ValueError(f"{fn}: input {i} is laid out as {a.placements} but "
                                 f"in_placements[{i}] asks for {list(want)} (pass "
                                 "reshard_inputs=True to reshard it)")
            a = reshard(a, mesh, want)
        out.append(dtensor_to_local(a))
    return out, mesh


def _from_local(fn: str, result: Any, out_placements: Sequence, mesh: ProcessMesh | None) -> Any:
    """``result`` (one value or a tuple/list) with each tensor made distributed."""
    single = not isinstance(result, (tuple, list))
    outs = [result] if single else list(result)
    if len(outs) != len(out_placements):
        raise ValueError(f"{fn}: the function returned {len(outs)} output(s) but "
                         f"{len(out_placements)} out_placements were given")
    wrapped = []
    for i, (o, pl) in enumerate(zip(outs, out_placements)):
        if pl is None:
            wrapped.append(o)
            continue
        if not isinstance(o, Tensor) or o.is_dist():
            got = "a distributed tensor" if isinstance(o, Tensor) else type(o).__name__
            raise TypeError(f"{fn}: output {i} must be a dense Tensor to take placements {pl}, "
                            f"got {got}")
        if mesh is None:
            raise ValueError(f"{fn}: no input is distributed, so pass process_mesh to place "
                             f"output {i} as {pl}")
        wrapped.append(_place_output(o, mesh, pl))
    return wrapped[0] if single else type(result)(wrapped)


_MAX_NDIM = 16


def _place_output(local: Tensor, mesh: ProcessMesh, placements: Sequence[Placement]) -> Tensor:
    """``dtensor_from_local`` of one output. When the mesh does not span the world, the ranks
    outside it (which ran the code on empty pieces) learn the global shape from the mesh's
    first rank: one small broadcast over the world."""
    world = collectives.init()
    if len(mesh.process_ids) == world.size:
        return dtensor_from_local(local, mesh, placements)
    member = mesh.get_coord(get_rank()) is not None
    out = dtensor_from_local(local, mesh, placements) if member else None
    meta = np.full(1 + _MAX_NDIM, -1, np.int64)
    if member:
        meta[0] = out.ndim
        meta[1:1 + out.ndim] = out.shape
    meta = world.broadcast(meta, src=mesh.process_ids[0])
    if member:
        return out
    return dtensor_from_local(local, mesh, placements, shape=meta[1:1 + int(meta[0])].tolist())


def local_map(func: Callable[..., Any], out_placements: Sequence[Sequence[Placement] | None],
              in_placements: Sequence[Sequence[Placement] | None] | None = None,
              process_mesh: ProcessMesh | None = None,
              reshard_inputs: bool = False) -> Callable[..., Any]:
    """Wrap ``func``, written for dense tensors, to run on the local pieces of distributed
    inputs (Paddle's ``dist.local_map``).

    The wrapper passes each distributed positional input as its local piece (keyword arguments
    and dense inputs unchanged), calls ``func``, and turns output ``i`` into a distributed
    tensor on the inputs' mesh (or ``process_mesh``) with ``out_placements[i]`` (None: returned
    as is; a Partial placement sums the per-rank results). Ranks outside the mesh run ``func``
    on empty pieces and get empty pieces of the outputs. ``in_placements[i]``, when given, is
    the layout input ``i`` must have: a different one raises, or is resharded with
    ``reshard_inputs=True``. Without distributed inputs and without ``process_mesh`` the call
    is plain ``func``. Differentiable. Collective: one small all-gather per distributed output
    (``dtensor_from_local``'s shape check; plus a small broadcast over the world when the mesh
    does not span it), and any reshard of inputs.

    Example::

        def masked_sum(x):                  # per-rank code on the local rows
            return (x * (x > 0).astype(x.dtype)).sum()
        f = dt.local_map(masked_sum, out_placements=[[dt.Partial()]])
        total = f(x)                        # x: [n, d] as [Shard(0)]; total = global sum
    """
    if not callable(func):
        raise TypeError(f"local_map: func must be callable, got {type(func).__name__}")
    if not isinstance(out_placements, (list, tuple)):
        raise TypeError("local_map: out_placements must be a list with one entry (a list of "
                        "placements, or None) per output")

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fn = f"local_map({getattr(func, '__name__', 'func')})"
        local_args, mesh = _to_local(fn, args, in_placements, process_mesh, reshard_inputs)
        if mesh is None:
            return func(*args, **kwargs)
        return _from_local(fn, func(*local_args, **kwargs), out_placements, mesh)

    return wrapped


class LocalLayer(Layer):
    """A Layer whose ``forward`` runs on local pieces (Paddle's ``dist.LocalLayer``).

    Calling it passes each distributed positional input as its local piece, runs the hooks and
    ``forward`` as for any Layer, and turns output ``i`` into a distributed tensor laid out as
    ``out_dist_attrs[i] = (mesh, placements)`` (None: returned as is). Differentiable; see
    :func:`local_map` for the rules and the communication.

    Example::

        class LocalLoss(dt.LocalLayer):
            def __init__(self, mesh):
                super().__init__([(mesh, [dt.Partial()])])
            def forward(self, x):
                return (x * x).sum()        # this rank's partial sum
    """

    def __init__(self, out_dist_attrs: Sequence[tuple[ProcessMesh, Sequence[Placement]] | None]):
        super().__init__()
        attrs = list(out_dist_attrs)
        for i, a in enumerate(attrs):
            if a is not None and (not isinstance(a, (tuple, list)) or len(a) != 2
                                  or not isinstance(a[0], ProcessMesh)):
                raise TypeError(f"LocalLayer: out_dist_attrs[{i}] must be (ProcessMesh, "
                                f"placements) or None, got {a!r}")
        object.__setattr__(self, "out_dist_attrs", attrs)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        fn = type(self).__name__
        local, _ = _to_local(fn, inputs, None, None, False)
        out = super().__call__(*local, **kwargs)
        outs = [out] if not isinstance(out, (tuple, list)) else list(out)
        if len(outs) != len(self.out_dist_attrs):
            raise ValueError(f"{fn}: forward returned {len(outs)} output(s) but "
                             f"{len(self.out_dist_attrs)} out_dist_attrs were given")
        placed = [o if a is None else _from_local(fn, o, [a[1]], a[0])
                  for o, a in zip(outs, self.out_dist_attrs)]
        return placed[0] if not isinstance(out, (tuple, list)) else type(out)(placed)
