"""``Layer``: the base class of models (Paddle's ``paddle.nn.Layer``), ``ParamAttr`` and
``Parameter`` (defined in ``disttensor/parameter.py``, below the runtime's user API).

A Layer owns parameters, sublayers and buffers, registered by attribute assignment (a
:class:`Parameter` -> parameter, a :class:`Layer` -> sublayer; buffers through
:meth:`Layer.register_buffer`). ``state_dict`` maps structured names (``"0.weight"``,
``"bn._mean"``) to the live tensors; ``set_state_dict`` copies values into them inplace, so the
tensors keep their identity, views, mesh and placements.
"""
from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..dispatch import wrap_array
from ..dtype import is_floating, to_np_dtype
from ..ops import cast, to_tensor, zeros, zeros_like
from ..ops.common import as_tensor
from ..parameter import Parameter
from ..tape import no_grad
from ..tensor import Tensor
from .initializer import Constant, Initializer, XavierUniform
from .torch_names import IncompatibleKeys, TorchLayerNames

__all__ = ["Layer", "Parameter", "ParamAttr", "create_parameter", "IncompatibleKeys"]


class ParamAttr:
    """How to create a parameter: its ``name``, ``initializer``, ``learning_rate`` multiplier and
    whether it is ``trainable``. ``weight_attr=False`` / ``bias_attr=False`` means no parameter."""

    def __init__(self, name: str | None = None, initializer: Initializer | None = None,
                 learning_rate: float = 1.0, trainable: bool = True):
        if initializer is not None and not callable(initializer):
            raise TypeError(f"ParamAttr: initializer must be an Initializer, got "
                            f"{type(initializer).__name__}")
        self.name = name
        self.initializer = initializer
        self.learning_rate = float(learning_rate)
        self.trainable = bool(trainable)

    @staticmethod
    def _to_attr(attr: Any) -> "ParamAttr | bool":
        """Normalize None / False / a name / an Initializer / a ParamAttr."""
        if attr is None:
            return ParamAttr()
        if attr is False:
            return False
        if isinstance(attr, ParamAttr):
            return attr
        if isinstance(attr, str):
            return ParamAttr(name=attr)
        if isinstance(attr, Initializer):
            return ParamAttr(initializer=attr)
        raise TypeError(f"ParamAttr: expected None, False, a name, an Initializer or a ParamAttr, "
                        f"got {type(attr).__name__}")

    def __repr__(self) -> str:
        return (f"ParamAttr(name={self.name!r}, initializer={self.initializer!r}, "
                f"learning_rate={self.learning_rate}, trainable={self.trainable})")


_name_counters: dict[str, int] = {}

#: Set while ``disttensor.parallel.LazyGuard`` is active: ``make(shape, dtype, initializer,
#: name, trainable, learning_rate)`` returns a parameter whose values are sampled later.
lazy_parameter_factory: list[Callable[..., "Parameter"]] = []


def _unique_name(prefix: str) -> str:
    k = _name_counters.get(prefix, 0)
    _name_counters[prefix] = k + 1
    return f"{prefix}_{k}"


def create_parameter(shape: Sequence[int], dtype: Any = "float32", name: str | None = None,
                     attr: Any = None, is_bias: bool = False,
                     default_initializer: Initializer | None = None) -> Parameter | None:
    """A new :class:`Parameter` of ``shape`` (Paddle's ``paddle.create_parameter``).

    The initializer is ``attr.initializer``, else ``default_initializer``, else ``Constant(0)``
    for a bias and ``XavierUniform()`` for a weight (Paddle's defaults). Returns None when
    ``attr`` is False.
    """
    attr = ParamAttr._to_attr(attr)
    if attr is False:
        return None
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"create_parameter: shape must be a sequence of ints, got "
                        f"{shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"create_parameter: shape {list(shape)} has a negative dim")
    d = to_np_dtype("float32" if dtype is None else dtype)
    init = attr.initializer or default_initializer or (Constant(0.0) if is_bias
                                                       else XavierUniform())
    pname = attr.name or name or _unique_name("_generated_var" if not is_bias else "_bias")
    if isinstance(init, Initializer) and lazy_parameter_factory:
        return lazy_parameter_factory[-1](shape, d, init, pname, attr.trainable,
                                          attr.learning_rate)
    if isinstance(init, Initializer):
        value = to_tensor(init.sample(shape, d), dtype=d)._value
        return Parameter(value, pname, attr.trainable, attr.learning_rate)
    param = Parameter(zeros(shape, dtype=d)._value, pname, attr.trainable, attr.learning_rate)
    init(param)
    return param


class HookRemoveHelper:
    """Returned by the ``register_*_hook`` methods; ``remove()`` unregisters the hook."""

    _next_id = 0

    def __init__(self, hooks: dict):
        self._hooks = hooks
        self._id = HookRemoveHelper._next_id
        HookRemoveHelper._next_id += 1

    def remove(self) -> None:
        self._hooks.pop(self._id, None)


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


class Layer(TorchLayerNames):
    """Base class of all layers; subclasses define ``forward``.

    Attributes holding a :class:`Parameter` or a :class:`Layer` are registered as parameters /
    sublayers (in assignment order); assigning a Tensor to a registered parameter or buffer name
    replaces that entry; assigning None clears it.
    """

    def __init__(self, name_scope: str | None = None, dtype: Any = "float32"):
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_sub_layers", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistable_buffer_names_set", set())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())
        object.__setattr__(self, "_forward_post_hooks", OrderedDict())
        object.__setattr__(self, "_dtype", to_np_dtype(dtype))
        object.__setattr__(self, "_full_name",
                           _unique_name(name_scope or _snake(type(self).__name__)))
        object.__setattr__(self, "_param_counts", {"w": 0, "b": 0})

    # -- registration ----------------------------------------------------------------------------
    def _check_init(self, what: str) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}: call super().__init__() before "
                               f"assigning {what}")

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if isinstance(value, Parameter):
            self._check_init(f"parameter '{name}'")
            if name not in d["_parameters"]:  # a re-assignment keeps the registration order
                self._drop(name)
            d["_parameters"][name] = value
        elif isinstance(value, Layer):
            self._check_init(f"sublayer '{name}'")
            if name not in d["_sub_layers"]:
                self._drop(name)
            d["_sub_layers"][name] = value
        elif "_parameters" in d and name in d["_parameters"]:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"{type(self).__name__}: parameter '{name}' must be assigned a "
                                f"Tensor or None, got {type(value).__name__}")
            d["_parameters"][name] = value
        elif "_sub_layers" in d and name in d["_sub_layers"]:
            if value is not None:
                raise TypeError(f"{type(self).__name__}: sublayer '{name}' must be assigned a "
                                f"Layer or None, got {type(value).__name__}")
            d["_sub_layers"][name] = None
        elif "_buffers" in d and name in d["_buffers"]:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"{type(self).__name__}: buffer '{name}' must be assigned a "
                                f"Tensor or None, got {type(value).__name__}")
            d["_buffers"][name] = value
        else:
            object.__setattr__(self, name, value)

    def _drop(self, name: str) -> None:
        d = self.__dict__
        d.pop(name, None)
        for store in ("_parameters", "_sub_layers", "_buffers"):
            d[store].pop(name, None)
        d["_non_persistable_buffer_names_set"].discard(name)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for store in ("_parameters", "_sub_layers", "_buffers"):
            if store in d and name in d[store]:
                return d[store][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        d = self.__dict__
        for store in ("_parameters", "_sub_layers", "_buffers"):
            if name in d.get(store, ()):
                del d[store][name]
                d["_non_persistable_buffer_names_set"].discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        extra = [k for s in ("_parameters", "_sub_layers", "_buffers") for k in self.__dict__[s]]
        return list(super().__dir__()) + extra

    def full_name(self) -> str:
        """The layer's unique name (``linear_0``), used to name its parameters."""
        return self._full_name

    def create_parameter(self, shape: Sequence[int], attr: Any = None, dtype: Any = None,
                         is_bias: bool = False,
                         default_initializer: Initializer | None = None) -> Parameter | None:
        """A new parameter named ``<full_name>.w_<k>`` (``.b_<k>`` for a bias), in the layer's
        dtype unless ``dtype`` is given; see :func:`create_parameter`. Not registered until
        assigned to an attribute (or passed to :meth:`add_parameter`)."""
        attr = ParamAttr._to_attr(attr)
        if attr is False:
            return None
        kind = "b" if is_bias else "w"
        k = self._param_counts[kind]
        self._param_counts[kind] = k + 1
        return create_parameter(shape, self._dtype if dtype is None else dtype,
                                f"{self._full_name}.{kind}_{k}", attr, is_bias,
                                default_initializer)

    def add_parameter(self, name: str, parameter: Parameter | None) -> Parameter | None:
        """Register ``parameter`` (or None) under ``name``; returns it."""
        self._check_name("add_parameter", name)
        if parameter is not None and not isinstance(parameter, Parameter):
            raise TypeError(f"{type(self).__name__}.add_parameter: '{name}' must be a Parameter "
                            f"(see create_parameter), got {type(parameter).__name__}")
        self._drop(name)
        self._parameters[name] = parameter
        return parameter

    def add_sublayer(self, name: str, sublayer: "Layer | None") -> "Layer | None":
        """Register ``sublayer`` (or None) under ``name``; returns it."""
        self._check_name("add_sublayer", name)
        if sublayer is not None and not isinstance(sublayer, Layer):
            raise TypeError(f"{type(self).__name__}.add_sublayer: '{name}' must be a Layer, got "
                            f"{type(sublayer).__name__}")
        self._drop(name)
        self._sub_layers[name] = sublayer
        return sublayer

    def register_buffer(self, name: str, tensor: Tensor | None, persistable: bool = True) -> None:
        """Register a non-trainable tensor (running statistics, ...); persistable buffers are in
        ``state_dict``."""
        self._check_name("register_buffer", name)
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"{type(self).__name__}.register_buffer: '{name}' must be a Tensor "
                            f"or None, got {type(tensor).__name__}")
        self._drop(name)
        self._buffers[name] = tensor
        if not persistable:
            self._non_persistable_buffer_names_set.add(name)
        elif tensor is not None:
            tensor.persistable = True

    def _check_name(self, method: str, name: str) -> None:
        self._check_init(f"'{name}'")
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"{type(self).__name__}.{method}: name must be a non-empty str "
                             f"without '.', got {name!r}")

    # -- traversal -------------------------------------------------------------------------------
    def named_sublayers(self, prefix: str = "", include_self: bool = False,
                        layers_set: set | None = None) -> Iterator[tuple[str, "Layer"]]:
        """(structured name, layer) for every sublayer, depth first, each layer once."""
        if layers_set is None:
            layers_set = set()
        if include_self and id(self) not in layers_set:
            layers_set.add(id(self))
            yield prefix, self
        for key, layer in self._sub_layers.items():
            if layer is None or id(layer) in layers_set:
                continue
            sub = f"{prefix}.{key}" if prefix else key
            layers_set.add(id(layer))
            yield sub, layer
            yield from layer.named_sublayers(sub, False, layers_set)

    def sublayers(self, include_self: bool = False) -> list["Layer"]:
        return [layer for _, layer in self.named_sublayers(include_self=include_self)]

    def named_children(self) -> Iterator[tuple[str, "Layer"]]:
        seen = set()
        for key, layer in self._sub_layers.items():
            if layer is not None and id(layer) not in seen:
                seen.add(id(layer))
                yield key, layer

    def children(self) -> Iterator["Layer"]:
        for _, layer in self.named_children():
            yield layer

    def _named_members(self, store: str, prefix: str, include_sublayers: bool):
        seen = set()
        layers = (self.named_sublayers(prefix, include_self=True) if include_sublayers
                  else [(prefix, self)])
        for lname, layer in layers:
            for key, t in layer.__dict__[store].items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{lname}.{key}" if lname else key), t

    def named_parameters(self, prefix: str = "", include_sublayers: bool = True
                         ) -> Iterator[tuple[str, Parameter]]:
        """(structured name, parameter) pairs; a shared parameter appears once."""
        return self._named_members("_parameters", prefix, include_sublayers)

    def parameters(self, include_sublayers: bool = True) -> list[Parameter]:
        return [p for _, p in self.named_parameters(include_sublayers=include_sublayers)]

    def named_buffers(self, prefix: str = "", include_sublayers: bool = True
                      ) -> Iterator[tuple[str, Tensor]]:
        return self._named_members("_buffers", prefix, include_sublayers)

    def buffers(self, include_sublayers: bool = True) -> list[Tensor]:
        return [b for _, b in self.named_buffers(include_sublayers=include_sublayers)]

    def apply(self, fn: Callable[["Layer"], Any]) -> "Layer":
        """Call ``fn`` on every sublayer (children first) and then on self."""
        for layer in self.children():
            layer.apply(fn)
        fn(self)
        return self

    # -- state -------------------------------------------------------------------------------
    def state_dict(self, destination: dict | None = None, include_sublayers: bool = True,
                   structured_name_prefix: str = "") -> "OrderedDict[str, Tensor]":
        """Structured name -> the live parameter / persistable buffer tensor (not copies)."""
        out = OrderedDict() if destination is None else destination
        layers = (self.named_sublayers(include_self=True) if include_sublayers
                  else [("", self)])
        for lname, layer in layers:
            pre = structured_name_prefix + (f"{lname}." if lname else "")
            for key, p in layer._parameters.items():
                if p is not None:
                    out[pre + key] = p
            for key, b in layer._buffers.items():
                if b is not None and key not in layer._non_persistable_buffer_names_set:
                    out[pre + key] = b
        return out

    def set_state_dict(self, state_dict: Mapping, use_structured_name: bool = True,
                       strict: bool = False) -> IncompatibleKeys:
        """Copy the values of ``state_dict`` (Tensors or arrays) into this layer's tensors inplace.

        Tensors keep their identity, dtype, views, mesh and placements. Returns
        ``(missing_keys, unexpected_keys)`` (a named tuple, as Paddle and PyTorch return): the
        layer's keys absent from ``state_dict`` and the keys of ``state_dict`` the layer lacks.
        Those are warned about; with ``strict=True`` they raise ValueError naming them instead.
        A shape mismatch raises ValueError naming the key and both shapes. Every check runs
        before anything is copied. With ``use_structured_name=False`` keys are the tensors'
        ``name``s instead. No communication.

        Example::

            missing, unexpected = model.set_state_dict(other.state_dict())
        """
        fn = f"{type(self).__name__}.set_state_dict"
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"{fn}: expected a dict, got {type(state_dict).__name__}")
        own = self.state_dict()
        if not use_structured_name:
            own = OrderedDict((t.name, t) for t in own.values())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise ValueError(f"{fn}: the state dict does not match the layer (strict=True): "
                             f"missing keys {missing}, unexpected keys {unexpected}")
        pairs = []
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, Tensor):
                value = np.asarray(value)
            shape = list(value.shape)
            if shape != target.shape:
                raise ValueError(f"{fn}: '{key}' has shape {shape} in the state dict but "
                                 f"{target.shape} in the layer")
            pairs.append((target, value))
        with no_grad():
            for target, value in pairs:
                _copy_into(target, value)
        if missing or unexpected:
            warnings.warn(f"{fn}: missing keys {missing}, unexpected keys {unexpected}",
                          stacklevel=2)
        return IncompatibleKeys(missing, unexpected)

    set_dict = set_state_dict
    load_dict = set_state_dict

    # -- modes, hooks, call ----------------------------------------------------------------------
    def train(self) -> "Layer":
        """Training mode for this layer and every sublayer (dropout active, batch statistics)."""
        for layer in self.sublayers(include_self=True):
            object.__setattr__(layer, "training", True)
        return self

    def eval(self) -> "Layer":
        """Inference mode for this layer and every sublayer."""
        for layer in self.sublayers(include_self=True):
            object.__setattr__(layer, "training", False)
        return self

    def register_forward_pre_hook(self, hook: Callable) -> HookRemoveHelper:
        """``hook(layer, inputs)`` runs before ``forward``; a non-None result replaces the
        inputs (a non-tuple is wrapped in a 1-tuple)."""
        handle = HookRemoveHelper(self._forward_pre_hooks)
        self._forward_pre_hooks[handle._id] = hook
        return handle

    def register_forward_post_hook(self, hook: Callable) -> HookRemoveHelper:
        """``hook(layer, inputs, output)`` runs after ``forward``; a non-None result replaces
        the output."""
        handle = HookRemoveHelper(self._forward_post_hooks)
        self._forward_post_hooks[handle._id] = hook
        return handle

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        for hook in list(self._forward_pre_hooks.values()):
            res = hook(self, inputs)
            if res is not None:
                inputs = res if isinstance(res, tuple) else (res,)
        out = self.forward(*inputs, **kwargs)
        for hook in list(self._forward_post_hooks.values()):
            res = hook(self, inputs, out)
            if res is not None:
                out = res
        return out

    def clear_gradients(self, set_to_zero: bool = True) -> None:
        """Set every parameter's gradient to zeros (or drop it when ``set_to_zero`` is False)."""
        _clear_grads(self.parameters(), set_to_zero)

    def to(self, device: Any = None, dtype: Any = None, blocking: Any = None) -> "Layer":
        """Move parameters and buffers to ``device`` ("cpu", "gpu", "gpu:N"; "cuda[:N]" is read
        as "gpu[:N]") and convert the floating ones to ``dtype``, in place of their values (the
        tensor objects, and their mesh and placements, are kept; gradients are dropped).
        Optimizer states made before the move stay where they were: move first."""
        if device is not None:
            place = str(device).replace("cuda", "gpu", 1)
            if not re.fullmatch(r"cpu|gpu(:\d+)?", place):
                raise ValueError(f"{type(self).__name__}.to: argument 'device' must be 'cpu', "
                                 f"'gpu' or 'gpu:N', got {device!r}")
            for t in self.parameters() + self.buffers():
                if t.place != ("gpu:0" if place == "gpu" else place):
                    _move(t, place)
        if dtype is None:
            return self
        return self._cast_floating(dtype, None, "to")

    # -- dtype conversion: float(), half(), bfloat16() -------------------------------------
    def float(self, excluded_layers: Any = None) -> "Layer":
        """Convert floating parameters and buffers to float32 in place of their values (as
        ``to(dtype="float32")``), except in ``excluded_layers`` (Layer instances or types)."""
        return self._cast_floating("float32", excluded_layers, "float")

    def half(self, excluded_layers: Any = None) -> "Layer":
        """As :meth:`float`, to float16."""
        return self._cast_floating("float16", excluded_layers, "half")

    def bfloat16(self, excluded_layers: Any = None) -> "Layer":
        """As :meth:`float`, to bfloat16."""
        return self._cast_floating("bfloat16", excluded_layers, "bfloat16")

    float16 = half

    def _cast_floating(self, dtype: Any, excluded_layers: Any, where: str) -> "Layer":
        """Cast the floating parameters and buffers of every sublayer not excluded (a Layer, a
        Layer type, or a list of them) to ``dtype``; the tensor objects are kept, gradients
        dropped. Bad arguments raise before anything is converted."""
        try:
            d = to_np_dtype(dtype)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}.{where}: argument 'dtype': {e}") from None
        if not is_floating(d):
            raise TypeError(f"{type(self).__name__}.{where}: argument 'dtype' must be a floating "
                            f"dtype, got {d.name}")
        excluded = excluded_layers if isinstance(excluded_layers, (list, tuple)) else (
            () if excluded_layers is None else (excluded_layers,))
        for e in excluded:
            if not (isinstance(e, Layer) or isinstance(e, type) and issubclass(e, Layer)):
                raise TypeError(f"{type(self).__name__}.{where}: argument 'excluded_layers' "
                                f"must hold Layers or Layer types, got {e!r}")
        types = tuple(e for e in excluded if isinstance(e, type))
        with no_grad():
            for layer in self.sublayers(include_self=True):
                if isinstance(layer, types) or any(layer is e for e in excluded):
                    continue
                for t in list(layer._parameters.values()) + list(layer._buffers.values()):
                    if t is not None and is_floating(t.dtype) and np.dtype(t.dtype) != d:
                        t._value = cast(t, d)._value
                        t.grad = None
                object.__setattr__(layer, "_dtype", d)
        return self

    def extra_repr(self) -> str:
        """Extra text inside this layer's ``repr`` (its configuration)."""
        return ""

    def __repr__(self) -> str:
        lines = []
        for key, layer in self._sub_layers.items():
            body = repr(layer).replace("\n", "\n  ")
            lines.append(f"({key}): {body}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        inner = ([extra] if extra else []) + lines
        return type(self).__name__ + "(\n  " + "\n  ".join(inner) + "\n)"


def _move(t: Tensor, place: str) -> None:
    """``t``'s value (its piece, when distributed) copied to ``place`` by ``to_tensor``, kept
    under t's mesh and placements; the gradient is dropped."""
    arr = t._local_array()
    piece = to_tensor(arr, dtype=arr.dtype, place=place)._local_array()
    v = t._value
    t._value = (wrap_array(piece, v.mesh, v.dist_attr, v.shape) if t.is_dist()
                else wrap_array(piece))._value
    t.grad = None


def _copy_into(target: Tensor, value: Any) -> None:
    """Write ``value`` into ``target`` inplace (kept: identity, dtype, views, placements)."""
    if isinstance(value, Tensor):
        if np.dtype(value.dtype) != np.dtype(target.dtype):
            value = cast(value, target.dtype)
    else:
        value = as_tensor(np.asarray(value, dtype=target.dtype), target)
    target.copy_(value)


def _clear_grads(params: Sequence[Tensor], set_to_zero: bool) -> None:
    """Zero (a fresh zero tensor: a grad may alias another tensor) or drop each ``.grad``."""
    with no_grad():
        for p in params:
            if p.grad is not None:
                p.grad = zeros_like(p.grad) if set_to_zero else None
