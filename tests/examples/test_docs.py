"""The README and the guide (docs/guide/*.md) as tests.

- Every ``python`` block runs as written at 4 ranks (the size the pages' meshes are written for),
  file by file, each block in a fresh namespace; paths under /tmp/ are redirected to a
  temporary directory.
- A ``text`` block that directly follows a ``python`` block is that block's output on rank 0:
  what the block prints there must equal it line for line (trailing spaces aside), so no page
  shows a stale output.
- Links between pages stay inside the repository and point at files that exist; the README
  stays short (at most 250 lines).
"""
import contextlib
import io
import os
import re
import shutil
import tempfile

import pytest

import collectives

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
GUIDE = os.path.join(ROOT, "docs", "guide")
PAGES = ["README.md"] + sorted(os.path.join("docs", "guide", f) for f in os.listdir(GUIDE)
                                if f.endswith(".md"))
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def blocks(path: str) -> list[tuple[str, str | None]]:
    """``(code, expected_output_or_None)`` for every python block of the page, in order."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    found = [(m.group(1), m.group(2), m.start(), m.end()) for m in _BLOCK.finditer(text)]
    out = []
    for k, (lang, body, _, end) in enumerate(found):
        if lang != "python":
            continue
        expected = None
        if k + 1 < len(found):
            nlang, nbody, nstart, _ = found[k + 1]
            if nlang == "text" and not text[end:nstart].strip():
                expected = nbody
        out.append((body, expected))
    return out


def _lines(s: str) -> list[str]:
    return [line.rstrip() for line in s.rstrip("\n").split("\n")]


@pytest.mark.mpi
@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run_and_print_what_they_show(comm, page):
    if collectives.init().size != 4:
        pytest.skip("the pages' meshes are written for 4 ranks")
    tmp = comm.bcast(tempfile.mkdtemp(prefix="dt-docs-") if comm.rank == 0 else None)
    stale = []  # compared after every block ran, so rank 0 never leaves the others mid-page
    try:
        for k, (code, expected) in enumerate(blocks(page)):
            code = re.sub(r"/tmp/(\w+)", lambda m: os.path.join(tmp, m.group(1)), code)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(code, f"{page} block {k + 1}", "exec"), {})
            if expected is not None and comm.rank == 0 and \
                    _lines(buf.getvalue()) != _lines(expected):
                stale.append(f"{page} block {k + 1} printed\n{buf.getvalue()}\nbut the page "
                             f"shows\n{expected}")
        assert not stale, "\n".join(stale)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def test_every_page_has_runnable_blocks():
    assert len(blocks("README.md")) >= 1
    assert sum(len(blocks(p)) for p in PAGES) >= 30


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES + ["docs/ARCHITECTURE.md"])
def test_links_stay_inside_the_repository(page):
    with open(os.path.join(ROOT, page)) as f:
        text = _BLOCK.sub("", f.read())          # code is not prose: no links in it
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
        assert path.startswith(ROOT + os.sep), f"{page}: link {target} leaves the repository"
        assert os.path.exists(path), f"{page}: link {target} points at nothing"


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert len(f.read().splitlines()) <= 250
