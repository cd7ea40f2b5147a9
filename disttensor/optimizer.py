"""Optimizers (Paddle's ``paddle.optimizer``): SGD (with momentum), Momentum, Adam, AdamW.

``step()`` updates every parameter that has a gradient (``grad is None`` or
``stop_gradient=True``: skipped) with one fused op per parameter (``sgd_update``,
``momentum_update``, ``adam_update``) that updates the parameter and its state tensors in place,
so the parameter object, holder and version counter never change and a distributed parameter
keeps its mesh and placements. State tensors (velocity, moments) are created with
``zeros_like(param)`` and so take the parameter's layout; Adam's beta powers are one-element
float64 tensors updated by the kernel. The learning rate enters each step as a ``host_scalar``
read when the update runs, so a captured step picks up ``set_lr`` and schedulers on replay. A
parameter's ``optimize_attr["learning_rate"]`` (from ``ParamAttr``) multiplies the learning rate.

``dt.shard_optimizer(opt, shard_fn)`` sets a ``shard_fn(accumulator_name, param, state)`` that
lays out each state tensor when it is created (ZeRO's stages shard them over the data-parallel
mesh dim); the fused update then runs in the merged layout of its inputs.

``weight_decay`` (a float) is L2 regularization for SGD/Momentum/Adam (``grad += wd * param``) and
decoupled decay for AdamW (``param *= 1 - lr * wd`` before the Adam update), as in Paddle.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from .dispatch import apply, note_undo
from .nn.layer import _clear_grads, _copy_into
from .ops import OPS, full, zeros_like
from .ops.creation import host_scalar
from .tape import no_grad
from .tensor import Tensor

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "AdamW"]


class Optimizer:
    """Base class: holds the parameters, the learning rate and per-parameter state tensors.
    ``step`` issues no collective of its own: each fused update runs in the layout of its
    inputs (a ZeRO-sharded state makes it an update of the dp slice plus an all-gather of the
    parameter).

    Example::

        opt = dt.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        loss.backward(); opt.step(); opt.clear_grad()
    """

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
        self._shard_fn: Callable[[str, Tensor, Tensor], Tensor] | None = None

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
        _clear_grads(self._parameter_list, set_to_zero)

    zero_grad = clear_grad

    # -- step -----------------------------------------------------------------------------------
    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        lr = None
        for p in self._parameter_list:
            if p.stop_gradient or p.grad is None:
                continue
            g = p.grad
            if list(g.shape) != p.shape:
                raise ValueError(f"{type(self).__name__}.step: gradient of '{p._label()}' has "
                                 f"shape {g.shape}, the parameter {p.shape}")
            if lr is None:
                lr = host_scalar(self.get_lr)
            attr = getattr(p, "optimize_attr", None)
            self._update(p, g, lr, float(attr["learning_rate"]) if attr else 1.0)

    def _update(self, p: Tensor, g: Tensor, lr: Tensor, lr_scale: float) -> None:
        raise NotImplementedError

    def _new_acc(self, name: str, p: Tensor) -> Tensor:
        """A fresh state tensor (zeros laid out like the parameter)."""
        return zeros_like(p)

    def _set_shard_fn(self, shard_fn: Callable[[str, Tensor, Tensor], Tensor] | None) -> None:
        """Lay out states with ``shard_fn`` from now on; existing states are laid out now."""
        self._shard_fn = shard_fn
        if shard_fn is None:
            return
        by_id = {id(p): p for p in self._parameter_list}
        for name, store in self._accumulators.items():
            for k, acc in list(store.items()):
                new = shard_fn(name, by_id[k], acc)
                new.name = acc.name
                store[k] = new

    def _acc(self, name: str, p: Tensor) -> Tensor:
        store = self._accumulators[name]
        acc = store.get(id(p))
        if acc is None:
            acc = self._new_acc(name, p)
            if self._shard_fn is not None:
                acc = self._shard_fn(name, p, acc)
            store[id(p)] = acc
            acc.name = f"{p._label()}_{name}_0"  # Paddle's accumulator names
            note_undo(lambda: store.pop(id(p), None))  # a failed capture forgets it
        return acc

    # -- state ----------------------------------------------------------------------------------
    def create_states(self) -> None:
        """Create every trainable parameter's state tensors now, as its first update would
        (zeros, laid out by the ``shard_fn`` if any): the targets a checkpoint is loaded into
        (``dt.load_state_dict({"opt": opt.state_dict()}, path)``) before training resumes."""
        for p in self._parameter_list:
            if not p.stop_gradient:
                for name in self._accumulator_names:
                    self._acc(name, p)

    def state_dict(self) -> dict[str, Any]:
        """``"<param name>_<accumulator>_0"`` -> state tensor (the live tensor), as in Paddle;
        Adam's beta powers (``b**t`` after t steps) are one-element float64 tensors
        ``..._beta1_pow_acc_0`` and ``..._beta2_pow_acc_0``."""
        out: dict[str, Any] = {}
        for p in self._parameter_list:
            k = id(p)
            for name in self._accumulator_names:
                acc = self._accumulators[name].get(k)
                if acc is not None:
                    out[f"{p._label()}_{name}_0"] = acc
        return out

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state saved by :meth:`state_dict` (copied inplace into existing state tensors,
        created with the parameter's layout otherwise). Shape mismatch -> ValueError."""
        with no_grad():
            for p in self._parameter_list:
                for name in self._accumulator_names:
                    key = f"{p._label()}_{name}_0"
                    if key not in state_dict:
                        continue
                    value = state_dict[key]
                    shape = list(np.shape(value) if not isinstance(value, Tensor)
                                 else value.shape)
                    acc = self._acc(name, p)
                    if shape != acc.shape:
                        raise ValueError(f"{type(self).__name__}.set_state_dict: '{key}' has "
                                         f"shape {shape}, the state of parameter "
                                         f"'{p._label()}' {acc.shape}")
                    _copy_into(acc, value)


class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum as in Paddle's Momentum:
    ``v = momentum * v + g``; ``param -= lr * v`` (Nesterov: ``param -= lr * (g + momentum * v)``);
    ``g`` includes the L2 term ``weight_decay * param``.

    Example::

        opt = dt.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    """

    def __init__(self, learning_rate: float = 0.001, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float | None = None, momentum: float = 0.0,
                 use_nesterov: bool = False, name: str | None = None):
        if not 0.0 <= momentum:
            raise ValueError(f"{type(self).__name__}: momentum must be >= 0, got {momentum}")
        self._momentum = float(momentum)
        self._use_nesterov = bool(use_nesterov)
        self._accumulator_names = ("velocity",) if self._momentum else ()
        super().__init__(learning_rate, parameters, weight_decay)

    def _update(self, p, g, lr, lr_scale):
        l2 = self._weight_decay or 0.0
        if not self._momentum:
            apply(OPS["sgd_update"], (p, g, lr), {"l2": l2, "lr_scale": lr_scale})
            return
        apply(OPS["momentum_update"], (p, g, self._acc("velocity", p), lr),
              {"mu": self._momentum, "use_nesterov": self._use_nesterov, "l2": l2,
               "lr_scale": lr_scale})


class Momentum(SGD):
    """Paddle's ``Momentum`` optimizer: :class:`SGD` with ``momentum`` (default 0.9).

    Example::

        opt = dt.optimizer.Momentum(0.1, momentum=0.9, parameters=model.parameters())
    """

    def __init__(self, learning_rate: float = 0.001, momentum: float = 0.9,
                 parameters: Iterable[Tensor] | None = None, use_nesterov: bool = False,
                 weight_decay: float | None = None, name: str | None = None):
        super().__init__(learning_rate, parameters, weight_decay, momentum, use_nesterov)


class Adam(Optimizer):
    """Adam: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``param -= lr * m_hat / (sqrt(v_hat) + epsilon)`` with bias-corrected ``m_hat``, ``v_hat``;
    ``g`` includes the L2 term ``weight_decay * param``.

    Example::

        opt = dt.optimizer.Adam(learning_rate=1e-3, parameters=model.parameters())
    """

    _accumulator_names = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float | None = None, name: str | None = None):
        for arg, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{type(self).__name__}: {arg} must be in [0, 1), got {b}")
        if epsilon < 0:
            raise ValueError(f"{type(self).__name__}: epsilon must be >= 0, got {epsilon}")
        self._beta1, self._beta2, self._epsilon = float(beta1), float(beta2), float(epsilon)
        super().__init__(learning_rate, parameters, weight_decay)

    def _new_acc(self, name, p):
        if name.endswith("_pow_acc"):
            return full([1], 1.0, dtype="float64")
        return zeros_like(p)

    def _update(self, p, g, lr, lr_scale):
        self._adam(p, g, lr, lr_scale, l2=self._weight_decay or 0.0)

    def _adam(self, p, g, lr, lr_scale, l2=0.0, weight_decay=0.0):
        """One fused Adam step (``adam_update``): parameter, moments and beta powers in place."""
        states = tuple(self._acc(n, p) for n in self._accumulator_names)
        apply(OPS["adam_update"], (p, g) + states + (lr,),
              {"beta1": self._beta1, "beta2": self._beta2, "epsilon": self._epsilon, "l2": l2,
               "weight_decay": weight_decay, "lr_scale": lr_scale})


class AdamW(Adam):
    """Adam with decoupled weight decay: ``param *= 1 - lr * weight_decay`` (for parameters
    that ``apply_decay_param_fun(name)`` accepts, default all), then the Adam update.

    Example::

        opt = dt.optimizer.AdamW(1e-3, parameters=model.parameters(), weight_decay=0.01)
    """

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Tensor] | None = None,
                 weight_decay: float = 0.01,
                 apply_decay_param_fun: Callable[[str], bool] | None = None,
                 name: str | None = None):
        super().__init__(learning_rate, beta1, beta2, epsilon, parameters, weight_decay)
        self._apply_decay_param_fun = apply_decay_param_fun

    def _update(self, p, g, lr, lr_scale):
        wd = self._weight_decay
        decays = wd and (self._apply_decay_param_fun is None
                         or self._apply_decay_param_fun(p._label()))
        self._adam(p, g, lr, lr_scale, weight_decay=wd if decays else 0.0)
