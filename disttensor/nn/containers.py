"""Containers registering their items with the enclosing layer (Paddle's ``LayerDict`` and
``ParameterList``): parameters, ``state_dict``, ``to`` and the parallel plans see them."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from .layer import Layer, Parameter

__all__ = ["LayerDict", "ParameterList"]


class LayerDict(Layer):
    """Sublayers by name, in insertion order; it has no forward.

    Example::

        heads = dt.nn.LayerDict({"lm": dt.nn.Linear(8, 16), "cls": dt.nn.Linear(8, 2)})
        logits = heads["lm"](h)
    """

    def __init__(self, sublayers: Mapping[str, Layer] | Iterable[tuple[str, Layer]] | None = None):
        super().__init__()
        if sublayers is not None:
            self.update(sublayers)

    def __getitem__(self, key: str) -> Layer:
        if key not in self._sub_layers:
            raise KeyError(f"LayerDict: no sublayer {key!r}; keys: {list(self._sub_layers)}")
        return self._sub_layers[key]

    def __setitem__(self, key: str, sublayer: Layer) -> None:
        self.add_sublayer(key, sublayer)

    def __delitem__(self, key: str) -> None:
        self[key]  # noqa: B018 - the KeyError naming the keys
        del self._sub_layers[key]

    def __len__(self) -> int:
        return len(self._sub_layers)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sub_layers)

    def __contains__(self, key: object) -> bool:
        return key in self._sub_layers

    def keys(self) -> Iterable[str]:
        return self._sub_layers.keys()

    def values(self) -> Iterable[Layer]:
        return self._sub_layers.values()

    def items(self) -> Iterable[tuple[str, Layer]]:
        return self._sub_layers.items()

    def clear(self) -> None:
        self._sub_layers.clear()

    def pop(self, key: str) -> Layer:
        layer = self[key]
        del self[key]
        return layer

    def update(self, sublayers: Mapping[str, Layer] | Iterable[tuple[str, Layer]]) -> None:
        """Add (or replace) sublayers from a mapping or from (name, layer) pairs."""
        items = sublayers.items() if isinstance(sublayers, Mapping) else sublayers
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"LayerDict.update: item {i} must be a (name, Layer) pair, got "
                                f"{type(item).__name__}")
            self.add_sublayer(item[0], item[1])


class ParameterList(Layer):
    """Parameters registered as "0", "1", ...; it has no forward.

    Example::

        scales = dt.nn.ParameterList([dt.nn.Layer().create_parameter([4]) for _ in range(3)])
    """

    def __init__(self, parameters: Iterable[Parameter] | None = None):
        super().__init__()
        for p in parameters or ():
            self.append(p)

    def _index(self, idx: int) -> int:
        n = len(self._parameters)
        if isinstance(idx, bool) or not isinstance(idx, int) or not -n <= idx < n:
            raise IndexError(f"ParameterList: index {idx!r} is out of range for {n} parameters")
        return idx % n

    def __getitem__(self, idx: int) -> Parameter:
        return self._parameters[str(self._index(idx))]

    def __setitem__(self, idx: int, parameter: Parameter) -> None:
        if not isinstance(parameter, Parameter):
            raise TypeError(f"ParameterList: item {idx} must be a Parameter, got "
                            f"{type(parameter).__name__}")
        self._parameters[str(self._index(idx))] = parameter  # in place: the order stays

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self) -> Iterator[Parameter]:
        return iter(self._parameters.values())

    def append(self, parameter: Parameter) -> "ParameterList":
        self.add_parameter(str(len(self._parameters)), parameter)
        return self

    def extend(self, parameters: Iterable[Parameter]) -> "ParameterList":
        for p in parameters:
            self.append(p)
        return self

    def extra_repr(self) -> str:
        return ", ".join(f"{k}: {list(p.shape)}" for k, p in self._parameters.items()
                         if p is not None)
