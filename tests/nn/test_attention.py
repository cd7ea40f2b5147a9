"""Fused attention, rms_norm, rotary embedding, swiglu and their layers against numpy-only
references (tests/distributed/references_attention.py), the memory the attention saves for
backward, the layouts their rules choose, and bad input at every world size."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import collectives
import disttensor as dt
from disttensor import Partial, Replicate, Shard
from disttensor.ops import attention as attention_ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distributed"))
from references_attention import attention_probs, dropout_keep, rms, rotate  # noqa: E402

F = dt.nn.functional
IF = dt.incubate.nn.functional


def _attention_ref(q, k, v, mask=None, causal=False, p=0.0, seed=0, dout=None):
    """Forward and (q, k, v) gradients of ``sum(out * dout)`` in float64 numpy."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    probs, _ = attention_probs(q, k, mask, causal, scale)
    g = q.shape[2] // k.shape[2]
    drop = dropout_keep(seed, p, probs.shape) / (1.0 - p) if p else 1.0
    vv = np.repeat(v, g, axis=2)
    out = np.einsum("bhqk,bkhd->bqhd", probs * drop, vv)
    dpd = np.einsum("bqhd,bkhd->bhqk", dout, vv) * drop
    ds = probs * (dpd - (probs * dpd).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, np.repeat(k, g, axis=2))
    fold = lambda t: t.reshape(t.shape[:2] + (t.shape[2] // g, g, t.shape[3])).sum(3)  # noqa
    dk = fold(np.einsum("bhqk,bqhd->bkhd", ds, q))
    dv = fold(np.einsum("bhqk,bqhd->bkhd", probs * drop, dout))
    return out, dq, dk, dv


CASES = {
    "plain": dict(h=4, hk=4),
    "causal": dict(h=4, hk=4, causal=True),
    "bool_mask": dict(h=4, hk=4, mask="bool"),
    "additive_mask": dict(h=4, hk=4, mask="add", causal=True),
    "gqa_4to1": dict(h=4, hk=1, causal=True),
    "gqa_2to1": dict(h=4, hk=2, mask="bool"),
    "dropout": dict(h=4, hk=2, p=0.25, causal=True),
}


def _inputs(rng, b=2, sq=37, sk=50, h=4, hk=4, d=8, mask=None, **_):
    q, k, v = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    m = None
    if mask == "bool":
        m = rng.random((b, 1, sq, sk)) < 0.7
        m[..., 0] = True
    elif mask == "add":
        m = rng.standard_normal((1, h, sq, sk))
    return q, k, v, m


@pytest.mark.parametrize("tile", [1 << 22, 64], ids=["one_block", "key_blocks"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-5)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_numpy(case, dtype, tol, tile, monkeypatch):
    monkeypatch.setattr(attention_ops, "_TILE", tile)  # 64: blocks of 16 keys, a partial last
    spec = CASES[case]
    rng = np.random.default_rng(len(case))
    q, k, v, m = _inputs(rng, **spec)
    dout = rng.standard_normal((2, 37, 4, 8))
    dt.seed(11)
    ts = [dt.to_tensor(a.astype(dtype), stop_gradient=False) for a in (q, k, v)]
    mask = None if m is None else dt.to_tensor(m if m.dtype == np.bool_ else m.astype(dtype))
    out = F.scaled_dot_product_attention(*ts, attn_mask=mask, dropout_p=spec.get("p", 0.0),
                                         is_causal=spec.get("causal", False))
    seed = int(out._node.saved_tensor(6).numpy()) if spec.get("p") else 0  # the drawn seed
    (out * dt.to_tensor(dout.astype(dtype))).sum().backward()
    cast = [a.astype(dtype).astype(np.float64) for a in (q, k, v)]
    mref = m if m is None or m.dtype == np.bool_ else m.astype(dtype).astype(np.float64)
    want = _attention_ref(*cast, mref, spec.get("causal", False), spec.get("p", 0.0), seed,
                          dout.astype(dtype).astype(np.float64))
    got = [out.numpy()] + [t.grad.numpy() for t in ts]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= tol, f"{case} {name}: relative error {err:.2e} > {tol:.0e}"


def test_dropout_drops_and_is_seeded():
    rng = np.random.default_rng(0)
    q, k, v, _ = _inputs(rng)
    args = [dt.to_tensor(a) for a in (q, k, v)]
    dt.seed(3)
    a = F.scaled_dot_product_attention(*args, dropout_p=0.5).numpy()
    b = F.scaled_dot_product_attention(*args, dropout_p=0.5).numpy()
    dt.seed(3)
    c = F.scaled_dot_product_attention(*args, dropout_p=0.5).numpy()
    off = F.scaled_dot_product_attention(*args, dropout_p=0.5, training=False).numpy()
    np.testing.assert_array_equal(a, c)
    assert not np.allclose(a, b) and not np.allclose(a, off)
    np.testing.assert_allclose(off, _attention_ref(q, k, v, dout=np.zeros_like(q))[0], rtol=1e-12)


def test_fully_masked_row_gives_zeros():
    rng = np.random.default_rng(1)
    q, k, v, _ = _inputs(rng, sq=3, sk=4)
    m = np.ones((3, 4), bool)
    m[1] = False
    ts = [dt.to_tensor(a, stop_gradient=False) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*ts, attn_mask=dt.to_tensor(m))
    out.sum().backward()
    assert np.all(out.numpy()[:, 1] == 0) and np.all(ts[0].grad.numpy()[:, 1] == 0)
    assert np.isfinite(ts[1].grad.numpy()).all()


def test_saved_for_backward_is_linear_in_seq():
    """At seq 1024 the backward keeps q, k, v, out and the row log-sum-exp: O(s*d) bytes."""
    b, s, h, d = 1, 1024, 2, 32
    rng = np.random.default_rng(2)
    ts = [dt.to_tensor(rng.standard_normal((b, s, h, d)).astype(np.float32),
                       stop_gradient=False) for _ in range(3)]
    out = F.scaled_dot_product_attention(*ts, is_causal=True)
    node = out._node
    saved = sum(node.saved_tensor(i)._local_array().nbytes for i in range(len(node.saved))
                if node.saved[i] is not None)
    sd = b * s * h * d * 4
    assert saved == 4 * sd + b * h * s * 4 + 8, saved  # q, k, v, out; lse; the seed
    assert 7 * saved < b * h * s * s * 4  # the probabilities alone would be 8 MiB


def test_rms_norm_and_layer():
    rng = np.random.default_rng(3)
    x, w, g = rng.standard_normal((3, 5, 6)), rng.standard_normal(6), rng.standard_normal((3, 5, 6))
    xt, wt = dt.to_tensor(x, stop_gradient=False), dt.to_tensor(w, stop_gradient=False)
    y = F.rms_norm(xt, 6, wt, epsilon=1e-6)
    (y * dt.to_tensor(g)).sum().backward()
    r = rms(x, 2, 1e-6)
    np.testing.assert_allclose(y.numpy(), x * r * w, rtol=1e-12)
    dxhat = g * w
    np.testing.assert_allclose(xt.grad.numpy(), r * dxhat - x * r ** 3 * (dxhat * x).sum(
        -1, keepdims=True) / 6, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(wt.grad.numpy(), (g * x * r).sum((0, 1)), rtol=1e-10)
    layer = dt.nn.RMSNorm([5, 6])
    np.testing.assert_allclose(layer(dt.to_tensor(x)).numpy(), x * rms(x, 1, 1e-5), rtol=1e-6)


def _rope_complex(x, pos, base=10000.0):
    """LLaMA's complex form: pairs (x[2i], x[2i+1]) times exp(1j * pos * base^(-2i/d))."""
    d = x.shape[-1]
    ang = np.outer(pos, base ** (-np.arange(0, d, 2) / d))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * ang)[None, :, None, :]
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_styles(neox):
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 6, 3, 8)), rng.standard_normal((2, 6, 1, 8))
    sin, cos = IF.rotary_tables(6, 8, neox, dtype=np.float64)
    qt = dt.to_tensor(q, stop_gradient=False)
    q2, k2, v2 = IF.fused_rotary_position_embedding(qt, dt.to_tensor(k), sin=dt.to_tensor(sin),
                                                    cos=dt.to_tensor(cos),
                                                    use_neox_rotary_style=neox)
    assert v2 is None
    if neox:  # the halves: x1 * cos - x2 * sin, x2 * cos + x1 * sin
        ang = np.outer(np.arange(6), 10000.0 ** (-np.arange(0, 8, 2) / 8))[None, :, None]
        c, s = np.cos(ang), np.sin(ang)
        rot = lambda x: np.concatenate([x[..., :4] * c - x[..., 4:] * s,  # noqa: E731
                                        x[..., 4:] * c + x[..., :4] * s], -1)
    else:
        rot = lambda x: _rope_complex(x, np.arange(6))  # noqa: E731
    want = rot(q)
    np.testing.assert_allclose(k2.numpy(), rot(k), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(q2.numpy(), want, rtol=1e-12, atol=1e-12)
    # a rotation: the gradient of sum(q2 * g) is g rotated back
    g = rng.standard_normal(q.shape)
    (q2 * dt.to_tensor(g)).sum().backward()
    np.testing.assert_allclose(qt.grad.numpy(), g * cos - rotate(g * sin, neox), atol=1e-12)
    # default tables and position ids
    ids = rng.integers(0, 6, (2, 6))
    q3, _, _ = IF.fused_rotary_position_embedding(dt.to_tensor(q), sin=dt.to_tensor(sin),
                                                  cos=dt.to_tensor(cos),
                                                  position_ids=dt.to_tensor(ids),
                                                  use_neox_rotary_style=neox)
    np.testing.assert_allclose(q3.numpy(), q * cos[0][ids] + rotate(q, neox) * sin[0][ids],
                               atol=1e-12)


def test_swiglu():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 8))
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    np.testing.assert_allclose(IF.swiglu(dt.to_tensor(x)).numpy(), silu(x[:, :4]) * x[:, 4:],
                               rtol=1e-12)
    np.testing.assert_allclose(IF.swiglu(dt.to_tensor(x), dt.to_tensor(2 * x)).numpy(),
                               silu(x) * 2 * x, rtol=1e-12)
    with pytest.raises(ValueError, match="swiglu: .*even"):
        IF.swiglu(dt.to_tensor(rng.standard_normal((2, 3))))


def test_multi_head_attention_layer():
    rng = np.random.default_rng(6)
    dt.seed(0)
    mha = dt.nn.MultiHeadAttention(16, 4)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    mask = np.tril(np.ones((5, 5), bool))
    y = mha(dt.to_tensor(x), attn_mask=dt.to_tensor(mask)).numpy()
    p = {n: t.numpy().astype(np.float64) for n, t in mha.named_parameters()}
    proj = lambda a, n: (a @ p[f"{n}.weight"] + p[f"{n}.bias"]).reshape(2, 5, 4, 4)  # noqa
    q, k, v = proj(x, "q_proj"), proj(x, "k_proj"), proj(x, "v_proj")
    att = _attention_ref(q, k, v, mask, dout=np.zeros_like(q))[0].reshape(2, 5, 16)
    np.testing.assert_allclose(y, att @ p["out_proj.weight"] + p["out_proj.bias"], rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(ValueError, match="need_weights"):
        dt.nn.MultiHeadAttention(16, 4, need_weights=True)


_COMPILED = pytest.mark.skipif(attention_ops.fast.BACKEND != "numba",
                               reason="compiled kernels not chosen")


@_COMPILED
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_block_passes_match_numpy(dtype):
    """The numba row passes of a key block against the numpy ones, masked rows included."""
    rng = np.random.default_rng(12)
    s = rng.standard_normal((2, 3, 5, 20)).astype(dtype)
    s[rng.random(s.shape) < 0.3] = -np.inf
    s[0, 1, 2] = -np.inf  # a row with no kept key in this block
    m = np.where(rng.random((2, 3, 5)) < 0.5, -np.inf, rng.standard_normal((2, 3, 5))
                 ).astype(dtype)
    m[0, 1, 2] = -np.inf  # ... nor in the earlier ones
    lsum = np.where(np.isinf(m), 0, rng.uniform(1, 3, m.shape)).astype(dtype)
    got = [a.copy() for a in (s, m, lsum)]
    want = [a.copy() for a in (s, m, lsum)]
    alpha = attention_ops._softmax_block(np, *got)
    alpha_np = attention_ops._softmax_block_np(np, *want)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-15)
    for g, w in zip(got + [alpha], want + [alpha_np]):
        np.testing.assert_allclose(g, w, **tol)
    lse = np.where(rng.random(m.shape) < 0.2, np.inf, rng.uniform(0, 2, m.shape)).astype(dtype)
    delta = rng.standard_normal(m.shape).astype(dtype)
    dp = rng.standard_normal(s.shape).astype(dtype)
    p1, d1, p2, d2 = s.copy(), dp.copy(), s.copy(), dp.copy()
    attention_ops._grad_block(np, p1, d1, lse, delta)
    attention_ops._grad_block_np(np, p2, d2, lse, delta)
    np.testing.assert_allclose(p1, p2, **tol)
    np.testing.assert_allclose(d1, d2, **tol)


@_COMPILED
@pytest.mark.parametrize("name", ["attention_softmax", "attention_grad_rows"])
def test_compiled_attention_loops_stay_in_float32(name):
    """No double arithmetic in the float32 loops (compiled afresh: cached code has no IR)."""
    import re

    import numba

    from disttensor.ops import numba_attention, numba_loops

    fn = numba.njit(fastmath=numba_loops._SUMS, error_model="numpy")(
        getattr(numba_attention, name).py_func)
    a, v = np.ones((4, 8), np.float32), np.ones(4, np.float32)
    if name == "attention_grad_rows":
        fn(a, a.copy(), v, v.copy())
    else:
        fn(a, v, v.copy(), v.copy())
    ir = "\n".join(fn.inspect_llvm().values())
    doubles = [ln.strip() for ln in ir.splitlines()
               if re.search(r"= (fadd|fsub|fmul|fdiv|fpext)\b.* (double|float) ", ln)
               and re.search(r"\bdouble\b", ln)]
    assert not doubles, doubles[:5]


# -- distributed --------------------------------------------------------------------------------

def _world_mesh():
    return dt.ProcessMesh(list(range(dt.get_world_size())), dim_names=["x"])


def _moved(before):
    after = collectives.collective_counts()
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
            if after.get(k, 0) != before.get(k, 0)}


@pytest.mark.mpi
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(2)], [Shard(1)], [Replicate()]])
def test_attention_distributed_equals_dense_with_dropout(placements):
    """Values and gradients at every placement equal the dense run: the dropout mask is the
    same whatever the placements."""
    mesh = _world_mesh()
    rng = np.random.default_rng(7)
    q, k, v, _ = _inputs(rng, b=3, sq=7, sk=9, h=4, hk=2)
    m = rng.random((3, 1, 7, 9)) < 0.8

    def run(make):
        dt.seed(21)
        ts = [make(a, placements, False) for a in (q, k, v)]
        out = F.scaled_dot_product_attention(*ts, attn_mask=make(m, placements[:1] if
                                                                 placements[0] != Shard(2)
                                                                 else [Replicate()], True),
                                             dropout_p=0.3, is_causal=True)
        out.sum().backward()
        return [out.numpy()] + [t.grad.numpy() for t in ts], out

    dense, _ = run(lambda a, pl, sg: dt.to_tensor(a, stop_gradient=sg))
    dist, _ = run(lambda a, pl, sg: dt.shard_tensor(a, mesh, pl, stop_gradient=sg))
    for g, w in zip(dist, dense):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
def test_attention_rule_layouts():
    """Heads sharded: no communication; a sequence-sharded query keeps its shard (key and value
    replicated: no communication; sequence-sharded with batch and heads of size 1: key and
    value gathered); Partial inputs are reduced first."""
    mesh = _world_mesh()
    rng = np.random.default_rng(8)
    q, k, v, _ = _inputs(rng, b=2, sq=8, sk=8, h=4, hk=4)
    want = _attention_ref(q, k, v, causal=True, dout=np.zeros_like(q))[0]
    with dt.no_grad():
        heads = [dt.shard_tensor(a, mesh, [Shard(2)]) for a in (q, k, v)]
        before = collectives.collective_counts()
        out = F.scaled_dot_product_attention(*heads, is_causal=True)
        assert _moved(before) == {} and out.placements == [Shard(2)]
        seq_q = dt.shard_tensor(q, mesh, [Shard(1)])
        rep = [dt.shard_tensor(a, mesh, [Replicate()]) for a in (k, v)]
        before = collectives.collective_counts()
        out2 = F.scaled_dot_product_attention(seq_q, *rep, is_causal=True)
        assert _moved(before) == {} and out2.placements == [Shard(1)]
        # batch and heads of size 1: a sequence-sharded query keeps its shard, key and value
        # are gathered
        q1, k1, v1 = (dt.shard_tensor(a[:1, :, :1], mesh, [Shard(1)]) for a in (q, k, v))
        before = collectives.collective_counts()
        out4 = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True)
        moved = _moved(before)
        assert out4.placements == [Shard(1)]
        if dt.get_world_size() > 1:
            assert moved == {"all_gather": 2}, moved
        np.testing.assert_allclose(out4.numpy(), _attention_ref(
            q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], causal=True, dout=q[:1, :, :1])[0],
            rtol=1e-12)
        part = dt.dtensor_from_local(q / dt.get_world_size(), mesh, [Partial()])
        out3 = F.scaled_dot_product_attention(part, *heads[1:], is_causal=True)
        for o in (out, out2, out3):
            np.testing.assert_allclose(o.numpy(), want, rtol=1e-12)


@pytest.mark.mpi
def test_rms_norm_sharded_hidden_reduces_statistics_only():
    mesh = _world_mesh()
    rng = np.random.default_rng(9)
    x, w, g = rng.standard_normal((3, 5, 7)), rng.standard_normal(7), rng.standard_normal((3, 5, 7))
    xt = dt.shard_tensor(x, mesh, [Shard(2)], stop_gradient=False)
    wt = dt.shard_tensor(w, mesh, [Shard(0)], stop_gradient=False)
    gt = dt.shard_tensor(g, mesh, [Shard(2)])
    before = collectives.collective_counts()
    y = F.rms_norm(xt, 7, wt)
    moved = _moved(before)
    assert y.placements == [Shard(2)]
    assert set(moved) <= {"all_reduce"}, moved  # the [15] sums of squares, never x
    (y * gt).sum().backward()
    r = rms(x, 2, 1e-5)
    np.testing.assert_allclose(y.numpy(), x * r * w, rtol=1e-12)
    dxhat = g * w
    np.testing.assert_allclose(xt.grad.numpy(), r * dxhat - x * r ** 3 * (dxhat * x).sum(
        -1, keepdims=True) / 7, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(wt.grad.numpy(), (g * x * r).sum((0, 1)), rtol=1e-10)


@pytest.mark.mpi
def test_rotary_sharded_sequence_slices_tables():
    mesh = _world_mesh()
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 7, 2, 4))
    sin, cos = IF.rotary_tables(7, 4, False, dtype=np.float64)
    before = collectives.collective_counts()
    q2, _, _ = IF.fused_rotary_position_embedding(
        dt.shard_tensor(q, mesh, [Shard(1)]), sin=dt.shard_tensor(sin, mesh, [Replicate()]),
        cos=dt.shard_tensor(cos, mesh, [Replicate()]), use_neox_rotary_style=False)
    assert _moved(before) == {} and q2.placements == [Shard(1)]
    np.testing.assert_allclose(q2.numpy(), _rope_complex(q, np.arange(7)), atol=1e-12)


BAD = [
    ("heads", (2, 4, 3, 8), (2, 4, 2, 8), None, "the key/value heads \\(2\\) must divide the query "
                                                "heads \\(3\\)"),
    ("head_dim", (2, 4, 2, 8), (2, 4, 2, 6), None, "head_dim mismatch: query has 8, key 6"),
    ("mask", (2, 4, 2, 8), (2, 5, 2, 8), (2, 4, 4), "attn_mask of shape \\[2, 4, 4\\] is not "
                                                   "broadcastable"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("what,qs,ks,ms,msg", BAD, ids=[b[0] for b in BAD])
def test_attention_bad_input_raises_on_every_rank(what, qs, ks, ms, msg):
    mesh = _world_mesh()
    rng = np.random.default_rng(11)
    q = dt.shard_tensor(rng.standard_normal(qs), mesh, [Shard(0)])
    k = dt.shard_tensor(rng.standard_normal(ks), mesh, [Shard(0)])
    m = None if ms is None else dt.shard_tensor(rng.random(ms) < 0.5, mesh, [Replicate()])
    before = collectives.collective_counts()
    with pytest.raises(ValueError, match=f"scaled_dot_product_attention: {msg}"):
        F.scaled_dot_product_attention(q, k, k, attn_mask=m)
    assert _moved(before) == {}  # raised before any communication
    # every rank is still in step: a collective right after completes
    np.testing.assert_allclose(dt.sum(q).numpy(), float(np.sum(q.numpy())))


def test_coverage_report_has_no_fallback_for_transformer_ops():
    report = dt.coverage_report()
    ops = {"scaled_dot_product_attention", "scaled_dot_product_attention_grad", "rms_norm",
           "rms_norm_grad", "fused_rotary_position_embedding", "swiglu", "swiglu_grad"}
    assert ops <= set(report["rule"]) and not ops & set(report["fallback"])


@pytest.mark.mpi
def test_multi_head_attention_megatron_layout_gathers_no_weight():
    """q/k/v projections column-parallel, the output projection row-parallel: heads are split
    over the ranks, attention runs on them with no communication, the block's only collective
    is the output's all-reduce; values equal the dense layer's."""
    mesh = _world_mesh()
    dt.seed(1)
    mha = dt.nn.MultiHeadAttention(24, 12)
    x = np.random.default_rng(13).standard_normal((2, 5, 24)).astype(np.float32)
    mask = dt.to_tensor(np.tril(np.ones((5, 5), bool)))
    dense = mha(dt.to_tensor(x), attn_mask=mask).numpy()
    for proj in (mha.q_proj, mha.k_proj, mha.v_proj):
        proj.weight = dt.shard_tensor(proj.weight, mesh, [Shard(1)])
        proj.bias = dt.shard_tensor(proj.bias, mesh, [Shard(0)])
    mha.out_proj.weight = dt.shard_tensor(mha.out_proj.weight, mesh, [Shard(0)])
    mha.out_proj.bias = dt.shard_tensor(mha.out_proj.bias, mesh, [Replicate()])
    xd = dt.shard_tensor(x, mesh, [Replicate()])
    md = dt.shard_tensor(np.tril(np.ones((5, 5), bool)), mesh, [Replicate()])
    before = collectives.collective_counts()
    with dt.no_grad():
        out = mha(xd, attn_mask=md)
        final = dt.reshard(out, mesh, [Replicate()])
    moved = _moved(before)
    assert "all_gather" not in moved and "all_to_all" not in moved, moved
    np.testing.assert_allclose(final.numpy(), dense, rtol=1e-4, atol=1e-5)


@pytest.mark.mpi
def test_norm_and_rotary_bad_input_raise_on_every_rank():
    mesh = _world_mesh()
    rng = np.random.default_rng(14)
    x = dt.shard_tensor(rng.standard_normal((4, 6, 2, 8)), mesh, [Shard(1)])
    w = dt.shard_tensor(rng.standard_normal(5), mesh, [Replicate()])
    sin = dt.shard_tensor(rng.standard_normal((1, 5, 1, 8)), mesh, [Replicate()])
    before = collectives.collective_counts()
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \[8\], got \[5\]"):
        F.rms_norm(x, 8, w)
    rope = r"fused_rotary_position_embedding: sin must have shape \[1, 6, 1, 8\] for x "
    with pytest.raises(ValueError, match=rope + r"\[4, 6, 2, 8\], got \[1, 5, 1, 8\]"):
        IF.fused_rotary_position_embedding(x, sin=sin, cos=sin)
    with pytest.raises(TypeError, match="scaled_dot_product_attention: attn_mask must be bool or "
                                        "float64"):
        F.scaled_dot_product_attention(x, x, x, attn_mask=dt.ones([6, 6], dtype="float32"))
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: dropout_p must be"):
        F.scaled_dot_product_attention(x, x, x, dropout_p=1.0)
    assert _moved(before) == {}
    # a data check: position ids past the table, found by the rank holding them, raised by all
    ids = np.zeros((4, 6), np.int64)
    ids[3, 5] = 9
    table = dt.shard_tensor(rng.standard_normal((1, 8, 1, 8)), mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"fused_rotary_position_embedding: position_ids value "
                                         r"9 is out of range \[0, 8\)"):
        IF.fused_rotary_position_embedding(x, sin=table, cos=table, position_ids=dt.shard_tensor(
            ids, mesh, [Shard(0)]))[0].numpy()  # agreed at the next collective
    np.testing.assert_allclose(dt.sum(x).numpy(), float(np.sum(x.numpy())))
