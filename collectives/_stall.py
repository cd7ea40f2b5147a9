"""What a stalled collective is waiting for: pure functions over the states ranks report.

A rank whose collective has been blocked for ``stall_after()`` seconds asks every rank what it is
doing (over the failure channel); each answers with a :data:`State`:

- ``("in", ranks, index, name, sig, site, waited, seq)``: blocked ``waited`` s in call #``index``
  on the group of global ``ranks`` (index -1: creating that group);
- ``("out", site, seq)``: outside any collective, running ``site``;

``seq`` being how many calls the answering rank has issued on the asker's group. A rank that
exited is known from its exit notice. :func:`diagnose` then decides whether the wait can ever end.
"""
from __future__ import annotations

from typing import Optional

MARK = "[disttensor] job aborted: rank"
State = tuple


def describe(name: str, sig, index: int, ranks) -> str:
    meta = ", ".join(f"{k}={v}" for k, v in sig) if sig else ""
    if index < 0:
        return f"{name}({meta}) creating the group of ranks {list(ranks)}"
    return f"{name}({meta}) call #{index} on group ranks {list(ranks)}"


def state_line(rank: int, st: Optional[State]) -> str:
    """``rank 2: in barrier() call #3 on group ranks [0, 1, 2, 3], called from f.py:9 in
    <module> (blocked 5.2 s)``, or where it is outside any collective."""
    if st is None:
        return f"rank {rank}: did not answer"
    if st[0] == "in":
        _, ranks, index, name, sig, site, waited, _ = st
        return (f"rank {rank}: in {describe(name, sig, index, ranks)}, called from {site} "
                f"(blocked {waited:.1f} s)")
    return f"rank {rank}: outside any collective, at {st[1]}"


def _same_call(st: Optional[State], ranks: tuple, index: int) -> bool:
    return st is not None and st[0] == "in" and st[1] == ranks and st[2] == index


def _missing(ranks: tuple, index: int, states: dict) -> list:
    return [r for r in ranks if not _same_call(states.get(r), ranks, index)]


def diagnose(me: int, states: dict, window: float) -> Optional[tuple[int, str, list]]:
    """``(rank to blame, report, ranks concerned)`` when rank ``me``'s collective
    (``states[me]``, an "in" state) can never complete, else None (keep waiting).

    It cannot when a member it waits for has already issued more calls on the group than this
    one (it went past it), or when every rank it waits for, directly or through the ranks those
    wait for, is blocked in a collective that itself lacks such a rank (a deadlock). States are
    snapshots taken up to ``window`` s apart: a rank counts as blocked only if it was blocked
    for longer than that, so all of them were blocked at the same moment."""
    _, ranks, index, _, _, _, _, _ = states[me]
    others = "\n".join("  " + state_line(r, states.get(r)) for r in sorted(states))
    for r in _missing(ranks, index, states):
        st = states.get(r)
        if st is not None and index >= 0 and st[-1] > index + 1:  # (one in it has index + 1)
            return r, (f"{MARK} {r} went past call #{index} on group {list(ranks)} without "
                       f"joining rank {me} there (it has issued {st[-1]} calls on that group); "
                       f"what each rank is doing:\n{others}"), [me]
    seen, todo = {me}, _missing(ranks, index, states)
    if not todo:
        return None  # every member is in this call: it is completing, however slowly
    while todo:
        r = todo.pop()
        if r in seen:
            continue
        seen.add(r)
        st = states.get(r)
        if st is None or st[0] != "in" or st[6] <= window:
            return None  # it may still come
        lacking = _missing(st[1], st[2], states)
        if not lacking:
            return None  # its call has every member: it is completing
        todo += lacking
    # blame the rank in the least shared call (on a tie, one that went through Tensor.numpy())
    calls = [st[1:3] for st in states.values() if st[0] == "in"]
    blame = min(seen, key=lambda r: (calls.count(states[r][1:3]),
                                     "Tensor.numpy()" not in states[r][5], r))
    return blame, (f"{MARK} {blame} is in another collective than the ranks it waits for: "
                   f"ranks {sorted(seen)} are all blocked, each waiting for a rank blocked "
                   f"elsewhere (a deadlock); what each rank is doing:\n{others}"), sorted(seen)
