"""Reverse-mode autograd: a tape of grad nodes and the engine that walks it.

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
import weakref
import functools
from typing import Callable, Iterable, Sequence

from .tensor import Tensor

__all__ = ["no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "grad",
           "run_backward", "GradNode"]


class _GradMode:
    enabled = True


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
                 "__weakref__")

    def __init__(self, op, attrs: dict, edges: tuple, in_shapes: tuple, n_out: int):
        self.op = op
        self.n_out = n_out
        self.attrs = attrs
        self.edges = edges
        self.saved: list | None = []
        self.in_shapes = in_shapes
        self.released = False

    @property
    def name(self) -> str:
        return self.op.name

    def save(self, t: Tensor | None) -> None:
        if t is None:
            self.saved.append(None)
            return
        dense = t._local_dense()
        # a weak reference: an output saving itself must not make a reference cycle
        self.saved.append((t._value, dense.holder, dense.holder.version, weakref.ref(t)))

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


def _edge(t: Tensor | None):
    if t is None or t.stop_gradient:
        return None
    if t._node is None:
        return t
    return (t._node, t._slot)


def record(op, attrs: dict, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor]) -> GradNode:
    """Attach a new grad node for ``op`` to ``outputs`` (called by the dispatcher)."""
    edges = []
    shapes = []
    for t in inputs:  # inlines _edge (this runs for every recorded op)
        if t is None:
            edges.append(None)
            shapes.append(None)
            continue
        shapes.append(t._value.shape)
        if t.stop_gradient:
            edges.append(None)
        elif t._node is None:
            edges.append(t)
        else:
            edges.append((t._node, t._slot))
    node = GradNode(op, attrs, tuple(edges), tuple(shapes), len(outputs))
    for i in op.save_inputs:
        node.save(inputs[i])
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


def _ones_like(t: Tensor) -> Tensor:
    from .ops import ones_like

    return ones_like(t)


def run_backward(roots: Sequence[Tensor], root_grads: Sequence[Tensor | None],
                 retain_graph: bool = False, inputs: Sequence[Tensor] | None = None
                 ) -> list[Tensor | None] | None:
    """Propagate gradients from ``roots`` through the recorded graph.

    Without ``inputs``: accumulate into every reachable leaf's ``.grad`` (resharded to the
    leaf's own layout). With ``inputs``: return d(roots)/d(inputs) and touch no ``.grad``.
    """
    from .ops.registry import to_leaf_layout

    node_grads: dict[int, list] = {}  # id(node) -> per-slot grads
    nodes: dict[int, GradNode] = {}
    leaf_grads: dict[int, Tensor] = {}
    leaves: dict[int, Tensor] = {}
    for r, g in zip(roots, root_grads):
        if r.stop_gradient:
            raise RuntimeError(f"backward: tensor '{r._label()}' has stop_gradient=True; there "
                               "is nothing to differentiate")
        if g is None:
            if r.size != 1:
                raise ValueError(f"backward: grad_tensor is required for tensor '{r._label()}' "
                                 f"of shape {r.shape}; only one-element tensors get an implicit "
                                 "grad of ones")
            g = _ones_like(r)
        elif not isinstance(g, Tensor):
            raise TypeError(f"backward: grad_tensor must be a Tensor, got {type(g).__name__}")
        elif g.shape != r.shape:
            raise ValueError(f"backward: grad_tensor shape {g.shape} differs from tensor "
                             f"'{r._label()}' shape {r.shape}")
        _send(_edge(r), g, nodes, node_grads, leaves, leaf_grads)

    deps = _dependencies(nodes.values())
    capture = {}
    if inputs is not None:
        for i, t in enumerate(inputs):
            if t._node is not None:
                capture.setdefault(id(t._node), []).append((t._slot, i))
    result: list[Tensor | None] = [None] * (0 if inputs is None else len(inputs))

    ready = [n for k, n in nodes.items() if deps.get(k, 0) == 0]
    with set_grad_enabled(False):
        while ready:
            node = ready.pop()
            key = id(node)
            out_grads = node_grads.pop(key)
            for slot, i in capture.get(key, ()):
                result[i] = out_grads[slot]
            if node.released:
                node.saved_tensor(0)  # raises the "backward a second time" error
            in_grads = node.op.backward(node, *out_grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if not retain_graph:
                node.saved = None
                node.released = True
            for edge, g in zip(node.edges, in_grads):
                if edge is None or g is None:
                    continue
                _send(edge, g, nodes, node_grads, leaves, leaf_grads)
                if type(edge) is tuple:
                    k = id(edge[0])
                    deps[k] -= 1
                    if deps[k] == 0:
                        ready.append(edge[0])

        if inputs is not None:
            for i, t in enumerate(inputs):
                if t._node is None and id(t) in leaf_grads:
                    result[i] = leaf_grads[id(t)]
            return result
        for k, g in leaf_grads.items():
            leaf = leaves[k]
            g = to_leaf_layout(leaf, g)
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    return None


def _send(edge, g: Tensor, nodes: dict, node_grads: dict, leaves: dict, leaf_grads: dict) -> None:
    """Add gradient ``g`` to the destination of ``edge`` (a leaf or a (node, slot))."""
    if type(edge) is tuple:
        node, slot = edge
        k = id(node)
        if k not in nodes:
            nodes[k] = node
            node_grads[k] = [None] * node.n_out
        buf = node_grads[k]
        buf[slot] = g if buf[slot] is None else buf[slot] + g
    else:
        k = id(edge)
        leaves[k] = edge
        prev = leaf_grads.get(k)
        leaf_grads[k] = g if prev is None else prev + g


def _dependencies(roots: Iterable[GradNode]) -> dict[int, int]:
    """For each node reachable from ``roots``: how many edges of reachable nodes point at it."""
    deps: dict[int, int] = {}
    seen = set()
    stack = list(roots)
    for n in stack:
        seen.add(id(n))
    while stack:
        n = stack.pop()
        for e in n.edges:
            if type(e) is tuple:
                k = id(e[0])
                deps[k] = deps.get(k, 0) + 1
                if k not in seen:
                    seen.add(k)
                    stack.append(e[0])
    return deps


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool = False) -> list[Tensor | None]:
    """d(outputs)/d(inputs) as a list, without touching ``.grad`` (Paddle's ``paddle.grad``)."""
    if create_graph:
        raise NotImplementedError("grad: create_graph=True (higher-order gradients) is not "
                                  "supported")
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    inputs_l = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    res = run_backward(outputs, list(grad_outputs), retain_graph=bool(retain_graph),
                       inputs=inputs_l)
    if not allow_unused:
        for t, g in zip(inputs_l, res):
            if g is None:
                raise ValueError(f"grad: input '{t._label()}' is not reachable from the outputs; "
                                 "pass allow_unused=True to get None for it")
    return res
