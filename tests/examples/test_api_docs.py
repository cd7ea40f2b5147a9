"""docs/build_api.py renders the API reference from the docstrings (pdoc), and the package
ships py.typed (PEP 561)."""
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "docs"))
import build_api  # noqa: E402


def test_api_pages_document_the_user_layer(tmp_path):
    pytest.importorskip("pdoc", reason="pdoc comes with the test extra")
    files = build_api.build(str(tmp_path))
    names = {os.path.relpath(f, tmp_path) for f in files}
    assert {"index.html", "disttensor.html", "spmd_rules.html"} <= names
    page = (tmp_path / "disttensor" / "parallel.html").read_text()
    for text in ("shard_optimizer", "ShardingStage2", "LazyGuard", "fully_shard",
                 "reduce-scattered"):
        assert text in page, text


def test_package_ships_py_typed():
    import disttensor
    assert os.path.isfile(os.path.join(os.path.dirname(disttensor.__file__), "py.typed"))
