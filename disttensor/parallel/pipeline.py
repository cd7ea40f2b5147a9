"""``pp_config`` of :func:`parallelize`: a layer list cut into pipeline chunks, each chunk's
parameters on its stage's sub-mesh ``mesh[pp=i]`` (the dp/mp plans applied inside it).

The model is cut into ``pp * vpp_degree`` chunks of consecutive layers of one layer list
(``split_spec``); chunk ``k`` runs on stage ``k % pp``. Layers registered before the list go to
stage 0, layers after it to the last stage; a buffer of those outer layers (a causal mask, the
positions) gets a copy on every stage, used by the blocks of that stage.

A plain ``model(x)`` then runs as a naive pipeline: every rank runs the same program, each
computes only its stage (a rank outside a tensor's mesh holds an empty piece), and the input of
each chunk is resharded onto the chunk's stage mesh (point to point). The schedules of
:mod:`disttensor.pipelining` run one chunk at a time through :func:`run_chunk`.
"""
from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from spmd_rules import ProcessMesh, Replicate

from ..distributed.api import reshard, shard_tensor
from ..nn.layer import Layer
from ..tensor import Tensor
from .mesh import mesh_dim_index

__all__ = ["SplitPoint", "PipelineInfo", "pipeline_info", "plan_pipeline", "StageOutput",
           "run_chunk", "state_on_param_mesh"]

_SCHEDULES = ("FThenB", "1F1B", "VPP")
_KEYS = {"split_spec", "global_spec", "micro_batches", "schedule", "vpp_degree"}


class SplitPoint(enum.Enum):
    """Where a ``split_spec`` dict cuts: after the named layer (END) or before it (BEGINNING)."""
    BEGINNING = "beginning"
    END = "end"


@dataclass
class PipelineInfo:
    """The pipeline layout of a parallelized model (``model._pipeline``)."""
    mesh: ProcessMesh
    pp_dim: int
    stage_meshes: list[ProcessMesh]
    list_name: str
    chunks: list[list[Layer]]
    micro_batches: int
    schedule: str
    vpp_degree: int
    constants: dict[int, list[Tensor]] = field(default_factory=dict)

    @property
    def pp(self) -> int:
        return len(self.stage_meshes)

    def stage_of(self, rank: int) -> int | None:
        """This rank's stage (None outside the mesh)."""
        coord = self.mesh.get_coord(rank)
        return None if coord is None else coord[self.pp_dim]

    def peer(self, rank: int, stage: int) -> int:
        """The rank of ``stage`` at ``rank``'s coordinate in the other mesh dims."""
        coord = list(self.mesh.get_coord(rank))
        coord[self.pp_dim] = stage
        return self.mesh.rank_at(coord)


def pipeline_info(fn: str, model: Any) -> PipelineInfo:
    """``model``'s pipeline layout; ValueError naming ``fn`` when it has none."""
    info = getattr(model, "_pipeline", None)
    if not isinstance(info, PipelineInfo):
        raise ValueError(f"{fn}: the model has no pipeline stages; parallelize it with "
                         f"config={{'pp_config': {{'split_spec': ...}}}} on a mesh with a 'pp' dim")
    return info


# -- checking the config and cutting the layer list ---------------------------------------------

def _int(fn: str, cfg: dict, key: str, default: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{fn}: pp_config {key} must be a positive int, got {v!r}")
    return int(v)


def _layer_list(fn: str, model: Layer, name: str) -> list[Layer]:
    sub = dict(model.named_sublayers()).get(name)
    if sub is None:
        raise ValueError(f"{fn}: pp_config split_spec {name!r} names no sublayer of "
                         f"{type(model).__name__}")
    layers = list(sub.children())
    if not layers:
        raise ValueError(f"{fn}: pp_config split_spec {name!r} has no layers to split")
    return layers


def _cuts(fn: str, model: Layer, spec: Any, n_chunks: int) -> tuple[str, list[list[Layer]]]:
    """(list name, layers per chunk) of ``split_spec``."""
    if isinstance(spec, str):
        layers = _layer_list(fn, model, spec)
        if len(layers) < n_chunks:
            raise ValueError(f"{fn}: pp_config split_spec {spec!r} has {len(layers)} layers, "
                             f"fewer than the {n_chunks} stages (pp x vpp_degree)")
        sizes = [len(a) for a in np.array_split(np.arange(len(layers)), n_chunks)]
        bounds = np.cumsum([0] + sizes)
        return spec, [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    if not isinstance(spec, dict) or not spec:
        raise TypeError(f"{fn}: pp_config split_spec must be a layer-list name or a non-empty "
                        f"dict of layer name -> SplitPoint, got {spec!r}")
    parents = {k.rpartition(".")[0] if isinstance(k, str) else None for k in spec}
    if len(parents) != 1 or None in parents or "" in parents:
        raise ValueError(f"{fn}: pp_config split_spec keys must name layers of one layer list "
                         f"('blocks.3'), got {sorted(map(str, spec))}")
    name = parents.pop()
    layers = _layer_list(fn, model, name)
    cuts = set()
    for key, point in spec.items():
        idx = key.rpartition(".")[2]
        if not idx.isdigit() or int(idx) >= len(layers):
            raise ValueError(f"{fn}: pp_config split_spec key {key!r} is not a layer of "
                             f"{name!r} ({len(layers)} layers)")
        if not isinstance(point, SplitPoint):
            raise TypeError(f"{fn}: pp_config split_spec[{key!r}] must be SplitPoint.END or "
                            f"SplitPoint.BEGINNING, got {point!r}")
        cut = int(idx) + (point is SplitPoint.END)
        if cut in (0, len(layers)) or cut in cuts:
            raise ValueError(f"{fn}: pp_config split_spec cut at {key!r} ({point.name}) leaves "
                             f"a stage empty")
        cuts.add(cut)
    if len(cuts) + 1 != n_chunks:
        raise ValueError(f"{fn}: pp_config split_spec makes {len(cuts) + 1} stages but the mesh "
                         f"and vpp_degree ask for {n_chunks} (pp x vpp_degree)")
    bounds = [0, *sorted(cuts), len(layers)]
    return name, [layers[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def plan_pipeline(fn: str, model: Layer, mesh: ProcessMesh, cfg: Any) -> PipelineInfo:
    """Check ``pp_config`` and cut the model (no parameter moves yet)."""
    if not isinstance(cfg, dict):
        raise TypeError(f"{fn}: pp_config must be a dict, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - _KEYS)
    if unknown:
        raise ValueError(f"{fn}: unknown pp_config keys {unknown} ({sorted(_KEYS)})")
    if cfg.get("global_spec") is not None:
        raise ValueError(f"{fn}: pp_config global_spec is not supported: the buffers of layers "
                         "outside the split layer list are copied to every stage instead")
    if "split_spec" not in cfg:
        raise ValueError(f"{fn}: pp_config needs split_spec (a layer-list name or a dict of cuts)")
    pp_dim = mesh_dim_index(f"{fn} (pp_config)", mesh, "pp")
    pp = mesh.shape[pp_dim]
    v = _int(fn, cfg, "vpp_degree", 1)
    schedule = cfg.get("schedule", "1F1B")
    if schedule not in _SCHEDULES:
        raise ValueError(f"{fn}: pp_config schedule must be one of {list(_SCHEDULES)}, got "
                         f"{schedule!r}")
    if v > 1 and schedule != "VPP":
        raise ValueError(f"{fn}: pp_config vpp_degree={v} needs schedule 'VPP', got {schedule!r}")
    name, chunks = _cuts(fn, model, cfg["split_spec"], pp * v)
    meshes = [mesh.get_mesh_with_dim("pp", i) for i in range(pp)]
    return PipelineInfo(mesh, pp_dim, meshes, name, chunks, _int(fn, cfg, "micro_batches", 1),
                        schedule, v)


def layer_stages(model: Layer, info: PipelineInfo) -> dict[str, int]:
    """Stage of every sublayer (by name; the root is "") for its own parameters and buffers."""
    chunk_of = {id(layer): k for k, chunk in enumerate(info.chunks) for layer in chunk}
    stages, in_list, after = {"": 0}, None, False
    prefix = info.list_name + "."
    for name, layer in model.named_sublayers():
        if name == info.list_name:
            stages[name] = 0
            continue
        if id(layer) in chunk_of:
            in_list = chunk_of[id(layer)] % info.pp
            stages[name] = in_list
        elif name.startswith(prefix):
            stages[name] = in_list
        else:
            after = after or in_list is not None
            stages[name] = info.pp - 1 if after else 0
    return stages


def check_untied(fn: str, model: Layer, stages: dict[str, int]) -> None:
    """A parameter used by layers of two stages is refused (gradients would need summing)."""
    owner: dict[int, tuple[int, str]] = {}
    for name, layer in model.named_sublayers(include_self=True):
        for pname, p in layer.named_parameters(include_sublayers=False):
            full = f"{name}.{pname}" if name else pname
            prev = owner.setdefault(id(p), (stages[name], full))
            if prev[0] != stages[name]:
                raise ValueError(f"{fn}: parameter {full!r} (stage {stages[name]}) is tied to "
                                 f"{prev[1]!r} (stage {prev[0]}); weights shared across "
                                 "pipeline stages are not supported")


def outer_buffers(model: Layer, info: PipelineInfo, stages: dict[str, int]) -> list:
    """(layer, name, dense value) of every buffer of a layer outside the split list."""
    prefix = info.list_name + "."
    return [(layer, n, b) for name, layer in model.named_sublayers(include_self=True)
            if name != info.list_name and not name.startswith(prefix)
            for n, b in layer.named_buffers(include_sublayers=False)]


def install(model: Layer, info: PipelineInfo, buffers: list) -> None:
    """Copy outer buffers to every stage and wrap each list layer's forward (after placing)."""
    for layer, n, dense in buffers:
        placed = getattr(layer, n)
        own = info.stage_meshes.index(placed._value.mesh) if placed.is_dist() else None
        info.constants[id(placed)] = [
            placed if s == own else shard_tensor(dense, m, [Replicate()] * m.ndim)
            for s, m in enumerate(info.stage_meshes)]
    for k, chunk in enumerate(info.chunks):
        for i, layer in enumerate(chunk):
            object.__setattr__(layer, "forward",
                               _chunk_forward(info, k, i == 0, i == len(chunk) - 1,
                                              layer.forward))
    object.__setattr__(model, "_pipeline", info)


def state_on_param_mesh(name: str, p: Tensor, acc: Tensor) -> Tensor:
    """An optimizer state of a stage's parameter lives on that stage's mesh (a dense one, such
    as Adam's beta powers, replicated there), so only that stage updates and saves it."""
    if acc.is_dist() or not p.is_dist():
        return acc
    mesh = p._value.mesh
    return shard_tensor(acc, mesh, [Replicate()] * mesh.ndim)


# -- running one chunk ---------------------------------------------------------------------------

class StageOutput(Exception):
    """Raised by the last layer of the running chunk to hand its output to the schedule."""

    def __init__(self, output: Tensor):
        super().__init__("pipeline chunk output")
        self.output = output


_ACTIVE: list = []  # (info, chunk, received input, on_start) while a schedule runs one chunk


@contextmanager
def run_chunk(info: PipelineInfo, chunk: int, received: Tensor | None,
              on_start: Callable[[], None] | None = None) -> Iterator[None]:
    """Within this block, a call of the model runs only list chunk ``chunk`` (its input
    ``received``; earlier chunks pass their input through; ``on_start()`` is called as its
    first layer starts) and a chunk before the last raises :class:`StageOutput` with its
    output."""
    _ACTIVE.append((info, chunk, received, on_start))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _chunk_forward(info: PipelineInfo, k: int, first: bool, last: bool, forward):
    stage = k % info.pp
    mesh = info.stage_meshes[stage]

    def local(a):
        copies = info.constants.get(id(a)) if isinstance(a, Tensor) else None
        return a if copies is None else copies[stage]

    def run(x, *args, **kwargs):
        active = _ACTIVE[-1] if _ACTIVE and _ACTIVE[-1][0] is info else None
        if active is not None and active[1] > k:
            return x  # an earlier chunk: another step of the schedule ran it
        if first and active is not None and active[3] is not None:
            active[3]()
        if first and active is not None and k > 0:
            x = active[2]
        elif first and isinstance(x, Tensor) and x.is_dist() and x._value.mesh != mesh:
            x = reshard(x, mesh, x.placements)
        out = forward(x, *map(local, args), **{n: local(a) for n, a in kwargs.items()})
        if last and active is not None and k < len(info.chunks) - 1:
            raise StageOutput(out)
        return out
    return run
