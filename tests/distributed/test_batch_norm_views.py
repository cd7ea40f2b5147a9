"""batch_norm's views after a reshard and its running
statistics under every input placement, and reshape by the dim-trans algorithm with counted
communication and aliasing of zero-communication results."""
import numpy as np
import pytest

import collectives
import disttensor as dt
import disttensor.nn.functional as F
from disttensor import Partial, Replicate, Shard
from disttensor.dispatch import apply

pytestmark = pytest.mark.mpi

N, C = 6, 4
MOMENTUM, EPS = 0.9, 1e-5


def _mesh_2x2():
    if dt.get_world_size() < 4:
        pytest.skip("needs 4 ranks for the 2x2 mesh")
    return dt.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def _dense_bn(x, rm, rv, w, b, dout):
    mean = x.mean(0)
    var = x.var(0)
    rstd = 1.0 / np.sqrt(var + EPS)
    xhat = (x - mean) * rstd
    out = xhat * w + b
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.mean(0) - xhat * (dxhat * xhat).mean(0))
    return out, dx, (dout * xhat).sum(0), dout.sum(0), \
        MOMENTUM * rm + (1 - MOMENTUM) * mean, MOMENTUM * rv + (1 - MOMENTUM) * var


CASES = {
    "x S(0), mean/var R": ([Shard(0), Replicate()], [Replicate(), Replicate()]),
    "x S(1), mean/var S(0)": ([Replicate(), Shard(1)], [Replicate(), Shard(0)]),
    "x R, mean/var R": ([Replicate(), Replicate()], [Replicate(), Replicate()]),
    "x S(0)xS(1) 2-d": ([Shard(0), Shard(1)], [Replicate(), Shard(0)]),
    "x S(0), mean/var S(0) same mesh dim": ([Shard(0), Replicate()], [Shard(0), Replicate()]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_norm_training_step(case, comm):
    mesh = _mesh_2x2()
    x_pl, stat_pl = CASES[case]
    rng = np.random.default_rng(7)
    X = rng.standard_normal((N, C))
    RM, RV = rng.standard_normal(C), rng.random(C) + 0.5
    W, B = rng.standard_normal(C), rng.standard_normal(C)
    DOUT = rng.standard_normal((N, C))
    x = dt.shard_tensor(X, mesh, x_pl, stop_gradient=False)
    rm = dt.shard_tensor(RM, mesh, stat_pl)
    rv = dt.shard_tensor(RV, mesh, stat_pl)
    w = dt.shard_tensor(W, mesh, stat_pl, stop_gradient=False)
    b = dt.shard_tensor(B, mesh, stat_pl, stop_gradient=False)
    v0 = rm.inplace_version
    out = F.batch_norm(x, rm, rv, w, b, training=True, momentum=MOMENTUM, epsilon=EPS)
    (out * dt.shard_tensor(DOUT, mesh, x_pl)).sum().backward()

    ref_out, ref_dx, ref_dw, ref_db, ref_rm, ref_rv = _dense_bn(X, RM, RV, W, B, DOUT)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(x.grad.numpy(), ref_dx, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(w.grad.numpy(), ref_dw, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(b.grad.numpy(), ref_db, rtol=1e-9, atol=1e-10)
    # running statistics: updated in the caller's tensors, which keep their placements
    np.testing.assert_allclose(rm.numpy(), ref_rm, rtol=1e-10)
    np.testing.assert_allclose(rv.numpy(), ref_rv, rtol=1e-10)
    assert rm.placements == stat_pl and rv.placements == stat_pl
    assert rm.inplace_version > v0
    assert x.grad.placements == x_pl and w.grad.placements == stat_pl


def test_batch_norm_running_stats_are_its_outputs(comm):
    """mean -> mean_out, variance -> variance_out are mutated pairs (Paddle's batch_norm_): the
    outputs are the running-statistics tensors themselves, whatever layout the kernel read."""
    mesh = _mesh_2x2()
    rng = np.random.default_rng(3)
    X = rng.standard_normal((N, C))
    x = dt.shard_tensor(X, mesh, [Shard(0), Replicate()])
    op = dt.OPS["batch_norm"]
    attrs = {"training": True, "momentum": MOMENTUM, "epsilon": EPS, "data_format": "NCHW"}
    # (a) running stats already in the layout the rule wants: the kernel writes them directly
    rm = dt.shard_tensor(np.zeros(C), mesh, [Replicate(), Replicate()])
    rv = dt.shard_tensor(np.ones(C), mesh, [Replicate(), Replicate()])
    holder, v0 = rm._value.local.holder, rm.inplace_version
    outs = apply(op, (x, rm, rv, None, None), attrs)
    assert outs[1] is rm and outs[2] is rv
    assert rm._value.local.holder is holder and rm.inplace_version == v0 + 1
    np.testing.assert_allclose(rm.numpy(), (1 - MOMENTUM) * X.mean(0))
    # (b) running stats sharded on the mesh dim that shards x's batch: the kernel reads a
    # resharded temporary and the result is written back into rm2 in its own layout.
    rm2 = dt.shard_tensor(np.zeros(C), mesh, [Shard(0), Replicate()])
    rv2 = dt.shard_tensor(np.ones(C), mesh, [Shard(0), Replicate()])
    holder = rm2._value.local.holder
    outs = apply(op, (x, rm2, rv2, None, None), attrs)
    assert outs[1] is rm2 and rm2._value.local.holder is holder
    np.testing.assert_allclose(rm2.numpy(), (1 - MOMENTUM) * X.mean(0))
    assert rm2.placements == [Shard(0), Replicate()]


def _count(fn):
    collectives.reset_collective_counts()
    out = fn()
    return out, sum(collectives.collective_counts().values())


def _mesh_1d(n=None):
    n = n or dt.get_world_size()
    return dt.ProcessMesh(list(range(n)))


RESHAPE_CASES = [
    # (global shape, placements per tensor dim sharded, target, expect communication)
    ((8, 6), 1, (48,), False),       # S(1) inside a Flatten: a strided shard, no comm
    ((8, 6), 0, (48,), None),        # S(0) leftmost of a Flatten: free when 8 % n == 0
    ((6, 12, 48), 0, (72, 6, 8), None),
    ((6, 12, 48), 1, (72, 6, 8), False),  # the same, with a Split after it
    ((6, 12, 48), 2, (72, 6, 8), None),
    ((2, 3), 0, (3, 2), None),
    ((2, 3), 1, (3, 2), True),
    ((7, 5), 0, (35,), None),        # uneven on 2, 3, 4 ranks
    ((5, 4), 0, (5, 2, 2), False),   # InputDim keeps any sharding, uneven included
]


@pytest.mark.parametrize("shape,dim,target,comm_expected", RESHAPE_CASES)
def test_reshape_dim_trans(shape, dim, target, comm_expected, comm):
    mesh = _mesh_1d()
    n = dt.get_world_size()
    X = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    x = dt.shard_tensor(X, mesh, [Shard(dim)])
    y, ncoll = _count(lambda: x.reshape(list(target)))
    np.testing.assert_array_equal(y.numpy(), X.reshape(target))
    if n == 1:
        assert ncoll == 0
    elif comm_expected is not None:
        assert (ncoll > 0) == comm_expected, (ncoll, y.placements)
    if ncoll == 0:
        # zero communication: the result is a view of the input's buffer
        assert y._value.local.holder is x._value.local.holder
        assert np.shares_memory(y._value.local.array, x._value.local.array) or \
            y._value.local.array.size == 0
    if comm_expected is False and dim > 0 and n > 1:  # flattened into the dim before it
        assert y.placements == [Shard(0, split_factor=shape[0])], y.placements
    # divisible leftmost-of-Flatten and Split-first-piece shardings survive
    if shape in ((6, 12, 48), (8, 6)) and dim == 0 and shape[0] % n == 0:
        assert ncoll == 0 and y.placements == [Shard(0)]


def test_reshape_backward_and_partial(comm):
    mesh = _mesh_1d()
    X = np.arange(24.0).reshape(4, 6)
    x = dt.shard_tensor(X, mesh, [Shard(1)], stop_gradient=False)
    y = x.reshape([2, 12])
    (y * y).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * X)
    assert x.grad.placements == [Shard(1)]
    # a Partial(sum) input stays Partial through reshape (linear) with no communication
    p = dt.dtensor_from_local(np.full((4, 6), 1.0), mesh, [Partial()])
    q, ncoll = _count(lambda: p.reshape([24]))
    assert ncoll == 0 and q.placements == [Partial()]
    np.testing.assert_allclose(q.numpy(), np.full(24, float(dt.get_world_size())))
