"""Deferred data checks: ids, labels and indices in range, agreed over the ranks lazily.

Data checks (ids, labels and indices in range, :func:`note_data_check`) agree later: a kernel
checks its own piece and notes the verdict; the ranks holding other pieces agree on all the
verdicts noted since their last agreement in one small all-reduce, run just before the next
collective this process issues, before a distributed plan writes into a tensor, before
``backward`` makes gradients, before a piece leaves (``dtensor_to_local``, ``_local_value``)
and after each half of a captured step (:func:`flush_data_checks`). Every rank of the group
then raises the same ``ValueError``, naming the first bad call (in call order) and the value,
while a bad rank computes on with the bad entries replaced, so nothing waits and no value made
from them leaves the runtime.
"""
from __future__ import annotations

import numpy as np

import collectives

from ..dispatch import Observer, add_observer, remove_observer
from ..layout.mesh_groups import group_over

__all__ = ["data_check_group", "note_data_check", "flush_data_checks", "pending_data_checks"]


class _Verdicts:
    """The data checks noted on one group since its last agreement: how many, and this rank's
    first failing one as (position, message head, value bounds: lo, hi, n, note)."""

    __slots__ = ("group", "count", "first")

    def __init__(self, group):
        self.group, self.count, self.first = group, 0, None


_PENDING: dict[tuple, _Verdicts] = {}   # group ranks -> the verdicts awaiting agreement
_CTX_GROUPS: dict[int, tuple] = {}      # id(ctx) -> (ctx, {input index: group or None})


def data_check_group(ctx, input_index: int):
    """The group of ranks holding the other pieces of input ``input_index`` of a kernel with
    context ``ctx``: None when no mesh dim shards it (every rank holding a piece holds all of
    it) or ``ctx`` is the dense one."""
    mesh = getattr(ctx, "mesh", None)
    if mesh is None:
        return None
    entry = _CTX_GROUPS.get(id(ctx))
    if entry is None or entry[0] is not ctx:
        if len(_CTX_GROUPS) >= 8192:  # contexts live in cached plans: bounded like them
            _CTX_GROUPS.clear()
        entry = _CTX_GROUPS[id(ctx)] = (ctx, {})
    groups = entry[1]
    if input_index not in groups:
        attr = ctx.metas[input_index].dist_attr
        dims = tuple(sorted({m for dm in attr.dims_mapping for m in dm}))
        group = group_over(mesh, dims) if dims else None
        groups[input_index] = group if group is not None and group.size > 1 else None
    return groups[input_index]


def note_data_check(group, failure: tuple | None) -> None:
    """Note one data check's verdict on ``group`` (every member notes it, in the same order):
    ``failure`` is None when this rank's piece passed, else ``(head, lo, hi, n, note)`` with its
    piece's extremes. Agreed on at the next :func:`flush_data_checks`."""
    key = group.ranks
    v = _PENDING.get(key)
    if v is None:
        if not _PENDING:
            collectives.before_next_collective(flush_data_checks)
            add_observer(_FLUSH_BEFORE_WRITE)
        v = _PENDING[key] = _Verdicts(group)
    if failure is not None and v.first is None:
        v.first = (v.count,) + failure
    v.count += 1


def pending_data_checks() -> int:
    """How many data checks await agreement on this rank (for tests and benchmarks)."""
    return sum(v.count for v in _PENDING.values())


class _FlushBeforeWrite(Observer):
    """Agrees on the pending checks before a distributed plan writes into a tensor."""

    def before_write(self, plan, inputs) -> None:
        if plan.kind == "dist":
            flush_data_checks()


_FLUSH_BEFORE_WRITE = _FlushBeforeWrite()


def _message(failures: list) -> str:
    """The error of the first failing check (lowest position), its value over every rank whose
    piece failed there (the most negative value, else the largest)."""
    at = min(f[0] for f in failures)
    same = [f for f in failures if f[0] == at]
    head, n, note = same[0][1], same[0][4], same[0][5]
    lo, hi = min(f[2] for f in same), max(f[3] for f in same)
    return f"{head} {lo if lo < 0 else hi} is out of range [0, {n}){note}"


def flush_data_checks() -> None:
    """Agree on every noted data check (one int64 max all-reduce per group of ranks, groups in
    ascending rank order; the failing pieces' details are exchanged only when one failed) and
    raise the first failure's ``ValueError`` on every rank of its group. No-op when none is
    pending."""
    if not _PENDING:
        return
    pending = [_PENDING[k] for k in sorted(_PENDING)]
    _PENDING.clear()
    collectives.cancel_before_next_collective(flush_data_checks)
    remove_observer(_FLUSH_BEFORE_WRITE)
    errors = []
    for v in pending:
        flag = np.array([v.first is not None], dtype=np.int64)
        if v.group.all_reduce(flag, "max")[0]:
            firsts = [f for f in v.group.exchange_metadata(v.first) if f is not None]
            errors.append(_message(firsts))
    if errors:
        raise ValueError(errors[0])
