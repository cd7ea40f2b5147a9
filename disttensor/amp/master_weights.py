"""O2 mixed precision: ``decorate`` casts models to float16/bfloat16 and gives their
optimizers float32 master weights.

The optimizer is re-pointed at one float32 master per low-precision parameter (a
:class:`Parameter` made from the parameter's float32 value before the cast, so it has the
parameter's mesh, placements, name and learning-rate multiplier: a ZeRO-3 sharded parameter has
a master sharded alike, and the optimizer's state keys stay the parameter's). ``step`` gives each
master the float32 cast of its parameter's gradient, runs the optimizer's own update on the
masters (so its moments are float32 too), then writes each master, rounded, into its parameter
in place. Every one of these is an ordinary op on fixed tensors, so a captured step replays
them. The masters travel in the optimizer's ``state_dict`` as ``<param>_fp32_master_0``.
"""
from __future__ import annotations

from typing import Any

from ..dtype import LOW_PRECISION, float32
from ..nn.layer import Layer, Parameter, _clear_grads, _copy_into
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
    return params


def _repoint(opt: Any, new_of: dict) -> None:
    """Replace parameters by their masters in the optimizer's lists, in place (the flat list
    and, where the optimizer keeps them, its parameter groups)."""
    lists = [_parameters(opt)] + [g["params"] for g in getattr(opt, "_param_groups", None) or ()
                                  if isinstance(g, dict) and isinstance(g.get("params"), list)]
    for params in lists:
        for i, p in enumerate(params):
            params[i] = new_of.get(id(p), p)


class MasterWeights:
    """The float32 masters of one optimizer's low-precision parameters (installed by
    :func:`decorate`; reached as ``optimizer._amp_master``)."""

    def __init__(self, opt: Any, params: list[Tensor]):
        self.opt = opt
        self.inner_step, self.inner_clear_grad = opt.step, opt.clear_grad
        self.inner_state_dict, self.inner_set_state_dict = opt.state_dict, opt.set_state_dict
        self.pairs: list[tuple[Tensor, Tensor]] = []
        with no_grad():
            for p in params:
                attr = getattr(p, "optimize_attr", None) or {"learning_rate": 1.0}
                m = Parameter(assign(cast(p, float32))._value, name=p._label(),
                              trainable=not p.stop_gradient,
                              learning_rate=attr["learning_rate"])
                self.pairs.append((p, m))
        self._grad_of: dict[int, Tensor] = {}  # id(master) -> the low gradient it was cast from
        self._param_of: dict[int, Tensor] = {}  # id(master) -> its parameter (keep_low fills it)

    def keep_low(self) -> None:
        """Forget the masters of parameters that stayed float32; re-point the optimizer."""
        self.pairs = [(p, m) for p, m in self.pairs if p.dtype in LOW_PRECISION]
        self._param_of = {id(m): p for p, m in self.pairs}
        _repoint(self.opt, {id(p): m for p, m in self.pairs})

    def grads(self) -> list[tuple[Tensor, Tensor]]:
        """(parameter, tensor whose ``.grad`` the update reads) for every trainable parameter
        with a gradient; a master's gradient is the float32 cast of its parameter's (made once
        per gradient)."""
        out = []
        for t in _parameters(self.opt):
            p = self._param_of.get(id(t))
            if p is None:
                if not t.stop_gradient and t.grad is not None:
                    out.append((t, t))
                continue
            if p.stop_gradient or p.grad is None:
                t.grad = None
                continue
            if self._grad_of.get(id(t)) is not p.grad:
                with no_grad():
                    t.grad = cast(p.grad, float32)
                self._grad_of[id(t)] = p.grad
            out.append((p, t))
        return out

    def step(self) -> None:
        """The optimizer's update on the masters, then each parameter set to its master."""
        updated = [(p, m) for p, m in self.grads() if m is not p]
        self.inner_step()
        with no_grad():
            for p, m in updated:
                _copy_into(p, m)
        self._grad_of.clear()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Clear the parameters' gradients (and drop the masters')."""
        self.inner_clear_grad(set_to_zero)
        _clear_grads([p for p, _ in self.pairs], set_to_zero)
        for _, m in self.pairs:
            m.grad = None
        self._grad_of.clear()

    def state_dict(self) -> dict[str, Any]:
        out = self.inner_state_dict()
        out.update({f"{m.name}_fp32_master_0": m for _, m in self.pairs})
        return out

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        rest = dict(state_dict)
        with no_grad():
            for p, m in self.pairs:
                key = f"{m.name}_fp32_master_0"
                if key in rest:
                    _copy_into(m, rest.pop(key))
                    _copy_into(p, m)
        self.inner_set_state_dict(rest)

    def master_of(self, p: Tensor) -> Tensor | None:
        """The master of parameter ``p`` (None if it has none)."""
        return next((m for q, m in self.pairs if q is p), None)


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
    and ``excluded_layers`` (Layer instances or types), and (unless ``master_weight`` is False)
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
    opts, many_opts = ([], False) if optimizers is None else \
        _as_list(optimizers, None, "optimizers")
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
        fp32 = {id(p) for layer in layers for p in layer.parameters() if p.dtype == float32}
        if master_weight is not False:
            masters = [MasterWeights(opt, [p for p in _parameters(opt) if id(p) in fp32])
                       for opt in opts]
        for layer in layers:
            layer._cast_floating(low, excluded, "decorate")
        if master_weight is not False:
            for opt, mw in zip(opts, masters):
                mw.keep_low()  # parameters kept in float32 (excluded layers) need none
                opt._amp_master = mw
                opt.step, opt.clear_grad, opt.zero_grad = mw.step, mw.clear_grad, mw.clear_grad
                opt.state_dict, opt.set_state_dict = mw.state_dict, mw.set_state_dict
    out_models = layers if many_models else layers[0]
    if optimizers is None:
        return out_models
    return out_models, (opts if many_opts else opts[0])
