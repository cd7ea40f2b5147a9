"""The autograd tape: grad modes, grad nodes and :func:`record` (the engine that walks the tape
is :mod:`disttensor.autograd`).

A :class:`GradNode` is recorded for every differentiable op whose inputs need grad. It keeps the
op, its attributes, the values it saved (with the buffer version at save time) and one *edge* per
input: ``None`` (no grad wanted), a leaf :class:`Tensor` (accumulate into ``.grad``) or the
``(node, slot)`` that produced the input. Because edges capture the producer at record time, an
inplace op can re-point ``x._node`` at itself and backward still sees the old producer.
Backward functions are written with registered ops, so they dispatch (and, for distributed
tensors, follow SPMD rules) like the forward.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Sequence

from .tensor import Tensor

__all__ = ["no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "GradNode",
           "record", "edge", "in_backward"]


class _GradMode:
    enabled = True
    backward_depth = 0  # > 0 while the engine runs backward functions


def in_backward() -> bool:
    """True while the autograd engine is running backward functions."""
    return _GradMode.backward_depth > 0


def is_grad_enabled() -> bool:
    return _GradMode.enabled


class set_grad_enabled(contextlib.ContextDecorator):
    """Context manager / decorator that sets whether ops record grad nodes."""

    def __init__(self, mode: bool):
        self.mode = bool(mode)

    def __enter__(self):
        self.prev = _GradMode.enabled
        _GradMode.enabled = self.mode

    def __exit__(self, *exc):
        _GradMode.enabled = self.prev
        return False


def no_grad(func: Callable | None = None):
    """``with dt.no_grad():`` or ``@dt.no_grad()`` / ``@dt.no_grad``: ops record no graph."""
    if callable(func):
        @functools.wraps(func)
        def wrapper(*a, **k):
            with set_grad_enabled(False):
                return func(*a, **k)
        return wrapper
    return set_grad_enabled(False)


def enable_grad():
    return set_grad_enabled(True)


class GradNode:
    """One recorded op application (see module docstring)."""

    __slots__ = ("op", "attrs", "edges", "saved", "in_shapes", "n_out", "released",
                 "in_dtypes", "__weakref__")

    def __init__(self, op, attrs: dict, edges: tuple, in_shapes: tuple, n_out: int,
                 in_dtypes: tuple):
        self.op = op
        self.n_out = n_out
        self.attrs = attrs
        self.edges = edges
        self.saved: list | None = []
        self.in_shapes = in_shapes
        # the inputs' dtypes: the engine casts each input gradient to its input's dtype
        self.in_dtypes = in_dtypes
        self.released = False

    @property
    def name(self) -> str:
        return self.op.name

    def save(self, t: Tensor | None, at: int | None = None) -> None:
        """Save ``t`` (with its buffer's version) after the others, or as saved value ``at``."""
        entry = None
        if t is not None:
            dense = t._local_dense()
            # a weak reference: an output saving itself must not make a reference cycle
            entry = (t._value, dense.holder, dense.holder.version, weakref.ref(t))
        if at is None:
            self.saved.append(entry)
        else:
            self.saved[at] = entry

    def saved_tensor(self, i: int) -> Tensor | None:
        """The i-th saved value as a fresh Tensor, after checking its buffer was not modified."""
        if self.released:
            raise RuntimeError(
                f"backward of {self.op.name}: trying to backward through the graph a second "
                "time, but its saved tensors were freed; pass retain_graph=True to the first "
                "backward")
        entry = self.saved[i]
        if entry is None:
            return None
        value, holder, version, src = entry
        if holder.version != version:
            src = src()
            label = src._label() if src is not None else "(freed)"
            raise RuntimeError(
                f"backward of {self.op.name}: tensor '{label}' saved for backward was "
                f"modified by an inplace operation: its inplace version is {holder.version}, "
                f"expected version {version}")
        return Tensor(value, stop_gradient=True)

    def needs_grad(self, i: int) -> bool:
        return self.edges[i] is not None


def edge(t: Tensor | None):
    if t is None or t.stop_gradient:
        return None
    if t._node is None:
        return t
    return (t._node, t._slot)


def record(op, attrs: dict, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor],
           consumed: dict | None = None) -> GradNode:
    """Attach a new grad node for ``op`` to ``outputs`` (called by the dispatcher).
    ``consumed`` maps an input index to the value the kernel read in its place (the input
    resharded): that value is saved for backward instead of the input."""
    edges = []
    shapes = []
    dtypes = []
    for t in inputs:  # inlines _edge (this runs for every recorded op)
        if t is None:
            edges.append(None)
            shapes.append(None)
            dtypes.append(None)
            continue
        v = t._value
        shapes.append(v.shape)
        dtypes.append(v.dtype)
        if t.stop_gradient:
            edges.append(None)
        elif t._node is None:
            edges.append(t)
        else:
            edges.append((t._node, t._slot))
    node = GradNode(op, attrs, tuple(edges), tuple(shapes), len(outputs), tuple(dtypes))
    for i in op.save_inputs:
        node.save(consumed.get(i, inputs[i]) if consumed else inputs[i])
    for i in op.save_outputs:
        if outputs[i] is not None:
            node.save(outputs[i])
    nondiff = op.nondiff_outputs
    for slot, out in enumerate(outputs):
        if out is not None and slot not in nondiff:
            out._node = node
            out._slot = slot
            out.stop_gradient = False
    return node


