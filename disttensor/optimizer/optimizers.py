"""Optimizers (Paddle's ``paddle.optimizer``): SGD (with momentum), Momentum, Adam, AdamW.

``step()`` updates every parameter that has a gradient (``grad is None`` or
``stop_gradient=True``: skipped) with one fused op per parameter (``sgd_update``,
``momentum_update``, ``adam_update``) that updates the parameter and its state tensors in place,
so the parameter object, holder and version counter never change and a distributed parameter
keeps its mesh and placements. State tensors (velocity, moments) are created with
``zeros_like(param)`` and so take the parameter's layout; Adam's beta powers are one-element
float64 tensors updated by the kernel. The learning rate enters each step as a ``host_scalar``
read when the update runs, so a captured step picks up ``set_lr`` and schedulers on replay. A
parameter's ``optimize_attr["learning_rate"]`` (from ``ParamAttr``) and its group's
``learning_rate`` multiply the learning rate. ``grad_clip`` (``dt.nn.ClipGradBy*``) maps the
``(param, grad)`` pairs before the updates; ``.grad`` itself is left as it is (as in Paddle).

``dt.shard_optimizer(opt, shard_fn)`` sets a ``shard_fn(accumulator_name, param, state)`` that
lays out each state tensor when it is created (ZeRO's stages shard them over the data-parallel
mesh dim); the fused update then runs in the merged layout of its inputs.

``weight_decay`` (a float) is L2 regularization for SGD/Momentum/Adam (``grad += wd * param``) and
decoupled decay for AdamW (``param *= 1 - lr * wd`` before the Adam update), as in Paddle.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..dispatch import apply, note_undo
from ..nn.layer import _clear_grads, _copy_into
from ..ops import OPS, full, zeros_like
from ..ops.creation import host_scalar
from ..tape import no_grad
from ..tensor import Tensor
from .groups import param_groups, torch_args
from .lr import LRScheduler

__all__ = ["SGD", "Adam", "AdamW", "Momentum", "Optimizer"]


class Optimizer:
    """Base class: holds the parameter groups, the learning rate (a float or an
    :class:`~disttensor.optimizer.lr.LRScheduler`), the optional ``grad_clip`` and per-parameter
    state tensors. ``step`` issues no collective of its own beyond the clip's norm: each fused
    update runs in the layout of its inputs (a ZeRO-sharded state makes it an update of the dp
    slice plus an all-gather of the parameter).

    Example::

        opt = dt.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        loss.backward(); opt.step(); opt.clear_grad()
    """

    _accumulator_names: tuple[str, ...] = ()
    _group_keys: tuple[str, ...] = ()  # hyperparameters a parameter group may override

    def __init__(self, learning_rate: float | LRScheduler, parameters: Iterable[Any] | None,
                 weight_decay: float | None, grad_clip: Callable | None = None):
        cls = type(self).__name__
        self._learning_rate = self._check_lr(learning_rate)
        if weight_decay is not None and (isinstance(weight_decay, bool)
                                         or not isinstance(weight_decay, (int, float))):
            raise TypeError(f"{cls}: weight_decay must be a float or None, got "
                            f"{type(weight_decay).__name__}")
        if grad_clip is not None and not callable(grad_clip):
            raise TypeError(f"{cls}: grad_clip must be a ClipGradBy* object, got "
                            f"{type(grad_clip).__name__}")
        groups = param_groups(cls, parameters, self._group_keys)
        # flat parameter list + each parameter's group index (lists that hold tensors directly,
        # so code that swaps parameters, as parallelize does, finds them)
        self._parameter_list = [p for g in groups for p in g["params"]]
        self._group_index = [i for i, g in enumerate(groups) for _ in g["params"]]
        self._group_opts = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._weight_decay = None if weight_decay is None else float(weight_decay)
        self._grad_clip = grad_clip
        # accumulator name -> id(param) -> state Tensor
        self._accumulators: dict[str, dict[int, Tensor]] = {n: {} for n in
                                                           self._accumulator_names}
        self._shard_fn: Callable[[str, Tensor, Tensor], Tensor] | None = None

    def _check_lr(self, lr: Any) -> float | LRScheduler:
        if isinstance(lr, LRScheduler):
            return lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating)):
            raise TypeError(f"{type(self).__name__}: learning_rate must be a float or an "
                            f"LRScheduler, got {type(lr).__name__}")
        return float(lr)

    def _hyper(self, group: dict[str, Any], key: str) -> Any:
        """A group's value of hyperparameter ``key``, else the optimizer's."""
        return group[key] if key in group else getattr(self, "_" + key)

    # -- learning rate -------------------------------------------------------------------------
    def get_lr(self) -> float:
        """The current learning rate (a schedule's current value)."""
        lr = self._learning_rate
        return lr() if isinstance(lr, LRScheduler) else lr

    def set_lr(self, value: float) -> None:
        if isinstance(self._learning_rate, LRScheduler):
            raise RuntimeError(f"{type(self).__name__}.set_lr: the learning rate is an "
                               f"LRScheduler; step the scheduler instead")
        lr = self._check_lr(value)
        if isinstance(lr, LRScheduler):
            raise TypeError(f"{type(self).__name__}.set_lr: value must be a float")
        self._learning_rate = lr

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The parameter groups (dicts with "params" and the group's hyperparameters)."""
        return [{"params": [p for p, i in zip(self._parameter_list, self._group_index)
                            if i == k], **opts} for k, opts in enumerate(self._group_opts)]

    def has_states(self) -> bool:
        """Whether any state tensor exists (an update ran, or states were created/loaded)."""
        return any(self._accumulators.values())

    # -- gradients ----------------------------------------------------------------------------
    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Set every parameter's gradient to zeros (Paddle's default) or drop it
        (``set_to_zero=False``)."""
        _clear_grads(self._parameter_list, set_to_zero)

    def zero_grad(self, set_to_none: bool = True, set_to_zero: bool | None = None) -> None:
        """PyTorch's spelling: drop every gradient (``set_to_none=True``, PyTorch's default)
        or set it to zeros; Paddle's ``set_to_zero=`` is accepted too."""
        self.clear_grad(not set_to_none if set_to_zero is None else set_to_zero)

    # -- step -----------------------------------------------------------------------------------
    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (clipped by ``grad_clip``)."""
        pairs, groups = [], []
        for p, i in zip(self._parameter_list, self._group_index):
            if p.stop_gradient or p.grad is None:
                continue
            if list(p.grad.shape) != p.shape:
                raise ValueError(f"{type(self).__name__}.step: gradient of '{p._label()}' "
                                 f"has shape {p.grad.shape}, the parameter {p.shape}")
            pairs.append((p, p.grad))
            groups.append(self._group_opts[i])
        if not pairs:
            return
        if self._grad_clip is not None:
            pairs = self._grad_clip(pairs)
        lr = host_scalar(self.get_lr)
        for (p, g), group in zip(pairs, groups):
            attr = getattr(p, "optimize_attr", None)
            scale = (float(attr["learning_rate"]) if attr else 1.0) * \
                float(group.get("learning_rate", 1.0))
            self._update(p, g, lr, scale, group)

    def _update(self, p: Tensor, g: Tensor, lr: Tensor, lr_scale: float,
                group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _new_acc(self, name: str, p: Tensor) -> Tensor:
        """A fresh state tensor (zeros laid out like the parameter)."""
        return zeros_like(p)

    def _acc_shape(self, name: str, p: Tensor) -> list[int]:
        """The global shape of state ``name`` of ``p``."""
        return p.shape

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
        (zeros, laid out by the ``shard_fn`` if any)."""
        for p in self._parameter_list:
            if not p.stop_gradient:
                for name in self._accumulator_names:
                    self._acc(name, p)

    def _state_keys(self) -> dict[str, tuple[Tensor, str]]:
        """Every state entry this optimizer holds or will hold: key -> (parameter, name)."""
        return {f"{p._label()}_{name}_0": (p, name) for p in self._parameter_list
                if not p.stop_gradient for name in self._accumulator_names}

    def state_dict(self) -> dict[str, Any]:
        """``"<param name>_<accumulator>_0"`` -> state tensor (the live tensor), as in Paddle,
        for every trainable parameter (states not created yet are created: zeros, which is
        what a first update starts from), so a checkpoint can be loaded into it before the
        first step; Adam's beta powers (``b**t`` after t steps) are one-element float64
        tensors ``..._beta1_pow_acc_0`` and ``..._beta2_pow_acc_0``. A schedule's state is
        under ``"LR_Scheduler"``."""
        self.create_states()
        out: dict[str, Any] = {k: self._accumulators[name][id(p)]
                               for k, (p, name) in self._state_keys().items()}
        if isinstance(self._learning_rate, LRScheduler):
            out["LR_Scheduler"] = self._learning_rate.state_dict()
        return out

    def set_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load state saved by :meth:`state_dict`: copied in place into the state tensors
        (created first, with the parameter's layout, where they do not exist yet). With
        ``strict`` (default) a saved entry this optimizer has no use for, or a missing entry,
        raises ``KeyError`` naming the keys; a shape mismatch raises ``ValueError``. Every check
        runs before anything is modified."""
        cls = type(self).__name__
        wanted = self._state_keys()
        sched = self._learning_rate if isinstance(self._learning_rate, LRScheduler) else None
        known = set(wanted) | ({"LR_Scheduler"} if sched else set())
        unused = sorted(set(state_dict) - known)
        missing = sorted(known - set(state_dict))
        if strict and (unused or missing):
            raise KeyError(f"{cls}.set_state_dict: missing keys {missing}, unused keys "
                           f"{unused} (strict=False loads the entries that match)")
        todo = []
        for key, (p, name) in wanted.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            shape = list(value.shape if isinstance(value, Tensor) else np.shape(value))
            want = self._acc_shape(name, p)
            if shape != want:
                raise ValueError(f"{cls}.set_state_dict: '{key}' has shape {shape}, the state "
                                 f"of parameter '{p._label()}' {want}")
            todo.append((p, name, value))
        with no_grad():
            for p, name, value in todo:
                acc = self._acc(name, p)
                if acc is not value:
                    _copy_into(acc, value)
        if sched is not None and "LR_Scheduler" in state_dict:
            sched.set_state_dict(state_dict["LR_Scheduler"])


class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum as in Paddle's Momentum:
    ``v = momentum * v + g``; ``param -= lr * v`` (Nesterov: ``param -= lr * (g + momentum * v)``);
    ``g`` includes the L2 term ``weight_decay * param``. PyTorch's spelling
    ``SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)`` works too.

    Example::

        opt = dt.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    """

    def __init__(self, learning_rate: Any = 0.001, parameters: Iterable[Any] | None = None,
                 weight_decay: float | None = None, momentum: float = 0.0,
                 use_nesterov: bool = False, grad_clip: Callable | None = None,
                 name: str | None = None, *, lr: float | LRScheduler | None = None,
                 nesterov: bool | None = None):
        learning_rate, parameters = torch_args(type(self).__name__, learning_rate, parameters,
                                               lr)
        if not 0.0 <= momentum:
            raise ValueError(f"{type(self).__name__}: momentum must be >= 0, got {momentum}")
        self._momentum = float(momentum)
        self._use_nesterov = bool(use_nesterov if nesterov is None else nesterov)
        self._accumulator_names = ("velocity",) if self._momentum else ()
        super().__init__(learning_rate, parameters, weight_decay, grad_clip)

    def _update(self, p, g, lr, lr_scale, group):
        l2 = self._hyper(group, "weight_decay") or 0.0
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

    def __init__(self, learning_rate: Any = 0.001, momentum: float = 0.9,
                 parameters: Iterable[Any] | None = None, use_nesterov: bool = False,
                 weight_decay: float | None = None, grad_clip: Callable | None = None,
                 name: str | None = None, *, lr: float | LRScheduler | None = None):
        super().__init__(learning_rate, parameters, weight_decay, momentum, use_nesterov,
                         grad_clip, lr=lr)


class Adam(Optimizer):
    """Adam: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``param -= lr * m_hat / (sqrt(v_hat) + epsilon)`` with bias-corrected ``m_hat``, ``v_hat``;
    ``g`` includes the L2 term ``weight_decay * param``. A parameter group may override
    ``beta1``, ``beta2``, ``epsilon`` and ``weight_decay``. PyTorch's spelling
    ``Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8)`` works too.

    Example::

        opt = dt.optimizer.Adam(learning_rate=1e-3, parameters=model.parameters())
    """

    _accumulator_names = ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
    _group_keys = ("beta1", "beta2", "epsilon")

    def __init__(self, learning_rate: Any = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Any] | None = None,
                 weight_decay: float | None = None, grad_clip: Callable | None = None,
                 name: str | None = None, *, lr: float | LRScheduler | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None):
        learning_rate, parameters = torch_args(type(self).__name__, learning_rate, parameters,
                                               lr)
        beta1, beta2 = (beta1, beta2) if betas is None else betas
        epsilon = epsilon if eps is None else eps
        self._beta1, self._beta2, self._epsilon = self._check_betas(beta1, beta2, epsilon)
        super().__init__(learning_rate, parameters, weight_decay, grad_clip)
        for group in self._group_opts:
            self._check_betas(*(self._hyper(group, k) for k in self._group_keys))

    def _check_betas(self, beta1: float, beta2: float, epsilon: float) -> tuple[float, ...]:
        for arg, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{type(self).__name__}: {arg} must be in [0, 1), got {b}")
        if epsilon < 0:
            raise ValueError(f"{type(self).__name__}: epsilon must be >= 0, got {epsilon}")
        return float(beta1), float(beta2), float(epsilon)

    def _new_acc(self, name, p):
        if name.endswith("_pow_acc"):
            return full([1], 1.0, dtype="float64")
        return zeros_like(p)

    def _acc_shape(self, name, p):
        return [1] if name.endswith("_pow_acc") else p.shape

    def _update(self, p, g, lr, lr_scale, group):
        self._adam(p, g, lr, lr_scale, group, l2=self._hyper(group, "weight_decay") or 0.0)

    def _adam(self, p, g, lr, lr_scale, group, l2=0.0, weight_decay=0.0):
        """One fused Adam step (``adam_update``): parameter, moments and beta powers in place."""
        states = tuple(self._acc(n, p) for n in self._accumulator_names)
        apply(OPS["adam_update"], (p, g) + states + (lr,),
              {"beta1": float(self._hyper(group, "beta1")),
               "beta2": float(self._hyper(group, "beta2")),
               "epsilon": float(self._hyper(group, "epsilon")), "l2": l2,
               "weight_decay": weight_decay, "lr_scale": lr_scale})


class AdamW(Adam):
    """Adam with decoupled weight decay: ``param *= 1 - lr * weight_decay`` (for parameters
    that ``apply_decay_param_fun(name)`` accepts, default all; a group's ``weight_decay``
    overrides the optimizer's), then the Adam update.

    Example::

        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        opt = dt.optimizer.AdamW(1e-3, parameters=[{"params": decay, "weight_decay": 0.1},
                                                   {"params": rest, "weight_decay": 0.0}])
    """

    def __init__(self, learning_rate: Any = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, parameters: Iterable[Any] | None = None,
                 weight_decay: float = 0.01,
                 apply_decay_param_fun: Callable[[str], bool] | None = None,
                 grad_clip: Callable | None = None, name: str | None = None, *,
                 lr: float | LRScheduler | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None):
        super().__init__(learning_rate, beta1, beta2, epsilon, parameters, weight_decay,
                         grad_clip, lr=lr, betas=betas, eps=eps)
        self._apply_decay_param_fun = apply_decay_param_fun

    def _update(self, p, g, lr, lr_scale, group):
        wd = self._hyper(group, "weight_decay")
        decays = wd and (self._apply_decay_param_fun is None
                         or self._apply_decay_param_fun(p._label()))
        self._adam(p, g, lr, lr_scale, group, weight_decay=wd if decays else 0.0)
