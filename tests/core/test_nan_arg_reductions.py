"""argmax / argmin over a sharded axis with NaN agree with numpy on every rank: the index of the
first NaN (numpy's rule), also when the NaN sits on another rank's piece or several pieces hold
one."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
from disttensor import ProcessMesh, Replicate, Shard

pytestmark = pytest.mark.mpi


def global_array(n: int) -> np.ndarray:
    g = np.random.default_rng(11).standard_normal((4, 3 * n + 1))
    g[0, -1] = np.nan            # the last piece only
    g[1, 1] = g[1, -2] = np.nan  # the first and a later piece: the first one wins
    g[2, :] = np.nan             # all NaN
    return g                     # row 3: no NaN


@pytest.mark.parametrize("fn", ["argmax", "argmin"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_arg_reduction_over_sharded_axis_with_nan(fn, keepdim):
    n = dt.get_world_size()
    G = global_array(n)
    ref = getattr(np, fn)
    mesh = ProcessMesh(list(range(n)), dim_names=["x"])
    for pl in ([Shard(1)], [Shard(0)], [Replicate()]):
        x = dt.shard_tensor(G, mesh, pl)
        got = getattr(dt, fn)(x, axis=1, keepdim=keepdim).numpy()
        np.testing.assert_array_equal(got, ref(G, axis=1, keepdims=keepdim))
        assert getattr(dt, fn)(x).numpy() == ref(G)  # over all axes: flat index of the first NaN
        np.testing.assert_array_equal(getattr(dt, fn)(x, axis=0).numpy(), ref(G, axis=0))


def test_arg_reduction_on_a_2d_mesh_with_nan():
    n = dt.get_world_size()
    if n != 4:
        pytest.skip("needs 4 ranks")
    G = global_array(2)
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["a", "b"])
    x = dt.shard_tensor(G, mesh, [Shard(1), Shard(0)])
    for fn in ("argmax", "argmin"):
        np.testing.assert_array_equal(getattr(dt, fn)(x, axis=1).numpy(),
                                      getattr(np, fn)(G, axis=1))
        np.testing.assert_array_equal(getattr(dt, fn)(x, axis=0).numpy(),
                                      getattr(np, fn)(G, axis=0))
