"""Build the API reference (HTML, from the docstrings) with pdoc.

    pip install -e ".[docs]"            # or: pip install pdoc
    python docs/build_api.py            # writes docs/api/ (open docs/api/index.html)
    python docs/build_api.py -o DIR     # somewhere else

Documents the user-facing packages: ``disttensor`` (with ``nn``, ``optimizer``, ``io``,
``parallel``, ``checkpoint``, ``jit``), the placement algebra ``spmd_rules`` and the process
groups of ``collectives``. Runs in one process (no MPI launch needed).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["disttensor", "spmd_rules", "collectives"]


def build(out_dir: str) -> list[str]:
    """Render the API pages into ``out_dir``; returns the files written."""
    try:
        import pdoc
    except ImportError:
        raise SystemExit("docs/build_api.py: pdoc is not installed (pip install pdoc, or "
                         "pip install -e \".[docs]\")") from None
    sys.path.insert(0, ROOT)
    pdoc.render.configure(docformat="restructuredtext", show_source=False,
                          footer_text="disttensor API")
    pdoc.pdoc(*MODULES, output_directory=Path(out_dir))
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(out_dir) for f in fs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "docs", "api"))
    args = ap.parse_args(argv)
    files = build(args.output)
    print(f"wrote {len(files)} files to {args.output} (open index.html)")


if __name__ == "__main__":
    main()
