"""The repository stands alone: no file points at documents outside it (a design document, a
tracker's numbers, a sibling folder), so a reader never meets a reference they cannot follow."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\b|\b[Ss]eeds?[ /]0\d\d|\b[Ss]eed scenario|"
                      r"\b[Ii]ssue #?\d+|\b[Ii]ssues?/\d+|\bticket #?\d+")


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        out = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT)
               if "/.git" not in d for f in fs]
    return [f for f in out if f.endswith((".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml"))
            or f.startswith(".ci/")]


def test_no_reference_leaves_the_repository():
    hits = []
    for rel in _tracked_text_files():
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                if _OUTSIDE.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)
