"""Pipeline schedules as action tables: pure functions of (pp, m, v) over metadata only.

A schedule gives every pipeline stage (rank position along "pp") its own ordered list of
actions. An :class:`Action` is a forward ``F`` or backward ``B`` of one micro-batch through one
model chunk; with ``v`` virtual stages per rank the model is cut into ``pp * v`` chunks and
chunk ``c`` of stage ``s`` is virtual stage ``c * pp + s`` (Megatron's interleaving).

- FThenB (GPipe): every forward, then every backward.
- 1F1B: ``pp - s - 1`` warm-up forwards, then one forward / one backward alternately, then the
  remaining backwards: stage ``s`` holds at most ``pp - s`` micro-batches of activations.
- VPP (interleaved 1F1B): forwards walk the chunks in groups of ``pp`` micro-batches; warm-up of
  ``2 (pp - s - 1) + (v - 1) pp`` forwards; needs ``m % pp == 0``.

:func:`simulate` replays the per-stage lists with unit-time actions and the data dependencies
(``F`` of virtual stage k needs ``F`` of k-1; ``B`` of k needs ``B`` of k+1), which gives the
stage x time table, its bubble fraction, and rejects an order that would deadlock.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Action", "SCHEDULES", "schedule_actions", "simulate", "schedule_table",
           "bubble_fraction", "theoretical_bubble", "first_forwards_first"]

SCHEDULES = ("FThenB", "1F1B", "VPP")


class Action(NamedTuple):
    """One step of a stage: ``kind`` "F" or "B", micro-batch ``mb``, model ``chunk`` (0..v-1)."""
    kind: str
    mb: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if v > 1 else "")


def _check(fn: str, schedule: str, pp: int, m: int, v: int) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"{fn}: schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    for name, val in (("pp", pp), ("n_microbatches", m), ("vpp_degree", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{fn}: {name} must be a positive int, got {val!r}")
    if schedule != "VPP" and v != 1:
        raise ValueError(f"{fn}: vpp_degree={v} needs schedule 'VPP', got {schedule!r}")
    if schedule == "VPP" and m % pp:
        raise ValueError(f"{fn}: the VPP schedule needs n_microbatches ({m}) to be a multiple "
                         f"of pp ({pp})")
    return schedule


def _fthenb(pp: int, m: int, s: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(pp: int, m: int, s: int) -> list[Action]:
    warm = min(pp - s - 1, m)
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i), Action("B", i)]
    return out + [Action("B", i) for i in range(m - warm, m)]


def _vpp(pp: int, m: int, s: int, v: int) -> list[Action]:
    total = m * v

    def unit(k: int, backward: bool) -> Action:
        chunk = (k // pp) % v
        mb = (k // (pp * v)) * pp + k % pp
        return Action("B" if backward else "F", mb, v - 1 - chunk if backward else chunk)
    warm = min((pp - s - 1) * 2 + (v - 1) * pp, total)
    out = [unit(k, False) for k in range(warm)]
    for k in range(total - warm):
        out += [unit(warm + k, False), unit(k, True)]
    return out + [unit(k, True) for k in range(total - warm, total)]


def schedule_actions(schedule: str, pp: int, m: int, vpp_degree: int = 1) -> list[list[Action]]:
    """Per stage (0..pp-1) the ordered actions of ``schedule`` with ``m`` micro-batches.

    Example::

        >>> schedule_actions("1F1B", 2, 3)[0]
        [Action(kind='F', mb=0, chunk=0), Action(kind='F', mb=1, chunk=0), ...]
    """
    _check("schedule_actions", schedule, pp, m, vpp_degree)
    if schedule == "VPP":
        return [_vpp(pp, m, s, vpp_degree) for s in range(pp)]
    build = _fthenb if schedule == "FThenB" else _one_f_one_b
    return [build(pp, m, s) for s in range(pp)]


def first_forwards_first(actions: list[Action]) -> list[Action]:
    """One stage's ``actions`` with the forwards of micro-batch 0 moved to the front (chunk
    order), the rest in their order: a step that must see micro-batch 0 through every stage
    before the others start (the dependencies of those forwards are at the other stages'
    fronts too, so the reordered lists cannot deadlock)."""
    first = sorted((a for a in actions if a.kind == "F" and a.mb == 0), key=lambda a: a.chunk)
    return first + [a for a in actions if not (a.kind == "F" and a.mb == 0)]


def _deps(a: Action, s: int, pp: int, v: int) -> list[tuple[int, Action]]:
    """(stage, action) pairs that must finish before ``a`` runs on stage ``s``."""
    k = a.chunk * pp + s
    if a.kind == "F":
        if k == 0:
            return []
        return [((k - 1) % pp, Action("F", a.mb, (k - 1) // pp))]
    if k == pp * v - 1:
        return [(s, Action("F", a.mb, a.chunk))]
    return [((k + 1) % pp, Action("B", a.mb, (k + 1) // pp))]


def simulate(actions: list[list[Action]], vpp_degree: int = 1) -> list[dict[Action, int]]:
    """Start slot of every action (unit time each) when each stage runs its list in order and
    waits for its dependencies; ValueError if the lists can never all finish (a deadlock)."""
    pp = len(actions)
    start: list[dict[Action, int]] = [{} for _ in range(pp)]
    done: dict[tuple[int, Action], int] = {}
    pos, free = [0] * pp, [0] * pp
    remaining = sum(len(a) for a in actions)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(actions[s]):
                a = actions[s][pos[s]]
                deps = _deps(a, s, pp, vpp_degree)
                if any(d not in done for d in deps):
                    break
                t = max([free[s]] + [done[d] for d in deps])
                start[s][a] = t
                done[(s, a)] = free[s] = t + 1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: actions[s][pos[s]].label(vpp_degree) for s in range(pp)
                     if pos[s] < len(actions[s])}
            raise ValueError(f"simulate: the schedule deadlocks (stages waiting at {stuck})")
    return start


def bubble_fraction(actions: list[list[Action]], vpp_degree: int = 1) -> float:
    """Idle share of the stage x time grid when every action takes one slot."""
    start = simulate(actions, vpp_degree)
    span = max(t for st in start for t in st.values()) + 1
    busy = sum(len(a) for a in actions)
    return 1.0 - busy / (span * len(actions))


def theoretical_bubble(pp: int, m: int, vpp_degree: int = 1) -> float:
    """(pp - 1) / (v m + pp - 1): the idle share of an ideal FThenB / 1F1B (v = 1) or
    interleaved (v virtual stages) pipeline with forward and backward of equal cost."""
    return (pp - 1) / (vpp_degree * m + pp - 1)


def schedule_table(schedule: str, pp: int, m: int, vpp_degree: int = 1) -> str:
    """The stage x time action table of ``schedule`` as text (one row per stage, unit-time
    slots, ``.`` idle; with ``vpp_degree`` > 1 a label ``F3.1`` is micro-batch 3, chunk 1).

    Example::

        >>> print(dt.pipelining.schedule_table("1F1B", pp=2, m=3))
        stage 0: F0 F1 .  B0 F2 B1 .  B2
        stage 1: .  F0 B0 F1 B1 F2 B2 .
    """
    v = vpp_degree
    actions = schedule_actions(schedule, pp, m, v)
    start = simulate(actions, v)
    span = max(t for st in start for t in st.values()) + 1
    cells = [["."] * span for _ in range(pp)]
    for s in range(pp):
        for a, t in start[s].items():
            cells[s][t] = a.label(v)
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(width) for c in row).rstrip()
                     for s, row in enumerate(cells))
