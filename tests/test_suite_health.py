"""The suite's own health: every test in the tree runs in at least one of the CI's runs.

The CI (``tests/run_all.py``) runs ``pytest tests`` in one process, where tests marked
``@pytest.mark.mpi`` are skipped, and ``mpiexec -n N pytest --with-mpi -m mpi tests`` for N = 1..4,
which deselects every unmarked test. A test therefore runs only if

- it is collected at all (its file is named ``test_*.py``, or another test runs the file), and
  collection raises no error;
- unmarked: nothing skips it in the single-process run, where the world size is always 1: no
  skip marker written in the test that holds there and is unconditional or about ranks (a skip
  for a missing optional package or GPU is not one: those run where it is installed), and no
  ``pytest.skip`` guarded by a world-size or rank condition in its body, in the functions of
  its module it calls or in the helpers it imports from the tree (such a test "needs 2 ranks"
  but never gets them: it must be marked ``mpi``);
- marked ``mpi``: no unconditional skip marker, no ``mpi_skip`` marker (pytest-mpi skips those
  under mpiexec) and no ``mpi(min_size=N)`` above the largest world size the CI runs.

One ``pytest --collect-only`` of the tree (a few seconds) and an AST scan of the test files; no
test is run. Tests added later are covered without listing them anywhere.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
MAX_WORLD = 4  # the largest world size tests/run_all.py runs
# identifiers that make a skip condition depend on the number of ranks
WORLD_TOKENS = ("world", "rank", "comm", "get_size", "nproc")
# words of a skip reason about the number of ranks
WORLD_REASONS = ("rank", "world", "process", "mpi")

# a pytest plugin (loaded with -p) that writes every collected item and collection error as JSON
_INVENTORY_PLUGIN = textwrap.dedent('''
    import json
    import os

    import pytest

    _errors = []
    _items = []


    def pytest_collectreport(report):
        if report.failed:
            _errors.append({"nodeid": report.nodeid, "error": str(report.longrepr)[-2000:]})


    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(session, config, items):
        # first: the markers written in the tests, before plugins add their own skips
        # (pytest-mpi skips every mpi test without --with-mpi; conftest skips GPU tests)
        try:
            from _pytest.skipping import evaluate_skip_marks
        except ImportError:  # older pytest: unconditional skip markers only
            evaluate_skip_marks = None
        found = []
        for item in items:
            if evaluate_skip_marks is not None:
                try:
                    skipped = evaluate_skip_marks(item)
                    skip = skipped.reason if skipped else None
                except Exception as e:
                    skip = "its skip condition raised " + repr(e)
            else:
                mark = item.get_closest_marker("skip")
                skip = None if mark is None else str(mark.kwargs.get("reason", "skip"))
            mpi = item.get_closest_marker("mpi")
            found.append({
                "nodeid": item.nodeid, "path": str(getattr(item, "path", item.fspath)),
                "function": getattr(getattr(item, "function", None), "__name__", None),
                "cls": item.cls.__name__ if getattr(item, "cls", None) else None,
                "mpi": mpi is not None,
                "min_size": None if mpi is None else mpi.kwargs.get("min_size"),
                "mpi_skip": item.get_closest_marker("mpi_skip") is not None,
                "unconditional_skip": item.get_closest_marker("skip") is not None,
                "skip": skip})
        _items[:] = found


    def pytest_collection_finish(session):
        with open(os.environ["SUITE_INVENTORY"], "w") as f:
            json.dump({"items": _items, "errors": _errors}, f)
''')


@pytest.fixture(scope="module")
def inventory(tmp_path_factory) -> dict:
    """The single-process run's collection of the whole tree (items and collection errors)."""
    d = tmp_path_factory.mktemp("inventory")
    (d / "suite_inventory.py").write_text(_INVENTORY_PLUGIN)
    out = d / "inventory.json"
    env = dict(os.environ, SUITE_INVENTORY=str(out),
               PYTHONPATH=os.pathsep.join([ROOT, str(d), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "suite_inventory",
         "-p", "no:cacheprovider", TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"the collection wrote no inventory:\n{proc.stdout[-3000:]}\n" \
                         f"{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


# -- static analysis --------------------------------------------------------------------------

def _test_files() -> list[str]:
    files = []
    for d, dirs, names in os.walk(TESTS):
        dirs[:] = sorted(n for n in dirs if not n.startswith((".", "__")))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return files


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _test_functions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """``(name or Class::name, node)`` of the test functions pytest would collect from ``tree``."""
    found = []
    for node in tree.body:
        if isinstance(node, _FUNCS) and node.name.startswith("test"):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            found += [(f"{node.name}::{f.name}", f) for f in node.body
                      if isinstance(f, _FUNCS) and f.name.startswith("test")]
    return found


def _is_pytest_skip(node: ast.AST) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "skip" and \
        isinstance(f.value, ast.Name) and f.value.id == "pytest"


def _mentions_world(expr: ast.AST) -> bool:
    words = [n.id for n in ast.walk(expr) if isinstance(n, ast.Name)] + \
        [n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute)]
    return any(t in w.lower() for w in words for t in WORLD_TOKENS)


class _WorldSkips(ast.NodeVisitor):
    """Lines of ``pytest.skip`` calls under an ``if`` whose condition depends on the world size,
    and the module functions called (to follow helpers such as ``need(2)``)."""

    def __init__(self):
        self.guards: list[ast.AST] = []
        self.skips: list[int] = []
        self.calls: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self.guards.append(node.test)
        for s in node.body + node.orelse:
            self.visit(s)
        self.guards.pop()

    def visit_Call(self, node: ast.Call) -> None:
        if _is_pytest_skip(node) and any(_mentions_world(g) for g in self.guards):
            self.skips.append(node.lineno)
        if isinstance(node.func, ast.Name):
            self.calls.add(node.func.id)
        self.generic_visit(node)


def _functions(tree: ast.Module, where: str) -> dict[str, tuple[ast.AST, str]]:
    return {n.name: (n, where) for n in tree.body if isinstance(n, _FUNCS)}


def imported_helpers(tree: ast.Module, modules: dict[str, ast.Module]) -> dict:
    """``name -> (function, file)`` for the functions ``tree`` imports by name from other
    modules of the tree (``modules``: module name -> its AST), e.g. ``from util import need``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            src = modules.get(node.module.rsplit(".", 1)[-1])
            if src is None:
                continue
            funcs = _functions(src, node.module.rsplit(".", 1)[-1] + ".py")
            out.update({a.asname or a.name: funcs[a.name] for a in node.names if a.name in funcs})
    return out


def world_size_skips(tree: ast.Module, helpers: dict | None = None) -> dict[str, list[str]]:
    """Per test function (``name`` / ``Class::name``) of ``tree``: where (``line N`` or
    ``file.py:N``) the world-size guarded ``pytest.skip`` calls it reaches are, directly or
    through the module's functions and the ``helpers`` it imports (:func:`imported_helpers`)."""
    funcs = {**(helpers or {}), **_functions(tree, "")}
    scans: dict[int, _WorldSkips] = {}

    def scan(fn: ast.AST) -> _WorldSkips:
        v = _WorldSkips()
        for stmt in fn.body:
            v.visit(stmt)
        return v

    def reach(fn: ast.AST) -> list[str]:
        found, seen, todo = set(), set(), [(fn, "")]
        while todo:
            f, where = todo.pop()
            if id(f) in seen:
                continue
            seen.add(id(f))
            if id(f) not in scans:
                scans[id(f)] = scan(f)
            v = scans[id(f)]
            found |= {f"{where}:{n}" if where else f"line {n}" for n in v.skips}
            # a helper's own module functions are not followed further (one level of import)
            todo += [funcs[c] for c in v.calls if c in funcs and not where]
        return sorted(found)

    out = {name: reach(fn) for name, fn in _test_functions(tree)}
    return {k: v for k, v in out.items() if v}


def _source(path: str) -> str:
    with open(path) as f:
        return f.read()


def _parse(path: str) -> ast.Module:
    return ast.parse(_source(path), path)


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


# -- the checks -------------------------------------------------------------------------------

def test_the_tree_collects_without_errors(inventory):
    errors = [f"{e['nodeid']}: {e['error'].strip().splitlines()[-1] if e['error'].strip() else ''}"
              for e in inventory["errors"]]
    assert not errors, "collection errors (their tests never run):\n  " + "\n  ".join(errors)
    assert inventory["items"], "nothing collected"


def test_every_test_function_is_collected(inventory):
    """A ``def test_*`` in a file pytest does not collect never runs, unless another test runs
    that file (a subprocess target, named in the collected test's source)."""
    collected = {(os.path.realpath(i["path"]),
                  f"{i['cls']}::{i['function']}" if i["cls"] else i["function"])
                 for i in inventory["items"]}
    collected_files = {p for p, _ in collected}
    sources = "\n".join(_source(p) for p in sorted(collected_files))
    missing = []
    for path in _test_files():
        real = os.path.realpath(path)
        name = os.path.basename(path)
        if real not in collected_files and name in sources:
            continue  # a file another test runs (e.g. under mpiexec)
        for t, _ in _test_functions(_parse(path)):
            if (real, t) not in collected:
                missing.append(f"{_rel(path)}::{t}")
    assert not missing, "test functions that no run collects:\n  " + "\n  ".join(missing)


def _skips_on_world_size(item: dict) -> bool:
    """An unmarked item's skip marker holds in the single-process run and is unconditional or
    about ranks (a skipif on a missing optional package runs where the package is installed)."""
    reason = (item["skip"] or "").lower()
    return bool(item["skip"]) and (item["unconditional_skip"]
                                   or any(t in reason for t in WORLD_REASONS))


def test_unmarked_tests_are_not_skipped_in_the_single_process_run(inventory):
    bad = [f"{i['nodeid']}: skipped by marker ({i['skip']})" for i in inventory["items"]
           if not i["mpi"] and _skips_on_world_size(i)]
    assert not bad, "tests that the single-process run skips and no mpiexec run selects " \
                    "(unmarked):\n  " + "\n  ".join(bad)


def test_unmarked_tests_do_not_skip_on_the_world_size(inventory):
    """The single-process run has one rank: an unmarked test that skips below N ranks never
    runs (mark it ``@pytest.mark.mpi``)."""
    unmarked: dict[str, set[str]] = {}
    for i in inventory["items"]:
        if not i["mpi"] and i["function"]:
            key = f"{i['cls']}::{i['function']}" if i["cls"] else i["function"]
            unmarked.setdefault(os.path.realpath(i["path"]), set()).add(key)
    modules = {}
    for path in _test_files():
        modules[os.path.basename(path)[:-3]] = _parse(path)
    bad = []
    for path, names in sorted(unmarked.items()):
        tree = _parse(path)
        skips = world_size_skips(tree, imported_helpers(tree, modules))
        bad += [f"{_rel(path)}::{n}: pytest.skip under a world-size condition "
                f"({', '.join(skips[n])})" for n in sorted(names & skips.keys())]
    assert not bad, "unmarked tests that skip in the single-process run (world size 1) and " \
                    "that no mpiexec run selects; mark them mpi:\n  " + "\n  ".join(bad)


def test_mpi_tests_run_under_mpiexec(inventory):
    bad = []
    for i in inventory["items"]:
        if not i["mpi"]:
            continue
        if i["unconditional_skip"]:
            bad.append(f"{i['nodeid']}: an unconditional skip marker")
        if i["mpi_skip"]:
            bad.append(f"{i['nodeid']}: marked both mpi and mpi_skip")
        if i["min_size"] is not None and i["min_size"] > MAX_WORLD:
            bad.append(f"{i['nodeid']}: mpi(min_size={i['min_size']}) but the CI runs at most "
                       f"{MAX_WORLD} ranks")
    assert not bad, "mpi tests that no mpiexec run executes:\n  " + "\n  ".join(bad)


# -- the checker itself ------------------------------------------------------------------------

_SAMPLE = textwrap.dedent('''
    import pytest

    def world():
        return None

    def need(n):
        if world().size < n:
            pytest.skip(f"needs {n} ranks")

    def helper():
        need(2)

    def test_direct():
        if dt.get_world_size() < 2:
            pytest.skip("needs 2 ranks")

    def test_through_helpers():
        helper()

    def test_other_condition():
        if not HAVE_NUMBA:
            pytest.skip("numba")

    def test_plain():
        assert 1

    class TestGroup:
        def test_method(self, comm):
            if comm.size == 1:
                pytest.skip("one rank")
''')


def test_world_size_skip_finder_on_a_sample():
    tree = ast.parse(_SAMPLE)
    assert world_size_skips(tree) == {"test_direct": ["line 16"],
                                      "test_through_helpers": ["line 9"],
                                      "TestGroup::test_method": ["line 31"]}
    user = ast.parse("from sample_util import need as needs\n"
                     "def test_imported():\n    needs(2)\n"
                     "def test_fine():\n    pass\n")
    helpers = imported_helpers(user, {"sample_util": tree})
    assert world_size_skips(user, helpers) == {"test_imported": ["sample_util.py:9"]}
    assert [name for name, _ in _test_functions(tree)] == [
        "test_direct", "test_through_helpers", "test_other_condition", "test_plain",
        "TestGroup::test_method"]
