"""O2 mixed precision: ``decorate`` casts models to float16/bfloat16 and gives their
optimizers float32 master weights.

The optimizer keeps one float32 master tensor per low-precision parameter (made from the
parameter's float32 value before the cast, so it has the parameter's mesh and placements: a
ZeRO-3 sharded parameter has a master sharded alike). ``step`` runs the optimizer's own update
on the masters, with float32 copies of the gradients, so its states (moments) are float32 too;
then each parameter receives its master rounded to the low dtype, in place (same tensor, same
layout). The masters travel in the optimizer's ``state_dict`` as ``<param>_fp32_master_0``.
"""
from __future__ import annotations

from typing import Any

from ..dtype import LOW_PRECISION, float32
from ..nn.layer import Layer, _copy_into
from ..nn.norm import LayerNorm, _BatchNormBase
from ..ops import assign, cast
from ..tape import no_grad
from ..tensor import Tensor
from .auto_cast import check_level, low_precision_dtype

__all__ = ["decorate", "MasterWeights", "optimizer_grads"]

#: layers O2 keeps in float32 unless told otherwise (Paddle keeps its norm layers too)
NORM_LAYERS = (LayerNorm, _BatchNormBase)


def _parameters(opt: Any) -> list[Tensor]:
    params = getattr(opt, "_parameter_list", None)
    if params is None:
        raise TypeError(f"amp: {type(opt).__name__} is not a disttensor optimizer (it has no "
                        f"parameter list)")
    return list(params)


class MasterWeights:
    """The float32 masters of one optimizer's low-precision parameters (installed by
    :func:`decorate`; reached as ``optimizer._amp_master``)."""

    def __init__(self, opt: Any, params: list[Tensor]):
        self.opt = opt
        self.inner_step = opt.step
        self.inner_state_dict = opt.state_dict
        self.inner_set_state_dict = opt.set_state_dict
        with no_grad():
            self.masters = {id(p): (p, assign(cast(p, float32))) for p in params}
        for p, m in self.masters.values():
            m.name = f"{p._label()}_fp32_master_0"
        self._grad_of: dict[int, Tensor] = {}  # id(param) -> the low gradient a master's is of

    def grads(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, float32 gradient) for every trainable parameter with a gradient; a
        low-precision parameter's float32 gradient is its master's (cast once per gradient)."""
        out = []
        for p in _parameters(self.opt):
            if p.stop_gradient or p.grad is None:
                continue
            entry = self.masters.get(id(p))
            if entry is None:
                out.append((p, p))
                continue
            m = entry[1]
            if self._grad_of.get(id(p)) is not p.grad:
                with no_grad():
                    m.grad = cast(p.grad, float32)
                self._grad_of[id(p)] = p.grad
            out.append((p, m))
        return out

    def step(self) -> None:
        """The optimizer's update on the masters, then each parameter set to its master."""
        swapped = []
        for p, holder in self.grads():
            if holder is p:
                continue
            swapped.append((p, holder, p._value, p.grad))
            p._value, p.grad = holder._value, holder.grad
        try:
            self.inner_step()
        finally:
            for p, m, value, grad in swapped:
                m._value = p._value
                p._value, p.grad = value, grad
        with no_grad():
            for p, m, _, _ in swapped:
                _copy_into(p, m)
        self._grad_of.clear()

    def state_dict(self) -> dict[str, Any]:
        out = self.inner_state_dict()
        out.update({m.name: m for _, m in self.masters.values()})
        return out

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        rest = dict(state_dict)
        with no_grad():
            for p, m in self.masters.values():
                if m.name in rest:
                    _copy_into(m, rest.pop(m.name))
                    _copy_into(p, m)
        self.inner_set_state_dict(rest)


def optimizer_grads(opt: Any) -> list[tuple[Tensor, Tensor]]:
    """(parameter, tensor whose ``.grad`` the update reads) for each parameter with a gradient:
    the master under O2, the parameter itself otherwise."""
    master = getattr(opt, "_amp_master", None)
    if master is not None:
        return master.grads()
    return [(p, p) for p in _parameters(opt) if not p.stop_gradient and p.grad is not None]


def _as_list(x: Any, kind: type | None, arg: str) -> tuple[list, bool]:
    many = isinstance(x, (list, tuple))
    items = list(x) if many else [x]
    for i, item in enumerate(items):
        if kind is not None and not isinstance(item, kind):
            raise TypeError(f"decorate: argument '{arg}' must be a {kind.__name__} or a list of "
                            f"them, got {type(item).__name__} at {i}")
    return items, many


def decorate(models: Any, optimizers: Any = None, level: str = "O1", dtype: str = "float16",
             master_weight: bool | None = None, save_dtype: str | None = None,
             excluded_layers: Any = None) -> Any:
    """Prepare models and optimizers for mixed precision (Paddle's ``paddle.amp.decorate``).

    ``level`` "O1" changes nothing (``auto_cast`` does the work). "O2" casts the models'
    floating parameters and buffers to ``dtype`` ("float16" or "bfloat16"), except norm layers
    and ``excluded_layers`` (Layer instances or types), and — unless ``master_weight`` is False —
    gives each optimizer float32 master weights (see the module docstring). Returns ``models``
    or ``(models, optimizers)`` as given. ``save_dtype`` is accepted for Paddle's signature;
    ``state_dict`` keeps the parameters' own dtype.

    Example::

        model, opt = dt.amp.decorate(model, opt, level="O2", dtype="bfloat16")
        with dt.amp.auto_cast(level="O2", dtype="bfloat16"):
            loss = model(x).mean()
    """
    check_level(level, "decorate")
    low = low_precision_dtype(dtype, "decorate")
    layers, many_models = _as_list(models, Layer, "models")
    opts, many_opts = ([], False) if optimizers is None else _as_list(optimizers, None, "optimizers")
    for opt in opts:
        _parameters(opt)
        if getattr(opt, "_amp_master", None) is not None:
            raise ValueError(f"decorate: optimizer {type(opt).__name__} is already decorated")
    if level == "O2":
        if excluded_layers is None:
            excluded = list(NORM_LAYERS)
        else:
            excluded = list(excluded_layers) if isinstance(excluded_layers, (list, tuple)) \
                else [excluded_layers]
        before = {id(p): p for layer in layers for p in layer.parameters()
                  if p.dtype == float32}
        if master_weight is not False:
            masters = [MasterWeights(opt, [p for p in _parameters(opt) if id(p) in before])
                       for opt in opts]
        for layer in layers:
            layer._cast_floating(low, excluded, "decorate")
        if master_weight is not False:
            for opt, mw in zip(opts, masters):
                for key in [k for k, (p, _) in mw.masters.items() if p.dtype not in LOW_PRECISION]:
                    del mw.masters[key]  # kept in float32 (an excluded layer): no master
                opt._amp_master = mw
                opt.step, opt.state_dict, opt.set_state_dict = (mw.step, mw.state_dict,
                                                                 mw.set_state_dict)
    out_models = layers if many_models else layers[0]
    if optimizers is None:
        return out_models
    return out_models, (opts if many_opts else opts[0])
