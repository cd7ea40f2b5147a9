"""Collective headers (``collectives._headers``): the encoding, and under MPI that ranks in
different calls raise the same error on every rank before any data moves, with each value
computed by numpy on the global data afterwards (the group stays usable)."""
import mmap

import numpy as np
import pytest

import collectives
from collectives._common import REDUCE_OPS, CollectiveMismatchError
from collectives._headers import KINDS, SEQ_SHIFT, SLOTS, Board, decode, header, with_seq


def test_header_fields_round_trip_and_differ():
    h = with_seq(header("all_gather", None, 48), 5)
    assert decode(h) == "all_gather of 48 bytes as call #5"
    assert decode(with_seq(header("all_reduce", "max", 8), 3)) == \
        "all_reduce(max) of 8 bytes as call #3"
    heads = {with_seq(header(n, op, b), s) for (n, op) in KINDS for b in (0, 8, 16) for s in (0, 1)}
    assert len(heads) == len(KINDS) * 3 * 2  # every field changes the header
    assert 0 not in heads  # an unwritten word is never a header
    assert len(KINDS) == 3 * len(REDUCE_OPS) + 6 and min(KINDS.values()) == 1


def test_board_wait_returns_the_row_of_a_mismatch_and_none_on_agreement():
    b = Board(mmap.mmap(-1, SLOTS * 3 * 8), 3, 0)
    h = with_seq(header("barrier", None, 0), 6)
    row = b.rows[6 % SLOTS]
    row[0] = row[1] = row[2] = h
    assert b.wait(row, h) is None
    other = with_seq(header("broadcast", None, 16), 6)
    row[2] = other
    assert b.wait(row, h) == [h, h, other]
    b.close()


@pytest.mark.mpi
def test_ranks_in_different_calls_raise_the_same_error_and_exchange_nothing():
    g = collectives.init()
    if g.size == 1 or g._board is None:
        pytest.skip("needs 2+ ranks sharing a node")
    k, me = g.size, g.rank
    x = np.full((2, 3 + (me == 0)), float(me))  # rank 0 gathers 4 columns, the others 3
    out = np.full((2 * k, 3 + (me == 0)), -1.0)
    with pytest.raises(CollectiveMismatchError) as e:
        g.all_gather(x, 0, sizes=[2] * k, out=out)
    assert (out == -1.0).all()  # nothing arrived
    text = str(e.value)
    assert f"rank 0 called a different collective than other ranks of group {list(g.ranks)}" in text
    assert "no data was exchanged" in text and "test_headers.py" in text
    assert text.count("all_gather(shape(except axis)=(None, 4)") == 1
    assert text.count("all_gather(shape(except axis)=(None, 3)") == k - 1
    assert g.exchange_metadata(text) == [text] * k  # the same error on every rank
    assert e.value.failing_ranks == [0]
    # the group goes on: the next calls pair as numpy says
    got = g.all_gather(np.full((1, 2), float(me)), 0, sizes=[1] * k)
    np.testing.assert_array_equal(got, np.repeat(np.arange(k, dtype=float), 2).reshape(k, 2))
    np.testing.assert_array_equal(g.all_reduce(np.ones(3) * me), np.ones(3) * sum(range(k)))


@pytest.mark.mpi
def test_a_reduce_op_mismatch_is_an_error_not_a_hang():
    g = collectives.init()
    if g.size == 1 or g._board is None:
        pytest.skip("needs 2+ ranks sharing a node")
    with pytest.raises(CollectiveMismatchError, match=r"op=max(.|\n)*op=sum|op=sum(.|\n)*op=max"):
        g.all_reduce(np.ones(4), "max" if g.rank == g.size - 1 else "sum")
    assert g.all_reduce(np.ones(2), "max").tolist() == [1.0, 1.0]


def test_header_shift_leaves_room_for_kind_and_bytes():
    assert SEQ_SHIFT == 40 and with_seq(0, 1) == 1 << 40
