"""Optimizers (Paddle's ``paddle.optimizer``): SGD (with momentum), Momentum, Adam, AdamW.

``step()`` updates every parameter that has a gradient (``grad is None`` or
``stop_gradient=True``: skipped) inplace, under ``no_grad``, with public tensor ops only, so the
parameter object never changes and a distributed parameter keeps its mesh and placements. State
tensors (velocity, moments) are created with ``zeros_like(param)`` and so take the parameter's
layout. A parameter's ``optimize_attr["learning_rate"]`` (from ``ParamAttr``) multiplies the
learning rate.

``weight_decay`` (a float) is L2 regularization for SGD/Momentum/Adam (``grad += wd * param``) and
decoupled decay for AdamW (``param *= 1 - lr * wd`` before the Adam update), as in Paddle.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import numpy as np

from .autograd import no_grad
from .ops import OPS, add, add_, apply, scale, scale_, subtract_, zeros_like
from .ops.common import as_tensor
from .tensor import Tensor, to_tensor

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "AdamW"]


class Optimizer:
    """Base class: holds the parameters, the learning rate and per-parameter state tensors."""

    _accumulator_names: tuple[str, ...] = ()

    def __init__(self, learning_rate: float, parameters: Iterable[Tensor] | None,
                 weight_decay: float | None):
        cls = type(self).__name__
        if parameters is None:
            raise ValueError(f"{cls}: parameters is required (e.g. model.parameters())")
        if isinstance(parameters, Tensor):
            raise TypeError(f"{cls}: parameters must be an iterable of Tensors, got a Tensor")
        params = list(parameters)
        for i, p in enumerate(params):
            if not isinstance(p, Tensor):
                raise TypeError(f"{cls}: parameters[{i}] must be a Tensor, got "
                                f"{type(p).__name__}")
        self._parameter_list = params
        self._learning_rate = self._check_lr(learning_rate)
        if weight_decay is not None and (isinstance(weight_decay, bool)
                                         or not isinstance(weight_decay, (int, float))):
            raise TypeError(f"{cls}: weight_decay must be a float or None, got "
                            f"{type(weight_decay).__name__}")
        self._weight_decay = None if weight_decay is None else float(weight_decay)
        # accumulator name -> id(param) -> state Tensor
        self._accumulators: dict[str, dict[int, Tensor]] = {n: {} for n in
                                                           self._accumulator_names}

    def _check_lr(self, lr: Any) -> float:
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
            raise TypeError(f"{type(self).__name__}: learning_rate must be a float, got "
                            f"{type(lr).__name__}")
        return float(lr)

    # -- learning rate -------------------------------------------------------------------------
    def get_lr(self) -> float:
        return self._learning_rate

    def set_lr(self, value: float) -> None:
        self._learning_rate = self._check_lr(value)

    # -- gradients ----------------------------------------------------------------------------
    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Set every parameter's gradient to zeros (Paddle's default) or drop it
        (``set_to_zero=False``)."""
        from .nn.layer import _clear_grads

        _clear_grads(self._parameter_list, set_to_zero)

    zero_grad = clear_grad

    # -- step -----------------------------------------------------------------------------------
    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for p in self._parameter_list:
            if p.stop_gradient or p.grad is None:
                continue
            g = p.grad
            if list(g.shape) != p.shape:
                raise ValueError(f"{type(self).__name__}.step: gradient of '{p._label()}' has "
                                 f"shape {g.shape}, the parameter {p.shape}")
            attr = getattr(p, "optimize_attr", None)
            lr = self._learning_rate * (attr["learning_rate"] if attr else 1.0)
            self._update(p, g, lr)

    def _update(self, p: Tensor, g: Tensor, lr: float) -> None:
        raise NotImplementedError

    def _acc(self, name: str, p: Tensor) -> Tensor:
        store = self._accumulators[name]
        acc = store.get(id(p))
        if acc is None:
            acc = store[id(p)] = zeros_like(p)
        return acc

    def _l2(self, p: Tensor, g: Tensor) -> Tensor:
        return add(g, scale(p, self._weight_decay)) if self._weight_decay else g

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``"<param name>_<accumulator>_0"`` -> state tensor (the live tensor), as in Paddle;
        Adam's beta powers are one-element float64 tensors ``..._beta1_pow_acc_0`` and
        ``..._beta2_pow_acc_0``."""
        out: dict[str, Any] = {}
        for p in self._parameter_list:
            k = id(p)
            for name in self._accumulator_names:
                acc = self._accumulators[name].get(k)
                if acc is not None:
                    out[f"{p._label()}_{name}_0"] = acc
            out.update(self._extra_state(p))
        return out

    def _extra_state(self, p: Tensor) -> dict[str, Tensor]:
        return {}

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state saved by :meth:`state_dict` (copied inplace into existing state tensors,
        created with the parameter's layout otherwise). Shape mismatch -> ValueError."""
        from .nn.layer import _copy_into

        with no_grad():
            for p in self._parameter_list:
                for name in self._accumulator_names:
                    key = f"{p._label()}_{name}_0"
                    if key not in state_dict:
                        continue
                    value = state_dict[key]
                    shape = list(np.shape(value) if not isinstance(value, Tensor)
                                 else value.shape)
                    if shape != p.shape:
                        raise ValueError(f"{type(self).__name__}.set_state_dict: '{key}' has "
                                         f"shape {shape}, the parameter {p.shape}")
                    _copy_into(self._acc(name, p), value)
                self._load_extra_state(p, state_dict)

    def _load_extra_state(self, p: Tensor, state_dict: dict[str, Any]) -> None:
        pass


class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum as in Paddle's Momentum:
    ``v = momentum * v + g``; ``param -= lr * v`` (Nesterov: ``param -= lr * (g + momentum * v)``);
    ``g`` includes the L2 term ``weight_decay * param``."""

    def __init__(self, learning_rate: float = 0.001, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float | None = None, momentum: float = 0.0,
                 use_nesterov: bool = False, name: str | None = None):
        if not 0.0 <= momentum:
            raise ValueError(f"{type(self).__name__}: momentum must be >= 0, got {momentum}")
        self._momentum = float(momentum)
        self._use_nesterov = bool(use_nesterov)
        self._accumulator_names = ("velocity",) if self._momentum else ()
        super().__init__(learning_rate, parameters, weight_decay)

    def _update(self, p, g, lr):
        if not self._momentum:  # the fused kernel: one op per parameter
            apply(OPS["sgd_update"], (p, g, as_tensor(lr, p)),
                  {"l2": self._weight_decay or 0.0})
            return
        g = self._l2(p, g)
        if self._momentum:
            v = self._acc("velocity", p)
            scale_(v, self._momentum)
            add_(v, g)
            g = add(g, scale(v, self._momentum)) if self._use_nesterov else v
        subtract_(p, scale(g, lr))


class Momentum(SGD):
    """Paddle's ``Momentum`` optimizer: :class:`SGD` with ``momentum`` (default 0.9)."""

    def __init__(self, learning_rate: float = 0.001, momentum: float = 0.9,
                 parameters: Iterable[Tensor] | None = None, use_nesterov: bool = False,
                 weight_decay: float | None = None, name: str | None = None):
        super().__init__(learning_rate, parameters, weight_decay, momentum, use_nesterov)


class Adam(Optimizer):
    """Adam: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``param -= lr * m_hat / (sqrt(v_hat) + epsilon)`` with bias-corrected ``m_hat``, ``v_hat``;
    ``g`` includes the L2 term ``weight_decay * param``."""

    _accumulator_names = ("moment1", "moment2")

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float | None = None, name: str | None = None):
        for arg, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{type(self).__name__}: {arg} must be in [0, 1), got {b}")
        if epsilon < 0:
            raise ValueError(f"{type(self).__name__}: epsilon must be >= 0, got {epsilon}")
        self._beta1, self._beta2, self._epsilon = float(beta1), float(beta2), float(epsilon)
        self._beta_pows: dict[int, tuple[float, float]] = {}  # id(param) -> (b1**t, b2**t)
        super().__init__(learning_rate, parameters, weight_decay)

    def _update(self, p, g, lr):
        self._adam(p, g, lr, l2=self._weight_decay or 0.0)

    def _adam(self, p, g, lr, l2=0.0, decay=1.0):
        """One fused Adam step (``adam_update``): moments and parameter updated in place."""
        b1, b2 = self._beta1, self._beta2
        m, v = self._acc("moment1", p), self._acc("moment2", p)
        pows = self._beta_pows.get(id(p), (1.0, 1.0))
        pow1, pow2 = self._beta_pows[id(p)] = (pows[0] * b1, pows[1] * b2)
        scalars = (as_tensor(lr / (1.0 - pow1), p), as_tensor(1.0 / math.sqrt(1.0 - pow2), p),
                   as_tensor(decay, p))
        apply(OPS["adam_update"], (p, g, m, v) + scalars,
              {"beta1": b1, "beta2": b2, "epsilon": self._epsilon, "l2": l2})

    def _extra_state(self, p):
        pows = self._beta_pows.get(id(p))
        if pows is None:
            return {}
        name = p._label()
        return {f"{name}_beta{i + 1}_pow_acc_0": to_tensor(np.array([pw], np.float64))
                for i, pw in enumerate(pows)}

    def _load_extra_state(self, p, state_dict):
        keys = [f"{p._label()}_beta{i}_pow_acc_0" for i in (1, 2)]
        if all(k in state_dict for k in keys):
            self._beta_pows[id(p)] = tuple(float(np.asarray(state_dict[k]).reshape(-1)[0])
                                           for k in keys)


class AdamW(Adam):
    """Adam with decoupled weight decay: ``param *= 1 - lr * weight_decay`` (for parameters
    that ``apply_decay_param_fun(name)`` accepts, default all), then the Adam update."""

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float = 0.01,
                 apply_decay_param_fun: Callable[[str], bool] | None = None,
                 name: str | None = None):
        super().__init__(learning_rate, beta1, beta2, epsilon, parameters, weight_decay)
        self._apply_decay_param_fun = apply_decay_param_fun

    def _update(self, p, g, lr):
        wd = self._weight_decay
        decays = wd and (self._apply_decay_param_fun is None
                         or self._apply_decay_param_fun(p._label()))
        self._adam(p, g, lr, decay=1.0 - lr * wd if decays else 1.0)
