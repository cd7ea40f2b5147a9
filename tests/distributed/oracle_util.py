"""Helpers for the op-by-placement oracle (tests/dist/test_ops_oracle.py).

* :func:`op_cases` — for EVERY registered op, a deterministic list of ``(arrays, attrs)`` samples:
  the finite-difference samples of tests/core (``core_samples.SAMPLES``), uneven extras below,
  hand-written samples for the forward-only ops, and for the grad ops (``*_grad``,
  ``minmax_mask``) the exact calls that the dense backward of the forward samples makes
  (captured by wrapping their kernels once, densely).
* :func:`placement_combos` — the input placements to try on a mesh: Shard(d) for each tensor dim
  or Replicate per mesh dim, all combinations up to a cap, beyond it a seeded sample that always
  keeps the all-replicated, every single-shard, co-sharded (both split orders) and aligned cases;
  plus Partial cases of every reduce type (:func:`partial_combos`).
* :func:`run_case` — one op on dense tensors or on distributed ones (built with ``shard_tensor``
  or, for Partial inputs, ``dtensor_from_local`` from per-rank pieces), the forward values, the
  input gradients after backward of ``sum_i (out_i * W_i).sum()``, and mutated inputs.

Everything is a pure function of fixed seeds, so every rank walks the identical case list.
"""
from __future__ import annotations

import itertools
import os
import sys
import zlib

import numpy as np

import disttensor as dt
from disttensor import Partial, ReduceType, Replicate, Shard
from disttensor.dispatch import apply
from disttensor.layout.mesh_groups import coord_of
from disttensor.ops import OPS
from disttensor.ops.shape import normalize_index
from spmd_rules import DistAttr, local_slices

_CORE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")
if _CORE not in sys.path:
    sys.path.insert(0, _CORE)
from core_samples import FORWARD_ONLY as FAMILY_FORWARD_ONLY  # noqa: E402
from core_samples import SAMPLES

# Placement combos per (sample, mesh) before sampling kicks in; ORACLE_CAP=0 means all.
CAP = int(os.environ.get("ORACLE_CAP", "16"))


def _n(rng, *shape):
    return rng.standard_normal(shape)


def _pos(rng, *shape):
    return rng.uniform(0.5, 2.0, shape)


def _distinct(rng, *shape):
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.37 - n * 0.15).reshape(shape)


def _ints(rng, hi, *shape):
    return rng.integers(0, hi, shape).astype(np.int64)


# -- uneven extras (dims 5, 7, 3 that do not divide by 2/3/4; dims 1, 2 smaller than a mesh) --

def _b(*shapes, gens=None, **attrs):
    gens = gens or [_n] * len(shapes)
    return lambda rng: ([g(rng, *s) for g, s in zip(gens, shapes)], dict(attrs))


def _bn(shape, fmt, training):
    def build(rng):
        c = shape[1] if fmt in ("NC", "NCL", "NCHW") else shape[-1]
        return ([_n(rng, *shape), rng.normal(size=c) * 0.1, rng.uniform(0.5, 1.5, c),
                 _n(rng, c), _n(rng, c)],
                {"training": training, "momentum": 0.9, "epsilon": 1e-5, "data_format": fmt})
    return build


def _ce(shape, axis):
    def build(rng):
        c = shape[axis]
        lab = rng.integers(0, c, shape[:axis] + (1,) + shape[axis + 1:])
        lab.reshape(-1)[-1] = -100
        return [_n(rng, *shape), lab.astype(np.int64)], {"axis": axis, "ignore_index": -100}
    return build


EXTRA: dict[str, list] = {
    "add": [_b((5, 7), (7,)), _b((1, 3), (5, 1))],
    "subtract": [_b((7, 3), (7, 3))],
    "multiply": [_b((5, 1, 3), (7, 3))],
    "divide": [_b((5, 7), (5, 1), gens=[_n, _pos])],
    "exp": [_b((7, 5))],
    "relu": [_b((5, 7), gens=[lambda rng, *s: _distinct(rng, *s) + 0.1])],
    "scale": [lambda rng: ([_n(rng, 7, 2)], {"scale": 2.0, "bias": 0.0,
                                             "bias_after_scale": True})],
    "matmul": [_b((5, 7), (7, 3), transpose_x=False, transpose_y=False),
               _b((2, 5, 7), (7, 3), transpose_x=False, transpose_y=False),
               _b((7, 5), (3, 7), transpose_x=True, transpose_y=True)],
    "sum": [lambda rng: ([_n(rng, 5, 7, 3)], {"axis": (1,), "keepdim": False}),
            lambda rng: ([_n(rng, 7, 5)], {"axis": (0, 1), "keepdim": True})],
    "max": [lambda rng: ([_distinct(rng, 5, 7)], {"axis": (1,), "keepdim": False})],
    "reshape": [lambda rng: ([_n(rng, 5, 6)], {"shape": (3, 10)}),
                lambda rng: ([_n(rng, 2, 3, 5)], {"shape": (6, 5)}),
                lambda rng: ([_n(rng, 6, 5)], {"shape": (2, 3, 5)}),
                lambda rng: ([_n(rng, 7, 2)], {"shape": (14,)})],
    "transpose": [lambda rng: ([_n(rng, 5, 7, 3)], {"perm": (1, 2, 0)})],
    "softmax": [lambda rng: ([_n(rng, 5, 7)], {"axis": 1})],
    "log_softmax": [lambda rng: ([_n(rng, 7, 5)], {"axis": 0})],
    "layer_norm": [lambda rng: ([_n(rng, 5, 7), _n(rng, 7), _n(rng, 7)],
                                {"begin_norm_axis": 1, "epsilon": 1e-5})],
    "batch_norm": [_bn((7, 3), "NC", True), _bn((5, 3, 2), "NCL", True)],
    "batch_norm_infer": [_bn((5, 3), "NC", False)],
    "embedding": [lambda rng: ([_ints(rng, 7, 5), _n(rng, 7, 3)], {"padding_idx": None}),
                  lambda rng: ([_ints(rng, 5, 2, 3), _n(rng, 5, 2)], {"padding_idx": 1})],
    "cross_entropy": [_ce((5, 7), 1), _ce((7, 3), 1)],
    "cross_entropy_mean": [_ce((5, 7), 1), _ce((7, 3), 1)],
    "dropout": [lambda rng: ([_n(rng, 5, 7, 3)], {"p": 0.4, "mode": "upscale_in_train",
                                                  "seed": 77, "axis": None})],
    "slice": [lambda rng: ([_n(rng, 7, 5)], {"index": normalize_index(
        "slice", (slice(1, 6, 2), slice(None)), (7, 5))}),
              lambda rng: ([_n(rng, 5, 3)], {"index": normalize_index("slice", 3, (5, 3))})],
    "split": [lambda rng: ([_n(rng, 7, 3)], {"sections": (3, 4), "axis": 0})],
    "concat": [lambda rng: ([_n(rng, 5, 3), _n(rng, 2, 3)], {"axis": 0})],
    "gather": [lambda rng: ([_n(rng, 7, 3), np.array([6, 0, 2, 2, 5], dtype=np.int64)],
                            {"axis": 0})],
    "tile": [lambda rng: ([_n(rng, 5, 1)], {"repeat_times": (1, 3)})],
    "expand": [lambda rng: ([_n(rng, 1, 5)], {"shape": (3, 5)})],
    "where": [lambda rng: ([rng.random((5, 7)) < 0.5, _n(rng, 5, 7), _n(rng, 7)], {})],
    "cast": [lambda rng: ([_n(rng, 5, 3)], {"dtype": np.dtype(np.float32),
                                            "src_dtype": np.dtype(np.float64)})],
}

# -- forward-only ops -------------------------------------------------------------------------


def _cmp(rng):
    x = rng.integers(0, 3, (5, 7)).astype(np.float64)
    return [x, rng.integers(0, 3, (7,)).astype(np.float64)], {}


def _logic(rng):
    return [rng.random((5, 3)) < 0.5, rng.random((5, 3)) < 0.5], {}


FORWARD_ONLY: dict[str, list] = {
    **{name: [_cmp] for name in ("equal", "not_equal", "less_than", "less_equal", "greater_than",
                                 "greater_equal")},
    "logical_and": [_logic],
    "logical_or": [_logic],
    "logical_not": [lambda rng: ([rng.random((7, 2)) < 0.5], {})],
    "argmax": [lambda rng: ([_distinct(rng, 5, 7)], {"axis": (1,), "keepdim": False}),
               lambda rng: ([_distinct(rng, 7, 3)], {"axis": (0,), "keepdim": True})],
    "argmin": [lambda rng: ([_distinct(rng, 5, 7)], {"axis": (0,), "keepdim": False})],
    "full_like": [lambda rng: ([_n(rng, 5, 3)], {"fill_value": 2.5,
                                                 "dtype": np.dtype(np.float64)})],
    "one_hot": [lambda rng: ([_ints(rng, 7, 5)], {"num_classes": 7}),
                lambda rng: ([_ints(rng, 3, 2, 3)], {"num_classes": 3})],
    "detach": [lambda rng: ([_n(rng, 5, 7)], {})],
    "minmax_mask": [lambda rng: ([_distinct(rng, 5, 7), _n(rng, 7)], {"pick": "maximum"})],
    # fused optimizer steps: parameter and moments are mutated (compared like running stats)
    # (parameter, grad, moment1, moment2, beta1**t, beta2**t, lr)
    "adam_update": [lambda rng: ([_n(rng, 5, 3), _n(rng, 5, 3), _n(rng, 5, 3), rng.random((5, 3)),
                                  np.array([0.9]), np.array([0.999]), np.array(0.1)],
                                 {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "l2": 0.01,
                                  "weight_decay": 0.05, "lr_scale": 2.0})],
    "momentum_update": [lambda rng: ([_n(rng, 5, 3), _n(rng, 5, 3), _n(rng, 5, 3), np.array(0.1)],
                                     {"mu": 0.9, "use_nesterov": True, "l2": 0.01,
                                      "lr_scale": 1.0})],
    "sgd_update": [lambda rng: ([_n(rng, 7, 3), _n(rng, 7, 3), np.array(0.1)],
                                {"l2": 0.0, "lr_scale": 1.0})],
}

# Ops whose argument handling needs the attrs the public function adds (FORWARD samples
# from core_samples for argmax & co. come without reduce_type: the rule_attrs give it).

_MAX_CAPTURED = 3


def _capture_grad_samples(builders: dict[str, list]) -> dict[str, list]:
    """Run every forward sample's dense backward once, recording the kernel calls of the ops
    that have no sample of their own (the grad ops): ``name -> [(arrays, attrs)]``."""
    wanted = [n for n, op in OPS.items() if not op.differentiable and n not in builders]
    got: dict[str, list] = {n: [] for n in wanted}
    seen: set = set()
    saved = {}

    def wrap(name, kernel):
        def k(xp, *arrays, **kw):
            attrs = {a: v for a, v in kw.items() if a != "ctx"}
            key = (name, tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays),
                   repr(sorted(attrs.items())))
            if key not in seen and len(got[name]) < _MAX_CAPTURED:
                seen.add(key)
                got[name].append(([None if a is None else np.array(a) for a in arrays],
                                  dict(attrs)))
            return kernel(xp, *arrays, **kw)
        return k

    for n in wanted:  # cached dense plans hold the kernel: set them aside while capturing
        op = OPS[n]
        saved[n] = (op.kernel, op.plan0, op.plans)
        op.kernel, op.plan0, op.plans = wrap(n, op.kernel), None, {}
    try:
        for name in sorted(builders):
            op = OPS[name]
            if not op.differentiable:
                continue
            for k, build in enumerate(builders[name]):
                arrays, attrs = build(_rng(name, k))
                run_case(op, arrays, attrs, None, None, _rng(name, k, "w"))
    finally:
        for n, (kern, plan0, plans) in saved.items():
            OPS[n].kernel, OPS[n].plan0, OPS[n].plans = kern, plan0, plans
    return got


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


_CASES: dict | None = None


def op_cases() -> dict[str, list[tuple[list, dict]]]:
    """``name -> [(arrays, attrs), ...]`` for every registered op (built once, deterministic)."""
    global _CASES
    if _CASES is None:
        builders: dict[str, list] = {}
        for src in (SAMPLES, EXTRA, FORWARD_ONLY, FAMILY_FORWARD_ONLY):
            for name, bs in src.items():
                if name in OPS:
                    builders.setdefault(name, []).extend(bs)
        cases = {name: [b(_rng(name, k)) for k, b in enumerate(bs)]
                 for name, bs in builders.items()}
        for name, samples in _capture_grad_samples(builders).items():
            cases.setdefault(name, []).extend(samples)
        _CASES = cases
    return _CASES


# -- placements -------------------------------------------------------------------------------

def _tensor_options(ndim: int, mesh_ndim: int) -> list[tuple]:
    """Every Shard(d)/Replicate per mesh dim; on a 2-d mesh also each dim co-sharded in the
    reversed split order (mesh dim 1 outermost)."""
    per_dim = [Shard(d) for d in range(ndim)] + [Replicate()]
    return list(itertools.product(per_dim, repeat=mesh_ndim)) + _reversed_co_shards(ndim, mesh_ndim)


def _reversed_co_shards(ndim: int, mesh_ndim: int) -> list[tuple]:
    """Each dim co-sharded by every mesh dim, the last mesh dim splitting first."""
    if mesh_ndim < 2:
        return []
    return [tuple(Shard(d, shard_order=mesh_ndim - 1 - m) for m in range(mesh_ndim))
            for d in range(ndim)]


def placement_combos(arrays: list, mesh_ndim: int, cap: int = CAP, seed: int = 0) -> list[tuple]:
    """Input placement combos (one tuple of placements per input, None for an absent input):
    all if at most ``cap`` (0 = no cap), else the required ones plus a seeded sample."""
    present = [i for i, a in enumerate(arrays) if a is not None]
    opts = {i: _tensor_options(np.ndim(arrays[i]), mesh_ndim) for i in present}
    rep = tuple(Replicate() for _ in range(mesh_ndim))

    def combo(assign: dict) -> tuple:
        return tuple(None if arrays[i] is None else assign.get(i, rep) for i in range(len(arrays)))

    total = int(np.prod([len(opts[i]) for i in present])) if present else 1
    if cap == 0 or total <= cap:
        return [combo(dict(zip(present, c)))
                for c in itertools.product(*(opts[i] for i in present))]
    out: list = [combo({})]
    for i in present:  # every single shard
        for m in range(mesh_ndim):
            for d in range(np.ndim(arrays[i])):
                out.append(combo({i: tuple(Shard(d) if k == m else Replicate()
                                           for k in range(mesh_ndim))}))
        if mesh_ndim > 1:  # co-sharded: every mesh dim splits the same tensor dim, both orders
            for d in range(np.ndim(arrays[i])):
                out.append(combo({i: tuple(Shard(d) for _ in range(mesh_ndim))}))
            for pl in _reversed_co_shards(np.ndim(arrays[i]), mesh_ndim):
                out.append(combo({i: pl}))
    # aligned from the right (broadcasting) and from the left: every input split the same way
    for side in ("right", "left"):
        for k in range(max(np.ndim(arrays[i]) for i in present)):
            assign = {}
            for i in present:
                nd = np.ndim(arrays[i])
                if k < nd:
                    d = nd - 1 - k if side == "right" else k
                    other = [Shard(e) for e in range(nd) if e != d]
                    assign[i] = tuple([Shard(d)] + [other[0] if other else Replicate()]
                                      * (mesh_ndim - 1))
            out.append(combo(assign))
    uniq, seen = [], set()
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    rng = np.random.default_rng(seed)
    for _ in range(20 * cap):
        if len(uniq) >= cap:
            break
        c = combo({i: opts[i][rng.integers(len(opts[i]))] for i in present})
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def _with_partial(arrays: list, mesh_ndim: int, inputs, partial: Partial, m: int = 0) -> tuple:
    """One combo: ``inputs`` Partial on mesh dim ``m`` (the others Replicate, or Shard(0) on
    the other mesh dim of a 2-d mesh); every other input Replicate."""
    rep = [Replicate()] * mesh_ndim
    out = []
    for k, a in enumerate(arrays):
        if a is None:
            out.append(None)
        elif k in inputs:
            pl = list(rep)
            pl[m] = partial
            if mesh_ndim > 1 and np.ndim(a) > 0:
                pl[1 - m] = Shard(0)
            out.append(tuple(pl))
        else:
            out.append(tuple(rep))
    return tuple(out)


# Partial types beyond sum/avg fed to every op: the rule must keep each exactly (maximum with
# Partial(max), concat/gather/views of any) or resolve it with its own reduction.
ORDER_TYPES = (ReduceType.MAX, ReduceType.MIN, ReduceType.PROD)
LOGICAL_TYPES = (ReduceType.ANY, ReduceType.ALL)


def partial_combos(op, arrays: list, mesh_ndim: int, linear: bool) -> list[tuple]:
    """Partial inputs: each floating input Partial(sum) on each mesh dim, and the first one
    Partial(max), (min) and (prod); every floating input Partial(max) at once and Partial(min)
    at once; the first bool input Partial(any) and (all), and every bool input at once; for
    linear ops also every floating input Partial(sum) at once and a Partial(avg) input."""
    kinds = {i: np.asarray(a).dtype.kind for i, a in enumerate(arrays) if a is not None}
    floats = [i for i, k in kinds.items() if k == "f"]
    bools = [i for i, k in kinds.items() if k == "b"]
    out = [_with_partial(arrays, mesh_ndim, {i}, Partial(), m)
           for i in floats for m in range(mesh_ndim)]
    if floats:
        out += [_with_partial(arrays, mesh_ndim, {floats[0]}, Partial(t)) for t in ORDER_TYPES]
    if len(floats) > 1:
        out += [_with_partial(arrays, mesh_ndim, set(floats), Partial(t)) for t in ORDER_TYPES[:2]]
    if bools:
        out += [_with_partial(arrays, mesh_ndim, {bools[0]}, Partial(t)) for t in LOGICAL_TYPES]
    if len(bools) > 1:
        out += [_with_partial(arrays, mesh_ndim, set(bools), Partial(t)) for t in LOGICAL_TYPES]
    if linear and floats:
        allp = tuple([Partial()] + [Replicate()] * (mesh_ndim - 1))
        rep = tuple([Replicate()] * mesh_ndim)
        if len(floats) > 1:
            out.append(tuple(allp if k in floats else (None if a is None else rep)
                             for k, a in enumerate(arrays)))
        avg = tuple([Partial(ReduceType.AVG)] + [Replicate()] * (mesh_ndim - 1))
        out.append(tuple(avg if k == floats[0] else (None if a is None else rep)
                         for k, a in enumerate(arrays)))
    return out


def fmt_placements(combo) -> str:
    def one(p):
        if isinstance(p, Shard):
            return f"S({p.dim})"
        if isinstance(p, Replicate):
            return "R"
        rt = getattr(p, "reduce_type", "sum")
        return "P" if rt == ReduceType.SUM else f"P({getattr(rt, 'value', rt)})"
    return "[" + ", ".join("-" if c is None else "[" + ",".join(one(p) for p in c) + "]"
                           for c in combo) + "]"


# -- running one case -------------------------------------------------------------------------

def partial_pieces(a: np.ndarray, n: int, reduce_type, rng) -> list[np.ndarray]:
    """``n`` pieces whose reduction of type ``reduce_type`` is exactly ``a``: sum and avg from
    dyadic addends (integer-valued inputs sum back exactly), max/min from values below/above
    ``a`` with ``a`` itself at a random piece per element, prod from factors +-1/2, +-1, +-2 and
    a last factor (exact: powers of two), any/all from random bools with ``a`` at one piece."""
    rt = ReduceType(reduce_type)
    if n == 1:
        return [a.copy()]
    if rt in (ReduceType.SUM, ReduceType.AVG):
        addends = [rng.integers(-4, 5, a.shape) * 0.5 for _ in range(n - 1)]
        total = a * n if rt is ReduceType.AVG else a
        return addends + [total - sum(addends)]
    if rt is ReduceType.PROD:
        factors = [rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], a.shape) for _ in range(n - 1)]
        return factors + [a / np.prod(factors, axis=0)]
    winner = rng.integers(0, n, a.shape)
    if rt in (ReduceType.MAX, ReduceType.MIN):
        sign = -1 if rt is ReduceType.MAX else 1
        return [np.where(winner == k, a, a + sign * rng.integers(1, 5, a.shape) * 0.5)
                for k in range(n)]
    noise = [rng.random(a.shape) < 0.5 for _ in range(n)]
    if rt is ReduceType.ANY:
        return [np.where(winner == k, a, a & noise[k]) for k in range(n)]
    return [np.where(winner == k, a, a | noise[k]) for k in range(n)]


def _partial_tensor(a: np.ndarray, mesh, placements, key) -> dt.Tensor:
    """A distributed tensor with Partial placements (one reduce type) whose per-rank pieces
    reduce to ``a``."""
    mesh_shape = tuple(mesh.shape)
    pdims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    (rt,) = {ReduceType(placements[m].reduce_type) for m in pdims}
    n = int(np.prod([mesh_shape[m] for m in pdims]))
    pieces = partial_pieces(a, n, rt, _rng("partial", key))
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    attr = DistAttr.from_placements(plain, a.ndim, mesh_shape)
    coord = coord_of(mesh)
    if coord is None:
        local = np.zeros((0,) * a.ndim, dtype=a.dtype)
    else:
        k = int(np.ravel_multi_index([coord[m] for m in pdims], [mesh_shape[m] for m in pdims])) \
            if pdims else 0
        local = np.array(pieces[k][local_slices(a.shape, attr, coord)], dtype=a.dtype)
    return dt.dtensor_from_local(local, mesh, list(placements), shape=a.shape)


def grad_indices(op, arrays) -> list[int]:
    if not op.differentiable:
        return []
    idx = op.grad_inputs if op.grad_inputs is not None else range(len(arrays))
    return [i for i in idx if arrays[i] is not None and np.asarray(arrays[i]).dtype.kind == "f"]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def make_inputs(op, arrays, mesh, combo, gin=()) -> list:
    """The op's input tensors: dense (``mesh`` None) or laid out as ``combo`` on ``mesh``;
    inputs listed in ``gin`` need grad."""
    tensors = []
    for i, a in enumerate(arrays):
        if a is None:
            tensors.append(None)
            continue
        a = np.array(a)  # a fresh copy: kernels may write into their inputs
        sg = i not in gin
        if mesh is None:
            t = dt.to_tensor(a, stop_gradient=sg)
        elif any(isinstance(p, Partial) for p in combo[i]):
            t = _partial_tensor(a, mesh, combo[i], (op.name, i, fmt_placements(combo)))
            t.stop_gradient = sg
        else:
            t = dt.shard_tensor(a, mesh, list(combo[i]), stop_gradient=sg)
        tensors.append(t)
    return tensors


def run_case(op, arrays, attrs, mesh, combo, wrng, weights=None):
    """Run ``op`` densely (``mesh`` None) or distributed with input placements ``combo``.

    Returns ``(tensors, outs, weights)``; backward of ``sum (out_i * W_i).sum()`` over the
    floating, differentiable outputs has run when the op is differentiable. ``weights`` (from
    the dense run) are reused so both runs differentiate the same scalar."""
    gin = grad_indices(op, arrays)
    tensors = make_inputs(op, arrays, mesh, combo, gin)
    if gin:
        outs = _as_tuple(apply(op, tuple(tensors), attrs))
    else:
        with dt.no_grad():
            outs = _as_tuple(apply(op, tuple(tensors), attrs))
    if gin:
        slots = [k for k, o in enumerate(outs)
                 if k not in op.nondiff_outputs and np.dtype(o.dtype).kind == "f"]
        if weights is None:
            weights = {k: wrng.standard_normal(tuple(outs[k].shape)).astype(outs[k].dtype)
                       for k in slots}
        loss = None
        for k in slots:
            term = dt.sum(dt.multiply(outs[k], dt.to_tensor(weights[k])))
            loss = term if loss is None else dt.add(loss, term)
        if loss is not None:
            loss.backward()
    return tensors, outs, weights
