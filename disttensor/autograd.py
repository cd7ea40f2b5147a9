"""Reverse-mode autograd: the engine that walks the tape (:mod:`disttensor.tape`) and the
public functions ``grad`` and ``backward`` (Paddle's ``paddle.grad`` / ``paddle.autograd``).

The engine counts dependencies, then runs each grad node's backward (built from registered ops,
so it dispatches through the same seam and rules as the forward) once all its output grads have
arrived. A leaf's gradient is resharded to the leaf's gradient layout (its own mesh and
placements unless a policy says otherwise, :mod:`disttensor.grad_sync`) — a replicated weight
under data parallelism gets its Partial gradient all-reduced, in buckets: data-parallel gradient
sync for free. A leaf's gradient goes to the sync as soon as it is final (every node with an
edge to the leaf has run), so its bucket's all-reduce can start while the backward goes on.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .grad_sync import LeafGradSync, to_leaf_layout
from .ops import cast, ones_like
from .ops.data_checks import flush_data_checks
from .schema import public
from .tape import GradNode, _GradMode, edge, enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: F401
from .tensor import Tensor

__all__ = ["no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "grad",
           "backward", "run_backward", "to_leaf_layout"]


def run_backward(roots: Sequence[Tensor], root_grads: Sequence[Tensor | None],
                 retain_graph: bool = False, inputs: Sequence[Tensor] | None = None
                 ) -> list[Tensor | None] | None:
    """Propagate gradients from ``roots`` through the recorded graph.

    Without ``inputs``: accumulate into every reachable leaf's ``.grad`` (resharded to the
    leaf's own layout). With ``inputs``: return d(roots)/d(inputs) and touch no ``.grad``.
    """
    flush_data_checks()  # pending data checks agree before gradients are made from the data
    _GradMode.backward_depth += 1  # capture files what runs now under "backward"
    sync = LeafGradSync() if inputs is None else None
    try:
        return _backward(roots, root_grads, retain_graph, inputs, sync)
    except BaseException:
        if sync is not None:
            sync.abandon()
        raise
    finally:
        _GradMode.backward_depth -= 1


def _backward(roots, root_grads, retain_graph, inputs, sync: LeafGradSync | None):
    node_grads: dict[int, list] = {}  # id(node) -> per-slot grads
    nodes: dict[int, GradNode] = {}
    leaf_grads: dict[int, Tensor] = {}
    leaves: dict[int, Tensor] = {}
    for r, g in zip(roots, root_grads):
        if r.stop_gradient:
            raise RuntimeError(f"backward: tensor '{r._label()}' has stop_gradient=True; there "
                               "is nothing to differentiate")
        if g is None:  # Paddle: ones of the tensor's shape (and layout)
            g = ones_like(r)
        elif not isinstance(g, Tensor):
            raise TypeError(f"backward: grad_tensor must be a Tensor, got {type(g).__name__}")
        elif g.shape != r.shape:
            raise ValueError(f"backward: grad_tensor shape {g.shape} differs from tensor "
                             f"'{r._label()}' shape {r.shape}")
        _send(edge(r), g, nodes, node_grads, leaves, leaf_grads)

    deps, leaf_deps = _dependencies(nodes.values())
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
            for dest, g, d in zip(node.edges, in_grads, node.in_dtypes):
                if dest is None or g is None:
                    continue
                if g.dtype != d:  # a promoting op's gradient, in its input's dtype
                    g = cast(g, d)
                _send(dest, g, nodes, node_grads, leaves, leaf_grads)
                if type(dest) is tuple:
                    k = id(dest[0])
                    deps[k] -= 1
                    if deps[k] == 0:
                        ready.append(dest[0])
                elif sync is not None:
                    k = id(dest)
                    leaf_deps[k] -= 1
                    if leaf_deps[k] == 0:  # the leaf's gradient is final
                        sync.ready(dest, leaf_grads.pop(k))

        if inputs is not None:
            for i, t in enumerate(inputs):
                if t._node is None and id(t) in leaf_grads:
                    result[i] = leaf_grads[id(t)]
            return result
        for k, g in leaf_grads.items():  # leaves only a root fed (or fed a None gradient)
            sync.ready(leaves[k], g)
        for leaf, g in sync.finish():
            leaf.grad = g if leaf.grad is None else leaf.grad + g
    return None


def _send(dest, g: Tensor, nodes: dict, node_grads: dict, leaves: dict, leaf_grads: dict) -> None:
    """Add gradient ``g`` to ``dest`` (a leaf or a (node, slot) edge)."""
    if type(dest) is tuple:
        node, slot = dest
        k = id(node)
        if k not in nodes:
            nodes[k] = node
            node_grads[k] = [None] * node.n_out
        buf = node_grads[k]
        buf[slot] = g if buf[slot] is None else buf[slot] + g
    else:
        k = id(dest)
        leaves[k] = dest
        prev = leaf_grads.get(k)
        leaf_grads[k] = g if prev is None else prev + g


def _dependencies(roots: Iterable[GradNode]) -> tuple[dict[int, int], dict[int, int]]:
    """For each node reachable from ``roots``, and for each leaf: how many edges of reachable
    nodes point at it."""
    deps: dict[int, int] = {}
    leaf_deps: dict[int, int] = {}
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
            elif e is not None:
                leaf_deps[id(e)] = leaf_deps.get(id(e), 0) + 1
    return deps, leaf_deps


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


@public(methods=("backward",), export=False)
def tensor_backward(self: Tensor, grad_tensor: Tensor | None = None,
                    retain_graph: bool = False) -> None:
    """``Tensor.backward``: accumulate d(self)/d(leaf) into every leaf's ``.grad``
    (``grad_tensor=None`` means ones of self's shape, as in Paddle, for any shape)."""
    run_backward([self], [grad_tensor], retain_graph=retain_graph)


def backward(tensors: Sequence[Tensor] | Tensor, grad_tensors=None,
             retain_graph: bool = False) -> None:
    """Paddle's ``paddle.autograd.backward``: backward from several tensors at once, each
    seeded with its entry of ``grad_tensors`` (None, or a None entry: ones of its shape)."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if grad_tensors is None:
        grad_tensors = [None] * len(tensors)
    elif isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors]
    if len(grad_tensors) != len(tensors):
        raise ValueError(f"backward: {len(tensors)} tensors but {len(grad_tensors)} grad_tensors")
    run_backward(tensors, list(grad_tensors), retain_graph=retain_graph)
