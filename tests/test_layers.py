"""The import graph keeps its layers (docs/ARCHITECTURE.md, "Layers"): read from the source —
every import statement, at module level, inside functions and under ``TYPE_CHECKING`` — no
module imports a layer above its own, ``collectives``, ``spmd_rules`` and ``launch`` import
nothing of ours outside themselves, and no import circle runs inside ``disttensor``."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("disttensor", "collectives", "spmd_rules", "launch")
#: packages below disttensor: each imports nothing of ours but itself
FOUNDATIONS = ("collectives", "spmd_rules", "launch")

#: disttensor's layers, bottom first: a module may import its own layer and the ones below.
#: An entry names a module or a package (all modules under it); "disttensor" is the root
#: package's __init__ only.
LAYERS = [
    ("core", ["disttensor.dtype", "disttensor.tensor", "disttensor.parameter",
              "disttensor.generator", "disttensor.schema", "disttensor.tape", "disttensor.plan",
              "disttensor.strategy", "disttensor.codegen"]),
    ("layout", ["disttensor.layout"]),
    ("seam", ["disttensor.dispatch"]),
    ("ops", ["disttensor.ops"]),
    ("entry points", ["disttensor.distributed"]),
    ("autograd", ["disttensor.grad_sync", "disttensor.autograd", "disttensor.tensor_methods"]),
    ("models", ["disttensor.nn", "disttensor.optimizer", "disttensor.jit", "disttensor.amp",
                "disttensor.incubate"]),
    ("user layer", ["disttensor.parallel", "disttensor.checkpoint", "disttensor.io",
                    "disttensor.pipelining"]),
    ("package", ["disttensor"]),
]
SEAM = "disttensor.dispatch"

#: import circles being taken apart elsewhere; each must still exist (the strict xfail below
#: fails once it is gone, so the entry is removed with it)
PENDING_CIRCLES = [
    # type hints: jit/program.py splits into the IR, building and code generation
    {"disttensor.jit.program", "disttensor.jit.buffers", "disttensor.jit.remat"},
]


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of our packages."""
    found = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3]
                    name = rel.replace(os.sep, ".").removesuffix(".__init__")
                    found[name] = os.path.join(folder, f)
    return found


MODULES = modules()


def _ours(name: str | None) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None if none is)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str) -> set[str]:
    """Our modules that module ``name`` imports (a name imported from a package counts as the
    package, unless it is a submodule)."""
    path = MODULES[name]
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(_ours(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                full = f"{base}.{node.module}" if node.module else base
            else:
                full = node.module
            for a in node.names:
                sub = f"{full}.{a.name}"
                found.add(sub if sub in MODULES else _ours(full))
    found.discard(None)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    best, where = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            hit = name == e if e == "disttensor" else name == e or name.startswith(e + ".")
            if hit and len(e) > best:
                best, where = len(e), i
    assert where is not None, f"{name} belongs to no layer of tests/test_layers.py's LAYERS"
    return where


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_known_edges():
    """The reader resolves relative, absolute and submodule imports (else the tests below
    would pass on an empty graph)."""
    assert "disttensor.tensor" in GRAPH["disttensor.tape"]          # from .tensor import
    assert "spmd_rules" in GRAPH["disttensor.schema"]               # from spmd_rules import
    assert SEAM in GRAPH["disttensor.ops.common"]                   # from ..dispatch import
    assert "disttensor.ops" in GRAPH["disttensor.nn.layer"]         # from ..ops import cast
    assert "collectives._alltoall" in GRAPH["collectives._mpi"]
    assert all(layer_of(m) >= 0 for m in MODULES if m.startswith("disttensor"))


def test_foundations_import_nothing_of_ours_outside_themselves():
    bad = [f"{m} imports {t}" for m in MODULES if m.split(".")[0] in FOUNDATIONS
           for t in sorted(GRAPH[m]) if t.split(".")[0] != m.split(".")[0]]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for m in sorted(MODULES):
        if not m.startswith("disttensor"):
            continue
        for t in sorted(GRAPH[m]):
            if t.startswith("disttensor") and layer_of(t) > layer_of(m):
                bad.append(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} "
                           f"({LAYERS[layer_of(t)][0]})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_nothing_below_the_seam_imports_above_it():
    seam = layer_of(SEAM)
    bad = [f"{m} imports {t}" for m in MODULES if m.startswith("disttensor.")
           and layer_of(m) < seam for t in GRAPH[m]
           if t.startswith("disttensor") and layer_of(t) >= seam]
    assert not bad, "\n".join(bad)


def _disttensor_circles() -> list[set[str]]:
    inner = {m: {t for t in ts if t.startswith("disttensor")}
             for m, ts in GRAPH.items() if m.startswith("disttensor")}
    return circles(inner)


def test_no_import_circle_in_disttensor():
    found = [c for c in _disttensor_circles() if c not in PENDING_CIRCLES]
    assert not found, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


@pytest.mark.xfail(strict=True, reason="a circle listed in PENDING_CIRCLES is still there")
def test_pending_circles_are_gone():
    still = [c for c in _disttensor_circles() if c in PENDING_CIRCLES]
    assert not still, still


def test_circles_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
