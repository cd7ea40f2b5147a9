"""Schedule tables: every action once, dependencies respected, activation bounds, bubbles."""
import pytest

from disttensor.pipelining import (
    Action,
    bubble_fraction,
    schedule_actions,
    schedule_table,
    simulate,
    theoretical_bubble,
)

CASES = [("FThenB", 1), ("1F1B", 1), ("VPP", 2), ("VPP", 3)]


def _peak_live(actions):
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule,v,pp,m", [
    (s, v, pp, m) for s, v in CASES
    for pp, m in [(1, 1), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (2, 8), (3, 5)]
    if s != "VPP" or m % pp == 0])
def test_every_action_once_and_no_deadlock(schedule, v, pp, m):
    acts = schedule_actions(schedule, pp, m, v)
    want = {Action(k, i, c) for k in "FB" for i in range(m) for c in range(v)}
    for stage in acts:
        assert len(stage) == len(want) and set(stage) == want
    start = simulate(acts, v)
    for s in range(pp):  # a backward after its own forward on the stage
        for a, t in start[s].items():
            if a.kind == "B":
                assert t > start[s][Action("F", a.mb, a.chunk)]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 3)])
def test_one_f_one_b_bounds_activations(pp, m):
    acts = schedule_actions("1F1B", pp, m)
    for s in range(pp):
        assert _peak_live(acts[s]) == min(pp - s, m)
    assert _peak_live(schedule_actions("FThenB", pp, m)[0]) == m


@pytest.mark.parametrize("schedule,v", CASES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (2, 8), (4, 4)])
def test_bubble_matches_theory(schedule, v, pp, m):
    got = bubble_fraction(schedule_actions(schedule, pp, m, v), v)
    assert got == pytest.approx(theoretical_bubble(pp, m, v))
    assert theoretical_bubble(pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_table_text():
    assert schedule_table("1F1B", 2, 3) == ("stage 0: F0 F1 .  B0 F2 B1 .  B2\n"
                                            "stage 1: .  F0 B0 F1 B1 F2 B2 .")
    assert schedule_table("FThenB", 2, 2) == ("stage 0: F0 F1 .  .  B0 B1\n"
                                              "stage 1: .  F0 F1 B0 B1 .")
    assert "F1.1" in schedule_table("VPP", 2, 2, vpp_degree=2)


def test_deadlock_detected():
    bad = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)


@pytest.mark.parametrize("args,match", [
    (("GPipe", 2, 4), "schedule must be one of"),
    (("1F1B", 0, 4), "pp must be a positive int"),
    (("1F1B", 2, 4, 2), "vpp_degree=2 needs schedule 'VPP'"),
    (("VPP", 4, 6, 2), "multiple of pp"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        schedule_actions(*args)
