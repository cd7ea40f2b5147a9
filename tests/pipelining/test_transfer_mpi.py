"""Point-to-point pieces between stages: ``ProcessGroup.isend`` and the stage hand-over of a
distributed tensor (layout, Partial included, and piece carried over)."""
from __future__ import annotations

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor.pipelining.transfer import TAG_BASE, recv_tensor, send_tensor

pytestmark = pytest.mark.mpi


def test_isend_ring_in_order_and_counted():
    g = collectives.init()
    before = collectives.collective_counts().get("send", 0)
    dst, src = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    handles = [g.isend(np.full((3, 2), 10.0 * g.rank + i), dst, tag=7) for i in range(3)]
    got = [g.recv((3, 2), np.float64, src, tag=7) for _ in range(3)]
    for h in handles:
        h.wait()
        h.wait()  # a second wait is a no-op
    for i, a in enumerate(got):
        np.testing.assert_array_equal(a, np.full((3, 2), 10.0 * src + i))
    assert collectives.collective_counts()["send"] - before == 3


def test_isend_refuses_a_bad_peer():
    g = collectives.init()
    with pytest.raises(ValueError, match="isend"):
        g.isend(np.zeros(2), g.size)


def test_stage_hand_over_keeps_layout_and_pieces():
    """Stage 0 = ranks [0, 1] of a [pp, mp] mesh (or the whole 1-row mesh) sends its Partial
    and Shard pieces to the matching ranks of the last stage."""
    n = collectives.init().size
    grid = [[0, 1], [2, 3]] if n == 4 else [[r] for r in range(n)]
    mesh = dt.ProcessMesh(grid, dim_names=["pp", "mp"])
    first, last = mesh.get_mesh_with_dim("pp", 0), mesh.get_mesh_with_dim("pp", len(grid) - 1)
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    me = dt.get_rank()
    for k, pl in enumerate([[dt.Shard(1)], [dt.Partial()], [dt.Replicate()]]):
        if pl == [dt.Partial()]:  # each member holds a share; the sum is value
            share = value / first.shape[0] if first.contains(me) else np.zeros((0, 0), np.float32)
            t = dt.dtensor_from_local(share, first, pl, shape=[4, 6])
        else:
            t = dt.reshard(dt.shard_tensor(value, first, [dt.Replicate()]), first, pl)
        handles = send_tensor(t, mesh.rank_at([len(grid) - 1, first.get_coord(me)[0]]),
                              TAG_BASE + k, note=10 + k) if first.contains(me) else []
        if last.contains(me):
            got, note = recv_tensor(last, mesh.rank_at([0, last.get_coord(me)[0]]),
                                    TAG_BASE + k)
            assert note == 10 + k
            assert got.placements == pl and got.shape == [4, 6] and not got.stop_gradient
            full = dt.reshard(got, last, [dt.Replicate()])._value.local.array
            np.testing.assert_allclose(full, value, rtol=1e-6)
        for h in handles:
            h.wait()
