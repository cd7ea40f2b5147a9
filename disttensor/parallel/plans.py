"""Paddle's parallel plans: ``parallelize(model, optimizer, mesh, config)`` with
``ColWiseParallel``, ``RowWiseParallel``, ``SequenceParallelBegin/End/Enable/Disable`` and
``PrepareLayerInput/Output`` keyed by sublayer names, and ``shard_layer``.

A plan places parameters with ``shard_tensor`` on the "mp" mesh dim and registers forward
hooks that reshard activations; everything else the SPMD rules of the ops do (a column-sharded
weight gives a column-sharded output, a row-sharded one a Partial output that the next op that
needs the value all-reduces). Parameters no plan touches are replicated on the mesh.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Sequence

from spmd_rules import Placement, ProcessMesh, Replicate, Shard

from ..distributed.api import reshard, shard_tensor
from ..nn.layer import Layer
from ..ops import transpose
from ..tensor import Tensor
from .lazy import fill_placed, is_lazy, materialize
from .mesh import get_mesh, mesh_dim_index, set_mesh
from .pipeline import (
    PipelineInfo,
    check_untied,
    install,
    layer_stages,
    outer_buffers,
    plan_pipeline,
    state_on_param_mesh,
)
from .sharding import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer

__all__ = ["PlanBase", "ColWiseParallel", "RowWiseParallel", "SequenceParallelBegin",
           "SequenceParallelEnd", "SequenceParallelEnable", "SequenceParallelDisable",
           "PrepareLayerInput", "PrepareLayerOutput", "parallelize", "shard_layer"]


# -- placing parameters --------------------------------------------------------------------

class ParamPlacer:
    """Replaces dense parameters (and buffers) of layers by distributed ones, once per tensor:
    a tensor shared by several layers becomes one distributed tensor everywhere; a lazy
    parameter (:class:`LazyGuard`) is sampled piece by piece."""

    def __init__(self, mesh: ProcessMesh):
        self.mesh = mesh
        self.placed: dict[int, Tensor] = {}    # id(old dense tensor) -> its distributed self
        self.originals: dict[int, Tensor] = {}  # id(old) -> old (keeps ids valid)

    def place(self, layer: Layer, name: str, placements: Sequence[Placement]) -> None:
        old = getattr(layer, name)
        if old is None or old.is_dist():
            return
        new = self.placed.get(id(old))
        if new is None:
            new = materialize(old, self.mesh, placements) if is_lazy(old) else \
                shard_tensor(old, self.mesh, list(placements))
            self.placed[id(old)] = new
            self.originals[id(old)] = old
        setattr(layer, name, new)

    def replicate_rest(self, root: Layer) -> None:
        """Every still-dense parameter and buffer of ``root``'s sublayers, replicated (a shared
        tensor already placed elsewhere takes that placement)."""
        rep = [Replicate()] * self.mesh.ndim
        for _, layer in root.named_sublayers(include_self=True):
            names = [n for n, _ in layer.named_parameters(include_sublayers=False)] + \
                    [n for n, _ in layer.named_buffers(include_sublayers=False)]
            for n in names:
                self.place(layer, n, rep)

    def mapping(self) -> dict[int, Tensor]:
        return dict(self.placed)


def _rebind_optimizer(fn: str, optimizer: Any, mapping: dict[int, Tensor]) -> None:
    """Point ``optimizer`` at the distributed parameters that replaced its dense ones.

    The optimizer has no public way to swap its parameters yet, so this walks its attributes
    and replaces, in every list/tuple/dict of tensors, each replaced parameter by its new self.
    It refuses an optimizer that already has state (built from the dense parameters)."""
    if optimizer is None or not mapping:
        return
    if optimizer.has_states():
        raise ValueError(f"{fn}: the optimizer already has state; create it (from "
                         "model.parameters()) and parallelize before the first step")
    for attr, value in list(vars(optimizer).items()):
        if isinstance(value, (list, tuple)) and any(id(v) in mapping for v in value):
            setattr(optimizer, attr, type(value)(mapping.get(id(v), v) for v in value))
        elif isinstance(value, dict) and any(id(v) in mapping for v in value.values()):
            setattr(optimizer, attr, {k: mapping.get(id(v), v) for k, v in value.items()})


# -- activations between plans ----------------------------------------------------------------

def _first(x: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(the tensor a hook works on, a function putting a new one back in its place)."""
    if isinstance(x, (tuple, list)):
        return x[0], lambda t: type(x)([t] + list(x[1:]))
    return x, lambda t: t


def _as_dist(t: Tensor, mesh: ProcessMesh) -> Tensor:
    return t if t.is_dist() else shard_tensor(t, mesh, [Replicate()] * mesh.ndim)


def _split_sequence(x: Any, mesh: ProcessMesh, need_transpose: bool) -> Any:
    """Shard the sequence dim of a 3-d activation on "mp" (``[b, s, h]`` becomes ``[s, b, h]``
    first when ``need_transpose``); the sequence dim is the one of dims 0, 1 that "dp" does
    not shard."""
    t, put = _first(x)
    _check_3d("SequenceParallel", t)
    t = _as_dist(t, mesh)
    if need_transpose:
        t = transpose(t, [1, 0, 2])
    pl = list(t.placements)
    dp = mesh.dim_names.index("dp") if "dp" in mesh.dim_names else None
    seq = 1 if dp is not None and pl[dp] == Shard(0) else 0
    pl[mesh.dim_names.index("mp")] = Shard(seq)
    return put(reshard(t, mesh, pl))


def _gather_sequence(x: Any, mesh: ProcessMesh, need_transpose: bool) -> Any:
    """Undo :func:`_split_sequence`: Replicate on "mp", then ``[s, b, h]`` back to ``[b, s, h]``
    when ``need_transpose``."""
    t, put = _first(x)
    _check_3d("SequenceParallel", t)
    t = _as_dist(t, mesh)
    pl = list(t.placements)
    pl[mesh.dim_names.index("mp")] = Replicate()
    t = reshard(t, mesh, pl)
    return put(transpose(t, [1, 0, 2]) if need_transpose else t)


def _gather_mp(x: Any, mesh: ProcessMesh) -> Any:
    t, put = _first(x)
    if not isinstance(t, Tensor) or not t.is_dist():
        return x
    pl = list(t.placements)
    pl[mesh.dim_names.index("mp")] = Replicate()
    return put(reshard(t, mesh, pl))


def _check_3d(plan: str, t: Any) -> None:
    if not isinstance(t, Tensor) or t.ndim != 3:
        raise ValueError(f"{plan}: expects a 3-d [batch, seq, hidden] (or [seq, batch, "
                         f"hidden]) tensor, got "
                         f"{list(t.shape) if isinstance(t, Tensor) else type(t).__name__}")


# -- the plans ----------------------------------------------------------------------------------

class PlanBase:
    """A parallel plan for one sublayer; ``apply`` places parameters and registers hooks."""

    def check(self, key: str, layer: Layer, params: list[str]) -> None:
        """Raise (before anything changes) if the plan cannot apply to ``layer``."""

    def apply(self, layer: Layer, mesh: ProcessMesh, params: list[str],
              placer: ParamPlacer) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define apply")


def _param(layer: Layer, name: str) -> Tensor | None:
    v = getattr(layer, name, None)
    return v if isinstance(v, Tensor) else None


class ColWiseParallel(PlanBase):
    """Column parallelism on "mp": a 2-d ``weight`` ``[in, out]`` as ``Shard(1)``, a 1-d
    ``bias`` as ``Shard(0)`` (the named parameter only, for a key ending in a parameter name).
    The output is sharded on its last dim; ``gather_output=True`` reshards it to Replicate on
    "mp" (an all-gather).

    ``split_factor=k`` is for a fused projection (QKV: 3, gate/up: 2): the out features are k
    equal sections and each "mp" rank holds its piece of every one (``Shard(1,
    split_factor=k)``), so splitting the output into its k sections gives each section
    column-parallel, with no communication.

    Example::

        {"mlp.fc1": dt.ColWiseParallel(), "lm_head.weight": dt.ColWiseParallel(),
         "attn.qkv": dt.ColWiseParallel(split_factor=3)}
    """

    def __init__(self, gather_output: bool = False, split_factor: int = 1):
        if isinstance(split_factor, bool) or not isinstance(split_factor, int) \
                or split_factor < 1:
            raise ValueError(f"ColWiseParallel: split_factor must be an int >= 1, got "
                             f"{split_factor!r}")
        self.gather_output = bool(gather_output)
        self.split_factor = split_factor

    def _targets(self, layer: Layer, params: list[str]) -> list[str]:
        return [n for n in (params or ["weight", "bias"]) if _param(layer, n) is not None]

    def check(self, key, layer, params):
        for n in self._targets(layer, params):
            p = _param(layer, n)
            if p.ndim not in (1, 2):
                raise ValueError(f"parallelize: ColWiseParallel on '{key}': parameter '{n}' has "
                                 f"shape {p.shape}; it needs 1 or 2 dims")
            if p.shape[-1] % self.split_factor:
                raise ValueError(f"parallelize: ColWiseParallel(split_factor="
                                 f"{self.split_factor}) on '{key}': parameter '{n}' of shape "
                                 f"{p.shape} has {p.shape[-1]} output features, not "
                                 f"{self.split_factor} equal sections")

    def apply(self, layer, mesh, params, placer):
        mp = mesh.dim_names.index("mp")
        for n in self._targets(layer, params):
            pl = [Replicate()] * mesh.ndim
            pl[mp] = Shard(_param(layer, n).ndim - 1, split_factor=self.split_factor)
            placer.place(layer, n, pl)
        if self.gather_output:
            layer.register_forward_post_hook(lambda _l, _i, out: _gather_mp(out, mesh))


class RowWiseParallel(PlanBase):
    """Row parallelism on "mp": a 2-d ``weight`` ``[in, out]`` as ``Shard(0)`` (a bias stays
    replicated). The output is Partial on "mp" until an op needs its value. With
    ``is_input_parallel=False`` the input's last dim is first sharded on "mp".

    Example::

        {"mlp.fc2": dt.RowWiseParallel()}
    """

    def __init__(self, is_input_parallel: bool = True):
        self.is_input_parallel = bool(is_input_parallel)

    def _targets(self, layer: Layer, params: list[str]) -> list[str]:
        names = [n for n in params if n != "bias"] or ["weight"]
        return [n for n in names if _param(layer, n) is not None]

    def check(self, key, layer, params):
        for n in self._targets(layer, params):
            if _param(layer, n).ndim != 2:
                raise ValueError(f"parallelize: RowWiseParallel on '{key}': parameter '{n}' has "
                                 f"shape {_param(layer, n).shape}; it needs 2 dims")

    def apply(self, layer, mesh, params, placer):
        mp = mesh.dim_names.index("mp")
        pl = [Replicate()] * mesh.ndim
        pl[mp] = Shard(0)
        for n in self._targets(layer, params):
            placer.place(layer, n, pl)
        if not self.is_input_parallel:
            def split_input(_layer, inputs):
                t, put = _first(inputs)
                t = _as_dist(t, mesh)
                p = list(t.placements)
                p[mp] = Shard(t.ndim - 1)
                return put(reshard(t, mesh, p))
            layer.register_forward_pre_hook(split_input)


class SequenceParallelBegin(PlanBase):
    """Marks the last layer before a sequence-parallel region: its output ``[b, s, h]`` becomes
    ``[s, b, h]`` (``need_transpose``) sharded on the sequence dim over "mp".

    Example::

        {"embed": dt.SequenceParallelBegin(), "head": dt.SequenceParallelEnd()}
    """

    def __init__(self, need_transpose: bool = True):
        self.need_transpose = bool(need_transpose)

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_post_hook(
            lambda _l, _i, out: _split_sequence(out, mesh, self.need_transpose))


class SequenceParallelEnd(PlanBase):
    """Marks the first layer after a sequence-parallel region: its input is gathered on "mp"
    and turned back from ``[s, b, h]`` to ``[b, s, h]`` (``need_transpose``).

    Example::

        {"embed": dt.SequenceParallelBegin(), "head": dt.SequenceParallelEnd()}
    """

    def __init__(self, need_transpose: bool = True):
        self.need_transpose = bool(need_transpose)

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_pre_hook(
            lambda _l, inputs: _gather_sequence(inputs, mesh, self.need_transpose))


class SequenceParallelEnable(PlanBase):
    """Sequence parallelism for one layer: its ``[b, s, h]`` input is split on the sequence
    dim (as ``[s, b, h]``) and its output gathered back.

    Example::

        {"layers.*.norm": dt.SequenceParallelEnable()}
    """

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_pre_hook(lambda _l, inputs: _split_sequence(inputs, mesh, True))
        layer.register_forward_post_hook(lambda _l, _i, out: _gather_sequence(out, mesh, True))


class SequenceParallelDisable(PlanBase):
    """A layer inside a sequence-parallel region that needs the whole sequence: its input is
    gathered (and transposed back to ``[b, s, h]`` when ``need_transpose``) and its output split
    again.

    Example::

        {"layers.*.attn": dt.SequenceParallelDisable()}
    """

    def __init__(self, need_transpose: bool = True):
        self.need_transpose = bool(need_transpose)

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_pre_hook(
            lambda _l, inputs: _gather_sequence(inputs, mesh, self.need_transpose))
        layer.register_forward_post_hook(
            lambda _l, _i, out: _split_sequence(out, mesh, self.need_transpose))


class PrepareLayerInput(PlanBase):
    """``fn(process_mesh=mesh)`` returns a forward pre-hook ``hook(layer, inputs)`` for the
    layer.

    Example::

        def to_replicate(process_mesh):
            return lambda layer, inputs: tuple(
                dt.reshard(x, process_mesh, [dt.Replicate()] * process_mesh.ndim) for x in inputs)
        {"fc1": dt.PrepareLayerInput(to_replicate)}
    """

    def __init__(self, fn: Callable[..., Callable]):
        if not callable(fn):
            raise TypeError(f"PrepareLayerInput: fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_pre_hook(self.fn(process_mesh=mesh))


class PrepareLayerOutput(PlanBase):
    """``fn(process_mesh=mesh)`` returns a forward post-hook ``hook(layer, inputs, output)``
    for the layer.

    Example::

        def to_replicate(process_mesh):
            return lambda layer, inputs, out: dt.reshard(
                out, process_mesh, [dt.Replicate()] * process_mesh.ndim)
        {"fc2": dt.PrepareLayerOutput(to_replicate)}
    """

    def __init__(self, fn: Callable[..., Callable]):
        if not callable(fn):
            raise TypeError(f"PrepareLayerOutput: fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def apply(self, layer, mesh, params, placer):
        layer.register_forward_post_hook(self.fn(process_mesh=mesh))


# -- matching plans to sublayers ----------------------------------------------------------------

def _match(key: str, name: str, layer: Layer) -> list[str] | None:
    """The parameter list (empty: the plan's default) when ``key`` names sublayer ``name``
    (exactly, or as a regular expression matching the whole name, as in Paddle; a key ending in
    ".<param>" of that layer names the parameter), else None."""
    attr = key.rsplit(".", 1)[-1]
    params: list[str] = []
    if "." in key and _param(layer, attr) is not None:
        key = key[:-len(attr) - 1]
        params = [attr]
    if key == name:
        return params
    try:
        return params if re.fullmatch(key, name) else None
    except re.error as e:
        raise ValueError(f"parallelize: plan key {key!r} is not a valid pattern: {e}") from None


def _resolve_plan(fn: str, model: Layer, plan: dict) -> list[tuple[str, Layer, PlanBase, list]]:
    """(sublayer name, sublayer, plan, parameter names) for every match, in layer order; a key
    that matches no sublayer raises."""
    if not isinstance(plan, dict):
        raise TypeError(f"{fn}: parallelize_plan must be a dict of sublayer name -> plan(s), "
                        f"got {type(plan).__name__}")
    entries = []
    for key, plans in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"{fn}: plan key {key!r} must be a str")
        plans = plans if isinstance(plans, (list, tuple)) else [plans]
        for p in plans:
            if not isinstance(p, PlanBase):
                raise TypeError(f"{fn}: plan for {key!r} must be a plan (ColWiseParallel, "
                                f"RowWiseParallel, ...) or a list of them, got {p!r}")
        entries.append((key, plans))
    layers = list(model.named_sublayers())
    matched = []
    for key, plans in entries:
        hits = [(name, layer, params) for name, layer in layers
                for params in [_match(key, name, layer)] if params is not None]
        if not hits:
            names = [n for n, _ in layers]
            raise ValueError(f"{fn}: plan key {key!r} matches no sublayer of "
                             f"{type(model).__name__} (sublayers: {names[:20]}"
                             f"{' ...' if len(names) > 20 else ''})")
        for name, layer, params in hits:
            for p in plans:
                p.check(key, layer, params)
                matched.append((name, layer, p, params))
    order = {name: i for i, (name, _) in enumerate(layers)}
    matched.sort(key=lambda m: order[m[0]])
    return matched


def _shard_inputs_on_dp(mesh: ProcessMesh, dp: int) -> Callable:
    """A forward pre-hook placing dense tensor inputs as ``Shard(0)`` on mesh dim ``dp`` (each
    rank keeps its rows; no communication). Distributed inputs are left as they are."""
    pl = [Replicate()] * mesh.ndim
    pl[dp] = Shard(0)

    def hook(_layer, inputs):
        return tuple(shard_tensor(x, mesh, pl) if isinstance(x, Tensor) and not x.is_dist()
                     and x.ndim >= 1 else x for x in inputs)
    return hook


def parallelize(model: Layer, optimizer: Any = None, mesh: ProcessMesh | None = None,
                config: dict | None = None) -> tuple[Layer, Any]:
    """Parallelize a single-process ``model`` (and the ``optimizer`` built from its parameters)
    on ``mesh`` (default: the mesh of :func:`set_mesh`) as Paddle's ``dist.parallelize``.

    ``config["mp_config"]["parallelize_plan"]`` maps sublayer names — exact, or regular
    expressions matched against the whole name (``"layers.*.mlp.fc1"``); a key ending in a
    parameter name places only that parameter — to a plan or a list of plans; the mesh needs an
    "mp" dim. Parameters no plan places are replicated. ``config["dp_config"]`` puts the model's
    dense tensor inputs as ``Shard(0)`` on the "dp" dim (inputs from ``shard_dataloader`` are
    already there), and parameter gradients are then summed over "dp" by the runtime;
    ``dp_config["sharding_level"]`` 1, 2 or 3 applies ZeRO to ``optimizer`` on "dp"
    (:func:`shard_optimizer` with ``ShardingStage1/2/3``). ``config["pp_config"]`` cuts the
    layer list ``split_spec`` names (evenly, or at a dict of ``{"blocks.3": SplitPoint.END}``
    cuts) into ``pp x vpp_degree`` chunks on the "pp" sub-meshes ``mesh[pp=i]``, the other
    plans applied inside each (:mod:`disttensor.parallel.pipeline`); run it with the
    schedules of :mod:`disttensor.pipelining`.
    ``model`` is changed in place and returned with ``optimizer``, now pointing at the
    distributed parameters.

    Bad input (a key matching no sublayer, a plan that does not fit its layer, a mesh without
    the "mp"/"dp" dim a config needs) raises on every rank before any parameter changes.
    Collective: none while placing (each rank keeps its slices); the hooks reshard activations.

    Example::

        mesh = dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        model, opt = dt.parallelize(model, opt, mesh, {
            "dp_config": {"sharding_level": 0},
            "mp_config": {"parallelize_plan": {"fc1": dt.ColWiseParallel(),
                                               "fc2": dt.RowWiseParallel()}}})
    """
    fn = "parallelize"
    if not isinstance(model, Layer):
        raise TypeError(f"{fn}: model must be a Layer, got {type(model).__name__}")
    if config is None:
        warnings.warn(f"{fn}: config is None; the model is returned unchanged", stacklevel=2)
        return model, optimizer
    if not isinstance(config, dict):
        raise TypeError(f"{fn}: config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - {"dp_config", "mp_config", "pp_config"})
    if unknown:
        raise ValueError(f"{fn}: unknown config keys {unknown} (dp_config, mp_config, pp_config)")
    if mesh is None:
        mesh = get_mesh()
        if mesh is None:
            raise ValueError(f"{fn}: no mesh: pass mesh= or call set_mesh(mesh) first")
    elif not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{fn}: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    mp_config, dp_config = config.get("mp_config"), config.get("dp_config")
    pipe = None
    if config.get("pp_config") is not None:
        pipe = plan_pipeline(fn, model, mesh, config["pp_config"])
        stages = layer_stages(model, pipe)
        check_untied(fn, model, stages)
    matched = []
    if mp_config is not None:
        if not isinstance(mp_config, dict):
            raise TypeError(f"{fn}: mp_config must be a dict, got {type(mp_config).__name__}")
        mesh_dim_index(f"{fn} (mp_config)", mesh, "mp")
        if mp_config.get("parallelize_plan") is not None:
            matched = _resolve_plan(fn, model, mp_config["parallelize_plan"])
    dp = None
    if dp_config is not None:
        if not isinstance(dp_config, dict):
            raise TypeError(f"{fn}: dp_config must be a dict, got {type(dp_config).__name__}")
        dp = mesh_dim_index(f"{fn} (dp_config)", mesh, "dp")
        if pipe is not None:
            dp = mesh_dim_index(fn, pipe.stage_meshes[0], "dp")
        level = str(dp_config.get("sharding_level", 0))
        if level not in ("0", "1", "2", "3"):
            raise ValueError(f"{fn}: dp_config sharding_level must be 0, 1, 2 or 3, got "
                             f"{dp_config['sharding_level']!r}")
        if level != "0" and pipe is not None:
            raise ValueError(f"{fn}: dp_config sharding_level={level} with pp_config is not "
                             "supported; use sharding_level 0")
        if level != "0" and optimizer is None:
            raise ValueError(f"{fn}: dp_config sharding_level={level} shards the optimizer; "
                             "pass the optimizer")
    set_mesh(mesh)
    if pipe is None:
        placer = ParamPlacer(mesh)
        for _, layer, plan, params in matched:
            plan.apply(layer, mesh, params, placer)
        placer.replicate_rest(model)
        mapping = placer.mapping()
    else:
        buffers = outer_buffers(model, pipe, stages)
        mapping = _place_stages(model, pipe, matched, stages)
        install(model, pipe, buffers)
    if dp is not None:
        first = mesh if pipe is None else pipe.stage_meshes[0]
        model.register_forward_pre_hook(_shard_inputs_on_dp(first, dp))
    _rebind_optimizer(fn, optimizer, mapping)
    if pipe is not None and optimizer is not None:
        optimizer._set_shard_fn(state_on_param_mesh)
    if dp is not None and level != "0":
        stage = (ShardingStage1, ShardingStage2, ShardingStage3)[int(level) - 1]
        optimizer = shard_optimizer(optimizer, stage(dp, mesh))
    return model, optimizer


def _place_stages(model: Layer, pipe: PipelineInfo, matched: list,
                  stages: dict[str, int]) -> dict[int, Tensor]:
    """Place each sublayer's parameters and buffers on its stage's sub-mesh (its plans first,
    the rest replicated); the old -> new tensor mapping."""
    placers = [ParamPlacer(m) for m in pipe.stage_meshes]
    for name, layer, plan, params in matched:
        plan.apply(layer, pipe.stage_meshes[stages[name]], params, placers[stages[name]])
    for name, layer in model.named_sublayers(include_self=True):
        placer = placers[stages[name]]
        rep = [Replicate()] * placer.mesh.ndim
        for n in [n for n, _ in layer.named_parameters(include_sublayers=False)] + \
                 [n for n, _ in layer.named_buffers(include_sublayers=False)]:
            placer.place(layer, n, rep)
    return {k: v for p in placers for k, v in p.mapping().items()}


def shard_layer(layer: Layer, process_mesh: ProcessMesh,
                shard_fn: Callable[[str, Layer, ProcessMesh], None] | None = None,
                input_fn: Callable[[Any, ProcessMesh], Any] | None = None,
                output_fn: Callable[[Any, ProcessMesh], Any] | None = None) -> Layer:
    """Distribute ``layer``'s parameters and buffers in place (Paddle's ``dist.shard_layer``).

    ``shard_fn(name, sublayer, process_mesh)`` is called for every sublayer (the layer itself
    first, name "") and may replace its parameters with ``shard_tensor(...)`` results; whatever
    is still dense afterwards is replicated on ``process_mesh`` (a tensor shared by several
    sublayers becomes one distributed tensor). Lazy parameters (:class:`LazyGuard`) get only
    this rank's pieces sampled. ``input_fn(inputs, process_mesh)`` becomes a
    forward pre-hook (its result replaces the inputs) and ``output_fn(outputs, process_mesh)``
    a forward post-hook. No communication while placing.

    Example::

        def shard_fn(name, sub, mesh):
            if name == "fc1":
                sub.weight = dt.shard_tensor(sub.weight, mesh, [dt.Shard(1)])
        dt.shard_layer(model, mesh, shard_fn)
    """
    if not isinstance(layer, Layer):
        raise TypeError(f"shard_layer: layer must be a Layer, got {type(layer).__name__}")
    if not isinstance(process_mesh, ProcessMesh):
        raise TypeError(f"shard_layer: process_mesh must be a ProcessMesh, got "
                        f"{type(process_mesh).__name__}")
    for fname, f in (("shard_fn", shard_fn), ("input_fn", input_fn), ("output_fn", output_fn)):
        if f is not None and not callable(f):
            raise TypeError(f"shard_layer: {fname} must be callable, got {type(f).__name__}")
    if shard_fn is not None:
        for name, sub in layer.named_sublayers(include_self=True):
            lazy = {n: p for n, p in sub.named_parameters(include_sublayers=False)
                    if is_lazy(p)}
            shard_fn(name, sub, process_mesh)
            for n, p in lazy.items():  # shard_tensor sliced a placeholder: sample the piece
                new = getattr(sub, n)
                if new is not p and isinstance(new, Tensor) and new.is_dist():
                    fill_placed(p, new)
    ParamPlacer(process_mesh).replicate_rest(layer)
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda _l, inputs: input_fn(inputs, process_mesh))
    if output_fn is not None:
        layer.register_forward_post_hook(
            lambda _l, _i, outputs: output_fn(outputs, process_mesh))
    return layer
