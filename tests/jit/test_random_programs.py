"""Seeded random programs on a mesh: chains of ops on uneven shapes with random layouts
(Partial included), run eagerly and captured (``to_static``, default memory plan and with
recompute), against numpy: the loss and the gradients of every parameter, over replays.

Each op of the chain comes with its numpy forward and vector-Jacobian product, written here
with numpy alone. Programs like these found a view of a reshard's temporary losing its block,
an inplace store landing in a temporary, a rank swapping with itself returning its input and
ranks issuing different collectives (see the regression tests in test_capture_dist.py and
test_remat.py)."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt

pytestmark = pytest.mark.mpi

WORLD = dt.get_world_size()
S, R, P = dt.Shard, dt.Replicate, dt.Partial
SEEDS = {"eager": 30, "captured": 10, "recompute": 10}  # programs per mode


def _mesh():
    return dt.ProcessMesh([[0, 1], [2, 3]]) if WORLD == 4 else \
        dt.ProcessMesh(list(range(WORLD)))


def _layout(rng, ndim: int, mesh, partial: bool = True) -> list:
    out = []
    for _ in range(mesh.ndim):
        r = rng.random()
        if r < 0.35 or ndim == 0:
            out.append(R())
        elif r < 0.9 or not partial:
            out.append(S(int(rng.integers(ndim))))
        else:
            out.append(P())
    return out


class Op:
    """One link: ``dt(x, params)``, numpy ``np(a, params) -> y`` and
    ``vjp(a, y, g, params) -> (ga, [g per param])``; ``params``: (array, layout) pairs."""

    def __init__(self, name, dt_fn, np_fn, vjp, params=()):
        self.name, self.dt, self.np, self.vjp, self.params = name, dt_fn, np_fn, vjp, params


def _draw(rng, shape: tuple, mesh) -> Op | None:
    nd = len(shape)
    k = int(rng.integers(13))
    if k == 0 and nd:
        ax = int(rng.integers(nd))
        return Op(f"sum{ax}", lambda x, p: dt.sum(x, axis=ax), lambda a, p: a.sum(ax),
                  lambda a, y, g, p: (np.broadcast_to(np.expand_dims(g, ax), a.shape), []))
    if k == 1 and nd >= 2:
        perm = [int(v) for v in rng.permutation(nd)]
        inv = list(np.argsort(perm))
        return Op(f"transpose{perm}", lambda x, p: dt.transpose(x, perm),
                  lambda a, p: a.transpose(perm), lambda a, y, g, p: (g.transpose(inv), []))
    if k == 2 and nd:
        ax = int(rng.integers(nd))

        def softmax(a, p):
            e = np.exp(a - a.max(ax, keepdims=True))
            return e / e.sum(ax, keepdims=True)
        return Op(f"softmax{ax}", lambda x, p: dt.softmax(x, axis=ax), softmax,
                  lambda a, y, g, p: (y * (g - (g * y).sum(ax, keepdims=True)), []))
    if k == 3:
        return Op("tanh", lambda x, p: dt.tanh(x), lambda a, p: np.tanh(a),
                  lambda a, y, g, p: (g * (1 - y * y), []))
    if k == 4 and nd:
        B = rng.standard_normal((shape[-1], int(rng.integers(1, 5))))
        return Op("matmul", lambda x, p: dt.matmul(x, p[0]), lambda a, p: a @ p[0],
                  lambda a, y, g, p: (g @ p[0].T, [a.reshape(-1, a.shape[-1]).T
                                                   @ g.reshape(-1, g.shape[-1])]),
                  [(B, _layout(rng, 2, mesh, partial=False))])
    if k == 5:
        B = rng.standard_normal(shape[int(rng.integers(nd + 1)):])
        return Op(f"mul{B.shape}", lambda x, p: x * p[0], lambda a, p: a * p[0],
                  lambda a, y, g, p: (g * p[0], [(g * a).reshape(-1, *p[0].shape).sum(0)]),
                  [(B, _layout(rng, B.ndim, mesh))])
    if k == 6 and nd:
        n = int(np.prod(shape))
        return Op("flatten", lambda x, p: dt.reshape(x, [n]), lambda a, p: a.reshape(n),
                  lambda a, y, g, p: (g.reshape(a.shape), []))
    if k == 7:
        lay = _layout(rng, nd, mesh)
        return Op(f"reshard{lay}", lambda x, p: dt.reshard(x, mesh, lay), lambda a, p: a,
                  lambda a, y, g, p: (g, []))
    if k == 8 and nd and shape[0] >= 2:
        lo = int(rng.integers(shape[0] - 1))

        def vjp(a, y, g, p):
            ga = np.zeros_like(a)
            ga[lo:] = g
            return ga, []
        return Op(f"[{lo}:]", lambda x, p: x[lo:], lambda a, p: a[lo:], vjp)
    if k == 9 and nd:
        def ln(a, p):
            return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)

        def vjp(a, y, g, p):
            sd = np.sqrt(a.var(-1, keepdims=True) + 1e-5)
            return (g - g.mean(-1, keepdims=True) - y * (g * y).mean(-1, keepdims=True)) / sd, []
        return Op("layer_norm", lambda x, p: dt.layer_norm(x, x.shape[-1:]), ln, vjp)
    if k == 10:
        B = rng.standard_normal(shape)

        def inplace(x, p):
            h = x * 1.0
            h.multiply_(p[0])
            return dt.relu(h)

        def vjp(a, y, g, p):
            hit = a * p[0] > 0
            return g * hit * p[0], [g * hit * a]
        return Op("multiply_ relu", inplace, lambda a, p: np.maximum(a * p[0], 0), vjp,
                  [(B, _layout(rng, nd, mesh))])
    if k == 11 and nd:
        ax = int(rng.integers(nd))

        def vjp(a, y, g, p):
            hit = a == y
            return g * hit / hit.sum(ax, keepdims=True), []
        return Op(f"max{ax}", lambda x, p: dt.max(x, axis=ax, keepdim=True),
                  lambda a, p: a.max(ax, keepdims=True), vjp)
    if k == 12 and nd:
        ax = int(rng.integers(nd))
        n = shape[ax]

        def vjp(a, y, g, p):
            g1, g2 = np.split(g, [n], ax)
            return g1 + 0.5 * g2, []
        return Op(f"concat{ax}", lambda x, p: dt.concat([x, x * 0.5], axis=ax),
                  lambda a, p: np.concatenate([a, a * 0.5], ax), vjp)
    return None


def _program(seed: int, mesh):
    rng = np.random.default_rng(seed)
    shape = tuple(int(rng.integers(1, 8)) for _ in range(int(rng.integers(1, 4))))
    x0 = (rng.standard_normal(shape), _layout(rng, len(shape), mesh))
    ops, cur = [], shape
    for _ in range(int(rng.integers(1, 7))):
        op = _draw(rng, cur, mesh)
        if op is not None:
            ops.append(op)
            cur = op.np(np.zeros(cur) + 0.5, [b for b, _ in op.params]).shape
    xs = _layout(rng, len(shape), mesh, partial=False)
    return x0, ops, xs, rng.standard_normal(cur)


def _numpy_step(x0, ops, X, W):
    """(loss, gradient of x0, gradients of each op's params) in numpy."""
    acts = [x0 * X]
    for op in ops:
        acts.append(op.np(acts[-1], [b for b, _ in op.params]))
    g = W
    grads = []
    for op, a, y in zip(reversed(ops), reversed(acts[:-1]), reversed(acts[1:])):
        g, gp = op.vjp(a, y, np.broadcast_to(g, y.shape), [b for b, _ in op.params])
        grads.append(gp)
    return (acts[-1] * W).sum(), g * X, [p for gp in reversed(grads) for p in gp]


@pytest.mark.parametrize("mode", ["eager", "captured", "recompute"])
def test_random_programs_match_numpy(mode, comm):
    mesh = _mesh()
    failures = []
    for seed in range(SEEDS[mode]):
        (A, lay), ops, xs, W = _program(seed, mesh)
        p0 = dt.shard_tensor(A, mesh, lay, stop_gradient=False)
        params = [dt.shard_tensor(b, mesh, pl, stop_gradient=False)
                  for op in ops for b, pl in op.params]
        per_op = []
        it = iter(params)
        for op in ops:
            per_op.append([next(it) for _ in op.params])
        w = dt.shard_tensor(W, mesh, [R()] * mesh.ndim)

        def step(x):
            h = p0 * x
            for op, ps in zip(ops, per_op):
                h = op.dt(h, ps)
            loss = dt.sum(h * w)
            loss.backward()
            return loss
        f = step if mode == "eager" else dt.jit.to_static(step, recompute=mode == "recompute")
        want = [np.zeros_like(A)] + [np.zeros_like(b) for op in ops for b, _ in op.params]
        label = f"seed {seed}: x {list(A.shape)} {lay} -> " + " -> ".join(o.name for o in ops)
        try:
            for k in range(1 if mode == "eager" else 3):
                X = np.full(A.shape, 1.0 + 0.5 * k)
                loss = f(dt.shard_tensor(X, mesh, xs))
                ref, g0, gps = _numpy_step(A, ops, X, W)
                want = [a + b for a, b in zip(want, [g0] + gps)]
                np.testing.assert_allclose(float(loss.numpy()), ref, rtol=1e-9, atol=1e-10)
                for t, wv in zip([p0] + params, want):
                    np.testing.assert_allclose(t.grad.numpy(), wv, rtol=1e-8, atol=1e-10)
        except AssertionError as e:  # a value that differs is the same on every rank
            failures.append(f"{label} (call {k}): {str(e).splitlines()[0:4]}")
    assert not failures, "\n".join(failures)
