"""The stall probe's verdict (``collectives._stall.diagnose``) on the states ranks report: wait
while a missing rank may still come, end the job when one went past the call or in a deadlock."""
from collectives._stall import diagnose, state_line

W = (0, 1, 2, 3)


def blocked(ranks, index, name="barrier", site="job.py:9", waited=6.0, seq=None):
    """A rank blocked in call #index on ``ranks``; ``seq``: the calls it issued on the asking
    rank's group (index + 1 when that is ``ranks``)."""
    return ("in", ranks, index, name, (), site, waited, index + 1 if seq is None else seq)


def out(site="job.py:20", seq=0):
    return ("out", site, seq)


def test_everyone_in_the_same_call_keeps_waiting():
    states = {r: blocked(W, 2) for r in W}
    assert diagnose(0, states, 1.0) is None


def test_a_rank_computing_outside_any_collective_is_waited_for():
    states = {r: blocked(W, 2) for r in (0, 1, 2)}
    states[3] = out(seq=2)
    assert diagnose(0, states, 1.0) is None


def test_a_rank_that_did_not_answer_is_waited_for():
    assert diagnose(0, {r: blocked(W, 2) for r in (0, 1, 2)}, 1.0) is None


def test_the_stray_gather_against_a_barrier_is_a_deadlock_blaming_the_stray_rank():
    states = {r: blocked(W, 3, seq=4) for r in (0, 2, 3)}
    states[1] = blocked((1, 3), 4, "all_gather", "job.py:14 (through Tensor.numpy())", seq=3)
    for me in W:
        blame, text, ranks = diagnose(me, states, 1.0)
        assert blame == 1 and me in ranks and 1 in ranks
        assert "rank 1 is in another collective than the ranks it waits for" in text
        assert ("  rank 1: in all_gather() call #4 on group ranks [1, 3], called from job.py:14"
                in text)
        assert "  rank 0: in barrier() call #3 on group ranks [0, 1, 2, 3]" in text


def test_a_rank_blocked_for_less_than_the_window_may_be_passing_through():
    states = {r: blocked(W, 3) for r in (0, 2, 3)}
    states[1] = blocked((1, 3), 4, "all_gather", waited=0.5, seq=3)
    assert diagnose(0, states, 1.0) is None


def test_a_chain_ending_in_a_busy_rank_is_not_a_deadlock():
    # 0 waits for 1 on (0, 1); 1 waits for 2 on (1, 2); 2 computes
    states = {0: blocked((0, 1), 0), 1: blocked((1, 2), 0), 2: out()}
    assert diagnose(0, states, 1.0) is None


def test_a_rank_gone_past_the_call_ends_the_job():
    states = {0: blocked(W, 5, seq=6), 1: out(seq=8), 2: blocked(W, 5, seq=6),
              3: blocked(W, 5, seq=6)}
    blame, text, ranks = diagnose(0, states, 1.0)
    assert blame == 1 and ranks == [0]
    assert "rank 1 went past call #5 on group [0, 1, 2, 3]" in text and "issued 8 calls" in text
    assert "  rank 1: outside any collective, at job.py:20" in text


def test_state_lines():
    assert state_line(2, None) == "rank 2: did not answer"
    assert state_line(1, blocked((0, 1), -1, "new_group", waited=5.25)) == \
        "rank 1: in new_group() creating the group of ranks [0, 1], called from job.py:9 " \
        "(blocked 5.2 s)"
