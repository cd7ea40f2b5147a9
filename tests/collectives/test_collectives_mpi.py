"""Multi-rank tests of collectives against a numpy oracle. Valid for any world size.

Every rank can build every other rank's input (deterministic per-rank data), so the expected
result is computed locally with numpy.
"""
import numpy as np
import pytest

import collectives
from collectives import _common

pytestmark = pytest.mark.mpi

DTYPES = [np.float32, np.float64, np.int64]


def data(rank, shape, dtype, salt=0):
    """Deterministic per-rank array with small values (exact in every dtype used here)."""
    n = int(np.prod(shape, dtype=np.int64))
    v = (np.arange(n, dtype=np.int64) * 7 + rank * 13 + salt * 5) % 11 - 3
    return v.reshape(shape).astype(dtype)


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if np.dtype(dtype) == np.float32 else dict(rtol=1e-12, atol=0)


def pieces(n, k):
    return _common.split_sizes(n, k)


@pytest.fixture
def g():
    return collectives.init()


@pytest.fixture
def chunked(monkeypatch):
    """Force the chunked large-count path with a tiny limit."""
    from collectives import _mpi_types

    monkeypatch.setattr(_mpi_types, "NATIVE_LARGE_COUNT", False)
    monkeypatch.setattr(_mpi_types, "MAX_COUNT", 5)
    return _mpi_types


def test_world_matches_comm(g, comm):
    assert g.size == comm.size and g.rank == comm.rank
    assert g.ranks == tuple(range(comm.size))
    assert collectives.get_rank() == comm.rank
    assert collectives.get_world_size() == comm.size
    assert collectives.init() is g and collectives.world() is g


# ----------------------------------------------------------------------------- all_reduce
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
@pytest.mark.parametrize("shape", [(5, 3), (0,), ()])
def test_all_reduce(g, dtype, op, shape):
    if op == "avg" and np.dtype(dtype).kind == "i":
        with pytest.raises(TypeError, match="all_reduce.*avg.*int64"):
            g.all_reduce(data(g.rank, shape, dtype), op)
        return
    xs = [data(r, shape, dtype) for r in range(g.size)]
    if op == "prod":  # keep products small
        xs = [np.where(x == 0, 1, np.sign(x)).astype(dtype) * (1 + (r % 2)) for r,
              x in enumerate(xs)]
    st = np.stack(xs)
    expect = {"sum": st.sum(0), "max": st.max(0), "min": st.min(0), "prod": st.prod(0),
              "avg": st.sum(0) / g.size}[op].astype(dtype)
    got = g.all_reduce(xs[g.rank].copy(), op)
    assert got.dtype == np.dtype(dtype) and got.shape == tuple(shape)
    np.testing.assert_allclose(got, expect, **tol(dtype))


def test_all_reduce_enum_op_and_bool(g):
    import enum

    class RT(str, enum.Enum):
        SUM = "sum"
        MAX = "max"

    x = data(g.rank, (4,), np.float64)
    np.testing.assert_allclose(g.all_reduce(x, RT.SUM), sum(data(r, (4,), np.float64)
                                                            for r in range(g.size)))
    b = np.array([g.rank == 0, False, True])
    np.testing.assert_array_equal(g.all_reduce(b, "sum"), [True, False, True])
    np.testing.assert_array_equal(g.all_reduce(b, "min"), [g.size == 1, False, True])
    h = np.ones(3, np.float16)
    assert g.all_reduce(h).dtype == np.float16 and np.all(g.all_reduce(h) == g.size)


def test_all_reduce_noncontiguous_input(g):
    x = data(g.rank, (6, 4), np.float64)[:, ::2]
    expect = sum(data(r, (6, 4), np.float64)[:, ::2] for r in range(g.size))
    np.testing.assert_allclose(g.all_reduce(x), expect)


# ---------------------------------------------------------------------------- iall_reduce
@pytest.mark.parametrize("dtype,op", [(np.float32, "sum"), (np.float64, "avg"), (np.int64, "max"),
                                      (np.float16, "sum"), (np.float32, "avg"), (bool, "min")])
def test_iall_reduce_in_place_equals_numpy(g, dtype, op):
    """Several started at once, a blocking all_reduce in between, waited out of order: each
    returns its own input array holding numpy's reduction of every rank's array."""
    shapes = [(5, 3), (7,), (0,), ()]
    xs = [[data(r, s, dtype, salt=k) for r in range(g.size)] for k, s in enumerate(shapes)]
    before = collectives.collective_counts()["all_reduce"]
    mine = [x[g.rank].copy() for x in xs]
    handles = [g.iall_reduce(m, op) for m in mine]
    mid = g.all_reduce(data(g.rank, (4,), np.float64), "sum")
    got = [h.wait() for h in reversed(handles)][::-1]
    assert collectives.collective_counts()["all_reduce"] == before + len(shapes) + 1
    np.testing.assert_allclose(mid, sum(data(r, (4,), np.float64) for r in range(g.size)))
    for x, m, out in zip(xs, mine, got):
        st = np.stack(x)
        expect = {"sum": st.sum(0), "avg": st.sum(0) / g.size, "max": st.max(0),
                  "min": st.min(0)}[op].astype(dtype)
        assert out is m and out.dtype == np.dtype(dtype)
        np.testing.assert_allclose(out, expect, **(tol(dtype) if dtype is not np.float16
                                                   else dict(rtol=1e-3)))
    assert handles[0].wait() is mine[0] and handles[0].test()


def test_iall_reduce_bad_input_raises_before_communicating(g):
    before = collectives.collective_counts()
    with pytest.raises(ValueError, match=r"iall_reduce: argument 'x' \(shape=\(4, 2\) "
                                         r"dtype=float64\) must be C-contiguous"):
        g.iall_reduce(np.ones((4, 4))[:, ::2])
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="iall_reduce: argument 'x'.*writable"):
        g.iall_reduce(ro)
    with pytest.raises(TypeError, match="iall_reduce: reduce op 'avg'.*int64"):
        g.iall_reduce(np.ones(3, np.int64), "avg")
    assert collectives.collective_counts() == before


# ----------------------------------------------------------------------------- all_gather
def gather_sizes(k, mode):
    if mode == "uneven":
        return [(2 * r + 1) % 3 for r in range(k)]  # 1, 0, 2, 1, ...
    if mode == "few":  # fewer elements than ranks
        return pieces(2, k)
    return [3] * k


@pytest.fixture(params=["interleave", "strided"])
def gather_path(request, monkeypatch):
    """all_gather along a non-leading axis both ways: flat Allgather + interleave, and
    receives straight into place through vector datatypes."""
    if request.param == "strided" and collectives.is_mpi():
        from collectives import _mpi

        monkeypatch.setattr(_mpi, "STRIDED_MIN_BYTES", 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["uneven", "few", "even"])
@pytest.mark.parametrize("axis,ndim", [(0, 2), (1, 3), (-1, 3)])
@pytest.mark.parametrize("pass_sizes", [False, True])
def test_all_gather(g, dtype, mode, axis, ndim, pass_sizes, gather_path):
    sizes = gather_sizes(g.size, mode)
    base = [2, 3, 4][:ndim]
    ax = axis % ndim

    def x_of(r):
        shp = list(base)
        shp[ax] = sizes[r]
        return data(r, shp, dtype)

    expect = np.concatenate([x_of(r) for r in range(g.size)], axis=ax)
    got = g.all_gather(x_of(g.rank), axis=axis, sizes=sizes if pass_sizes else None)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expect)


def test_all_gather_out(g, gather_path):
    sizes = gather_sizes(g.size, "uneven")
    for axis, shape_of in ((0, lambda k: (k, 3)), (1, lambda k: (4, k, 2))):
        xs = [data(r, shape_of(sizes[r]), np.float64) for r in range(g.size)]
        out = np.full(shape_of(sum(sizes)), np.nan)
        res = g.all_gather(xs[g.rank], axis, sizes=sizes, out=out)
        assert res is out
        np.testing.assert_array_equal(out, np.concatenate(xs, axis))


# ------------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 2, 7])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(g, dtype, n, axis, op):
    shape = [3, 2, 4]
    shape[axis] = n
    xs = [data(r, shape, dtype) for r in range(g.size)]
    st = np.stack(xs)
    full = st.sum(0) if op == "sum" else st.max(0)
    expect = np.array_split(full, g.size, axis=axis)[g.rank]
    got = g.reduce_scatter(xs[g.rank], op, axis=axis)
    assert got.shape == expect.shape and got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, expect, **tol(dtype))


def test_reduce_scatter_sizes_and_avg(g):
    n = 5
    sizes = [0] * g.size
    sizes[-1] = n - 1
    sizes[0] += 1
    xs = [data(r, (2, n), np.float64) for r in range(g.size)]
    full = np.stack(xs).mean(0)
    offs = _common.offsets(sizes)
    got = g.reduce_scatter(xs[g.rank], "avg", axis=1, sizes=sizes)
    np.testing.assert_allclose(got, full[:, offs[g.rank]:offs[g.rank] + sizes[g.rank]])


# ----------------------------------------------------------------------------- all_to_all
A2A_AXES = [(0, 0), (0, 1), (1, 0), (1, 2), (1, 1), (2, 1)]


def a2a_input(r, s, c, n, dtype, k):
    """Per-rank input: split axis has n entries (per-rank varying if s == c); the concat axis
    varies per rank when s != c (uneven, possibly empty)."""
    shape = [2, 3, 2]
    if s == c:
        shape[s] = n + (r % 2)
    else:
        shape[s] = n
        shape[c] = r % 3
    return data(r, shape, dtype)


def a2a_oracle(xs, me, s, c, k):
    return np.concatenate([np.array_split(x, k, axis=s)[me] for x in xs], axis=c)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,c", A2A_AXES)
@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("pass_recv", [False, True])
def test_all_to_all(g, dtype, s, c, n, pass_recv):
    k = g.size
    xs = [a2a_input(r, s, c, n, dtype, k) for r in range(k)]
    expect = a2a_oracle(xs, g.rank, s, c, k)
    recv = None
    if pass_recv:
        recv = [np.array_split(x, k, axis=s)[g.rank].shape[c] for x in xs]
    got = g.all_to_all(xs[g.rank], s, c, recv_sizes=recv)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, expect)


def test_all_to_all_split_sizes(g):
    k = g.size
    ss = [0] * k
    ss[0] = 3  # everything to rank 0
    xs = [data(r, (3, 2), np.float32) for r in range(k)]
    got = g.all_to_all(xs[g.rank], 0, 1, split_sizes=ss)
    want_rows = 3 if g.rank == 0 else 0
    expect = np.concatenate([x[:want_rows] for x in xs], axis=1)
    np.testing.assert_array_equal(got, expect)


# -------------------------------------------------------------------- broadcast, p2p, barrier
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(g, dtype):
    for src in range(g.size):
        x = data(g.rank, (4, 3), dtype)
        got = g.broadcast(x, src=src)
        np.testing.assert_array_equal(got, data(src, (4, 3), dtype))
        np.testing.assert_array_equal(x, data(g.rank, (4, 3), dtype))  # input untouched


def test_send_recv_ring(g):
    k, me = g.size, g.rank
    dst, src = (me + 1) % k, (me - 1) % k
    x = data(me, (3, 5), np.float64)
    if me % 2 == 0:
        g.send(x, dst)
        got = g.recv((3, 5), np.float64, src)
    else:
        got = g.recv((3, 5), np.float64, src)
        g.send(x, dst)
    np.testing.assert_array_equal(got, data(src, (3, 5), np.float64))
    g.barrier()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sendrecv_ring_and_pairs(g, dtype):
    """A ring shift with pieces of different shapes per rank, then pairwise exchanges
    (odd sizes leave the last rank to itself), into a given buffer."""
    k, me = g.size, g.rank
    dst, src = (me + 1) % k, (me - 1) % k
    got = g.sendrecv(data(me, (me + 1, 3), dtype), dst, src, recv_shape=(src + 1, 3))
    np.testing.assert_array_equal(got, data(src, (src + 1, 3), dtype))
    peer = me ^ 1 if (me ^ 1) < k else me
    out = np.empty((2, 5), dtype)
    x = data(me, (2, 5), dtype, salt=1)
    assert g.sendrecv(x, peer, out=out) is out
    np.testing.assert_array_equal(out, data(peer, (2, 5), dtype, salt=1))
    assert not np.shares_memory(out, x)
    with pytest.raises(ValueError, match=r"sendrecv: recv_shape=\[1\] but group rank .* own x"):
        g.sendrecv(x, me, recv_shape=(1,))
    if k > 1:
        with pytest.raises(ValueError, match="sendrecv: group rank .* sends to .* but receives"):
            g.sendrecv(x, me, (me + 1) % k)


# ------------------------------------------------------------------------------ chunking
def test_chunked_large_count_path(g, chunked):
    k, me = g.size, g.rank
    assert chunked.MAX_COUNT == 5 and not chunked.NATIVE_LARGE_COUNT
    xs = [data(r, (7, 3), np.float64) for r in range(k)]
    np.testing.assert_allclose(g.all_reduce(xs[me]), sum(xs))
    sizes = gather_sizes(k, "uneven")
    gx = [data(r, (2, sizes[r], 3), np.float32) for r in range(k)]
    np.testing.assert_array_equal(g.all_gather(gx[me], axis=1), np.concatenate(gx, axis=1))
    np.testing.assert_array_equal(g.all_gather(gx[me], axis=1, sizes=sizes),
                                  np.concatenate(gx, axis=1))
    np.testing.assert_allclose(g.reduce_scatter(xs[me], axis=0), np.array_split(sum(xs), k)[me])
    np.testing.assert_allclose(g.reduce_scatter(xs[me], "avg", axis=1),
                               np.array_split(sum(xs) / k, k, axis=1)[me])
    for s, c in A2A_AXES:
        ax = [a2a_input(r, s, c, 7, np.int64, k) for r in range(k)]
        np.testing.assert_array_equal(g.all_to_all(ax[me], s, c), a2a_oracle(ax, me, s, c, k))
        recv = [np.array_split(x, k, axis=s)[me].shape[c] for x in ax]
        np.testing.assert_array_equal(g.all_to_all(ax[me], s, c, recv_sizes=recv),
                                      a2a_oracle(ax, me, s, c, k))
    np.testing.assert_array_equal(g.broadcast(xs[me], src=k - 1), xs[k - 1])
    np.testing.assert_array_equal(g.sendrecv(xs[me], (me + 1) % k, (me - 1) % k), xs[(me - 1) % k])
    if k > 1:
        if me == 0:
            g.send(xs[0], 1)
        elif me == 1:
            np.testing.assert_array_equal(g.recv((7, 3), np.float64, 0), xs[0])


# ------------------------------------------------------------------------------ counters
def test_counters(g):
    collectives.reset_collective_counts()
    x = data(g.rank, (4,), np.float64)
    g.all_reduce(x)
    g.all_gather(x)  # includes an internal size exchange: not counted
    g.reduce_scatter(np.ones((g.size, 2)))
    g.all_to_all(np.ones((g.size, 2)), 0, 0)
    g.broadcast(x)
    g.sendrecv(x, g.rank)
    g.barrier()
    g.send(x, g.rank)
    g.recv((4,), np.float64, g.rank)
    counts = collectives.collective_counts()
    assert counts == {name: 1 for name in collectives.COLLECTIVE_NAMES}
    collectives.reset_collective_counts()
    assert set(collectives.collective_counts().values()) == {0}


# ------------------------------------------------------------------------------- groups
def test_new_group_order_and_cache(g):
    ranks = list(reversed(range(g.size)))
    sub = collectives.new_group(ranks)
    assert collectives.new_group(tuple(ranks)) is sub
    assert sub.ranks == tuple(ranks) and sub.size == g.size
    assert sub.rank == ranks.index(g.rank)
    got = sub.all_gather(np.array([g.rank]))
    np.testing.assert_array_equal(got, ranks)


def test_new_group_non_member(g):
    if g.size == 1:
        with pytest.raises(ValueError, match=r"ranks \[1\] out of range for world size 1"):
            collectives.new_group([1])
        return
    others = [r for r in range(g.size) if r != g.rank]
    with pytest.raises(ValueError, match=rf"caller \(global rank {g.rank}\) is not in ranks"):
        collectives.new_group(others)


def test_even_odd_groups(g):
    mine = [r for r in range(g.size) if r % 2 == g.rank % 2]
    sub = collectives.new_group(mine)
    got = sub.all_reduce(np.array([float(g.rank)]))
    assert got[0] == sum(mine)


@pytest.mark.mpi(min_size=4)
def test_grid_rows_and_columns_at_once(g):
    if g.size != 4:
        pytest.skip("needs exactly 4 ranks")
    i, j = divmod(g.rank, 2)
    row = collectives.new_group([2 * i, 2 * i + 1])
    col = collectives.new_group([j, 2 + j])
    assert row.rank == j and col.rank == i
    x = data(g.rank, (3, 2), np.float64)
    for _ in range(3):  # interleave traffic on both groups
        r = row.all_reduce(x)
        c = col.all_gather(x, axis=1)
        np.testing.assert_allclose(r, data(2 * i, (3, 2), np.float64)
                                   + data(2 * i + 1, (3, 2), np.float64))
        np.testing.assert_array_equal(c, np.concatenate([data(j, (3, 2), np.float64),
                                                         data(2 + j, (3, 2), np.float64)], axis=1))
        rs = col.reduce_scatter(np.ones((5, 2)) * g.rank, axis=0)
        np.testing.assert_allclose(rs, np.array_split(np.ones((5, 2)) * (j + 2 + j), 2)[i])
        a = row.all_to_all(np.arange(4.0).reshape(2, 2) + 10 * g.rank, 0, 1)
        np.testing.assert_array_equal(a, np.concatenate(
            [np.arange(4.0).reshape(2, 2)[j:j + 1] + 10 * (2 * i + s) for s in range(2)], axis=1))


# ---------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_on_every_rank(g):
    x = data(g.rank, (4, 3), np.float64)
    with pytest.raises(ValueError,
                       match=r"all_gather: argument 'axis'=2 is out of range .*\(4, 3\)"):
        g.all_gather(x, axis=2)
    with pytest.raises(ValueError, match=rf"broadcast: argument 'src'={g.size} is out of range"):
        g.broadcast(x, src=g.size)
    with pytest.raises(ValueError, match="send: argument 'dst'=-1"):
        g.send(x, -1)
    with pytest.raises(ValueError, match="all_reduce: unsupported reduce op 'mean'"):
        g.all_reduce(x, "mean")
    with pytest.raises(TypeError, match=r"reduce_scatter: reduce op 'avg' is not supported for "
                                        r"dtype int64 \(shape=\(4, 3\)\)"):
        g.reduce_scatter(x.astype(np.int64), "avg")
    with pytest.raises(TypeError, match="complex"):
        g.all_reduce(x.astype(np.complex128), "max")
    ro = np.empty((4, 3))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="all_reduce: argument 'out'.*read-only"):
        g.all_reduce(x, out=ro)
    with pytest.raises(ValueError, match="all_reduce: argument 'out'.*C-contiguous"):
        g.all_reduce(x, out=np.empty((3, 4)).T)
    with pytest.raises(ValueError, match="all_reduce: argument 'out' has shape=\\(4,\\)"):
        g.all_reduce(x, out=np.empty(4))
    with pytest.raises(ValueError, match="reduce_scatter: argument 'sizes'.*sums to"):
        g.reduce_scatter(x, sizes=[5] + [0] * (g.size - 1))
    with pytest.raises(ValueError, match="all_to_all: argument 'concat_axis'=3"):
        g.all_to_all(x, 0, 3)
    with pytest.raises(ValueError, match="recv: argument 'src'"):
        g.recv((2,), np.float64, g.size + 3)
    g.barrier()  # nothing was left half-done


# --------------------------------------------------------------------------- prepared calls
PREPARED = [
    ("all_reduce", lambda k, r: (5, 3), {"op": "sum"}),
    ("all_reduce", lambda k, r: (4,), {"op": "max"}),
    ("all_gather", lambda k, r: (gather_sizes(k, "uneven")[r], 3), {"axis": 0}),
    ("all_gather", lambda k, r: (2, gather_sizes(k, "uneven")[r], 3), {"axis": 1}),
    ("all_gather", lambda k, r: (0, gather_sizes(k, "even")[r]), {"axis": 1}),  # empty outer dim
    ("all_gather", lambda k, r: (1, gather_sizes(k, "few")[r], 2), {"axis": 1}),
    ("all_gather", lambda k, r: (2, gather_sizes(k, "even")[r], 2), {"axis": 1}),
    ("reduce_scatter", lambda k, r: (2 * k + 1, 3), {"op": "sum", "axis": 0}),
    ("reduce_scatter", lambda k, r: (3, 2 * k + 1), {"op": "min", "axis": 1}),
    ("all_to_all", lambda k, r: (k + 2, 2 * k), {"split_axis": 1, "concat_axis": 0}),
    ("all_to_all", lambda k, r: (2 * k, 3), {"split_axis": 0, "concat_axis": 1}),
    ("all_to_all", lambda k, r: (2, 3, 2 * k), {"split_axis": 2, "concat_axis": 1}),
    ("all_to_all", lambda k, r: (3, 2 * k, 2), {"split_axis": 1, "concat_axis": 2}),
    ("sendrecv", lambda k, r: (2, 3), {}),
]


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
@pytest.mark.parametrize("case", range(len(PREPARED)))
def test_prepared_matches_general_call(g, dtype, case, gather_path):
    """group.prepare(name, shape, dtype, **kw)(x) equals the numpy oracle of the general call,
    with and without out=, and inputs of another shape/dtype take the general path."""
    name, shape_of, kw = PREPARED[case]
    k, me = g.size, g.rank
    xs = [data(r, shape_of(k, r), dtype) for r in range(k)]
    if name == "all_gather":
        kw = dict(kw, sizes=[x.shape[kw["axis"]] for x in xs])
        expect = np.concatenate(xs, kw["axis"])
    elif name == "all_reduce":
        expect = {"sum": sum, "max": lambda v: np.max(v, axis=0)}[kw["op"]](np.stack(xs))
    elif name == "reduce_scatter":
        red = np.sum(np.stack(xs), 0) if kw["op"] == "sum" else np.min(np.stack(xs), 0)
        expect = np.array_split(red, k, axis=kw["axis"])[me]
    elif name == "sendrecv":  # a ring shift
        kw = {"dst": (me + 1) % k, "src": (me - 1) % k}
        expect = xs[(me - 1) % k]
    else:
        s, c = kw["split_axis"], kw["concat_axis"]
        kw = dict(kw, recv_sizes=[np.array_split(x, k, axis=s)[me].shape[c] for x in xs])
        expect = np.concatenate([np.array_split(x, k, axis=s)[me] for x in xs], c)
    fn = g.prepare(name, xs[me].shape, dtype, **kw)
    before = collectives.collective_counts()[name]
    np.testing.assert_array_equal(fn(xs[me]), expect)
    out = np.full(expect.shape, 7, dtype)
    assert fn(xs[me], out=out) is out
    np.testing.assert_array_equal(out, expect)
    np.testing.assert_array_equal(fn(xs[me].astype(np.float32)), expect.astype(np.float32))
    assert collectives.collective_counts()[name] - before == 3


def test_all_to_all_packs_into_the_kept_buffer(g, monkeypatch):
    """Past SCRATCH_MIN_BYTES the pieces are packed into one buffer kept for the process:
    results equal the oracle, grow it, and never alias it."""
    if not collectives.is_mpi():
        pytest.skip("MPI backend only")
    from collectives import _alltoall

    monkeypatch.setattr(_alltoall, "SCRATCH_MIN_BYTES", 0)
    k, me = g.size, g.rank
    results = []
    for rows, cols in ((3, 2 * k), (5, 4 * k + 1)):
        xs = [data(r, (rows, cols), np.float64) for r in range(k)]
        expect = np.concatenate([np.array_split(x, k, axis=1)[me] for x in xs], 0)
        got = g.all_to_all(xs[me], 1, 0)
        np.testing.assert_array_equal(got, expect)
        results.append((got, expect.copy()))
    for got, expect in results:  # the second call did not write into the first result
        np.testing.assert_array_equal(got, expect)
    assert _alltoall._scratch[0].nbytes >= 5 * (4 * k + 1) * 8


@pytest.fixture
def shared(g, monkeypatch):
    """all_to_all with concat_axis 0 written into shared results (``_shared``) at any size;
    the calls that took that path are recorded."""
    if not collectives.is_mpi():
        pytest.skip("MPI backend only")
    from collectives import _alltoall

    monkeypatch.setattr(_alltoall, "SHARED_MIN_BYTES", 0)
    monkeypatch.setattr(_alltoall, "SHARED_MIN_RUN", 0)
    taken = []
    written = type(g)._all_to_all_written

    def spy(self, *a):
        taken.append(a[0].shape)
        return written(self, *a)
    monkeypatch.setattr(type(g), "_all_to_all_written", spy)
    return taken


def _s0_to_s1(k, me, rows_of, shape, s, salt=0):
    """(every rank's input, this rank's expected S(0) -> S(1) piece)."""
    xs = [data(r, (rows_of(r),) + shape[1:], np.float64, salt=s + salt) for r in range(k)]
    return xs, np.concatenate([np.array_split(x, k, axis=s)[me] for x in xs], 0)


@pytest.mark.parametrize("rows_of,shape,s", [
    (lambda r: 3 + r, (0, 4 * 4 + 1), 1),  # uneven rows and columns
    (lambda r: r % 2, (0, 7, 2), 2),       # empty pieces, 3-d split along the last axis
    (lambda r: 2, (0, 5, 3), 1),
    (lambda r: 4, (0, 2), 1),              # fewer columns than ranks on 4 ranks
])
@pytest.mark.parametrize("kernel", ["streaming", "numpy"])
def test_all_to_all_written_across(g, shared, monkeypatch, rows_of, shape, s, kernel):
    """S(0) -> S(1)'s all_to_all (concat_axis 0, split_axis > 0) written straight into the
    receivers' results equals the oracle, with a fresh result, into ``out`` and prepared, by
    the streaming copy and by numpy's."""
    from collectives import _shared

    if kernel == "numpy":
        monkeypatch.setattr(_shared, "_kernel", [_shared._numpy_rows])
    k, me = g.size, g.rank
    xs, expect = _s0_to_s1(k, me, rows_of, shape, s)
    recv = [x.shape[0] for x in xs]
    np.testing.assert_array_equal(g.all_to_all(xs[me], s, 0), expect)
    out = np.full(expect.shape, 7.0)
    assert g.all_to_all(xs[me], s, 0, recv_sizes=recv, out=out) is out
    np.testing.assert_array_equal(out, expect)
    fn = g.prepare("all_to_all", xs[me].shape, np.float64, split_axis=s, concat_axis=0,
                   recv_sizes=recv)
    np.testing.assert_array_equal(fn(xs[me]), expect)
    np.testing.assert_array_equal(xs[me], data(me, xs[me].shape, np.float64, salt=s))
    assert len(shared) == (3 if k > 1 and g._shared else 0)


def test_shared_results_are_pooled(g, shared):
    """A result's segment is reused once the result and its views are gone, never while one
    lives; results held across later calls keep their values."""
    k, me = g.size, g.rank
    xs, expect = _s0_to_s1(k, me, lambda r: 2 + r, (0, 3 * k), 1)
    first = g.all_to_all(xs[me], 1, 0)
    if not g._shared:
        pytest.skip("shared results need 2 or more ranks on one node")

    def where(a):
        return a.__array_interface__["data"][0]
    held = [g.all_to_all(xs[me] * (i + 2), 1, 0) for i in range(3)]
    assert where(first) not in {where(h) for h in held}
    view, addr = first[1:], where(first)
    del first
    again = g.all_to_all(xs[me], 1, 0)
    assert where(again) != addr and where(again) not in {where(h) for h in held}
    np.testing.assert_array_equal(view, expect[1:])
    for i, h in enumerate(held):
        np.testing.assert_array_equal(h, expect * (i + 2))
    del view
    assert where(g.all_to_all(xs[me], 1, 0)) == addr


def test_shared_results_past_the_pool_limit(g, shared, monkeypatch):
    """With no room in the pool every segment is closed when its result dies and peers map
    each new one (a reused descriptor is told apart by its serial number): values still
    equal the oracle, over shapes that change call to call."""
    from collectives import _shared

    monkeypatch.setattr(_shared, "POOL_BYTES", 0)
    k, me = g.size, g.rank
    for i in range(6):
        xs, expect = _s0_to_s1(k, me, lambda r: 1 + (r + i) % 3, (0, 2 * k + i, 2), 1 + i % 2,
                               salt=i)
        np.testing.assert_array_equal(g.all_to_all(xs[me], 1 + i % 2, 0), expect)
    if g._shared:
        assert not g._shared._free and g._shared._owned == 0
        assert len(g._shared._mapped) <= 1


def test_all_to_all_without_shared_results(g, shared, monkeypatch):
    """Where the probe fails (no memfd_create here) every rank agrees to pack instead."""
    import os

    monkeypatch.delattr(os, "memfd_create")
    monkeypatch.setattr(g, "_shared", None)
    k, me = g.size, g.rank
    xs = [data(r, (3, 2 * k), np.float32) for r in range(k)]
    expect = np.concatenate([np.array_split(x, k, axis=1)[me] for x in xs], 0)
    np.testing.assert_array_equal(g.all_to_all(xs[me], 1, 0), expect)
    assert shared == [] and g._shared is (False if k > 1 else None)


def test_prepare_checks_arguments_once(g):
    with pytest.raises(ValueError, match="prepare: collective 'broadcast' is not one of"):
        g.prepare("broadcast", (2,), np.float64)
    with pytest.raises(ValueError,
                       match=r"all_gather: argument 'axis'=2 is out of range .*\(4, 3\)"):
        g.prepare("all_gather", (4, 3), np.float64, axis=2)
    with pytest.raises(TypeError,
                       match="all_reduce: reduce op 'avg' is not supported for dtype int64"):
        g.prepare("all_reduce", (4,), np.int64, op="avg")
    fn = g.prepare("all_reduce", (4,), np.float64)
    with pytest.raises(ValueError, match="all_reduce: argument 'out' has shape=\\(3,\\)"):
        fn(np.ones(4), out=np.empty(3))
