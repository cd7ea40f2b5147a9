"""Straight-line Python functions generated from instruction lists.

Two things are generated from the same pieces: the compiled form of a plan
(:func:`disttensor.plan.compile_plan`: one function per plan, over slots) and a captured
program's forward and backward step functions (:mod:`disttensor.jit.program`: over registers).
Names in the source are plain locals (``s3``, ``r17``); the callables an instruction runs are
looked up in the function's globals (``env``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["assign", "define"]

#: compiled code by (file name, source): plans of one structure share their code, not their
#: functions
_CODE: dict[str, Any] = {}
CODE_CACHE_LIMIT = 4096


def assign(targets: Sequence[str], call: str, unpack: bool = False) -> str:
    """The line running ``call`` and binding its result(s) to ``targets`` (``unpack``: the
    call returns a sequence even for one target)."""
    if not targets:
        return call
    if len(targets) == 1 and not unpack:
        return f"{targets[0]} = {call}"
    return f"{', '.join(targets)}, = {call}"


def define(name: str, params: Sequence[str], body: Sequence[str], env: dict[str, Any],
           filename: str) -> tuple[Callable, str]:
    """The function ``name(*params)`` running the lines ``body`` with globals ``env``, and its
    source. Equal sources are compiled once."""
    source = "\n".join([f"def {name}({', '.join(params)}):"] + ["    " + line for line in body])
    code = _CODE.get((filename, source))
    if code is None:
        code = compile(source, filename, "exec")
        if len(_CODE) >= CODE_CACHE_LIMIT:
            _CODE.pop(next(iter(_CODE)))
        _CODE[filename, source] = code
    exec(code, env)
    return env[name], source
