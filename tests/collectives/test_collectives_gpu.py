"""cupy arrays (NCCL or host staging). Skipped where there is no CUDA device."""
import numpy as np
import pytest

import collectives

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["mpi", "auto"])
def test_gpu_collectives_match_numpy(monkeypatch, backend):
    import cupy as cp

    if backend == "mpi":
        monkeypatch.setenv("DISTTENSOR_BACKEND", "mpi")
    g = collectives.init()
    if hasattr(g, "_gpu"):
        g._gpu = None  # re-pick the backend for this parametrisation
    k, me = g.size, g.rank
    x = np.arange(12.0).reshape(3, 4) + me
    xs = [np.arange(12.0).reshape(3, 4) + r for r in range(k)]
    np.testing.assert_allclose(cp.asnumpy(g.all_reduce(cp.asarray(x))), sum(xs))
    np.testing.assert_allclose(cp.asnumpy(g.all_gather(cp.asarray(x), axis=1)),
                               np.concatenate(xs, axis=1))
    np.testing.assert_allclose(cp.asnumpy(g.reduce_scatter(cp.asarray(x), axis=0)),
                               np.array_split(sum(xs), k)[me])
    got = g.all_to_all(cp.asarray(x), 0, 1)
    np.testing.assert_allclose(cp.asnumpy(got),
                               np.concatenate([np.array_split(v, k)[me] for v in xs], axis=1))
    np.testing.assert_allclose(cp.asnumpy(g.broadcast(cp.asarray(x), src=0)), xs[0])
