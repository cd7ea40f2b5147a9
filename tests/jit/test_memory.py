"""Memory planning: worklist liveness, arena placement, the verifier, and captured
training steps replayed in their planned arena.

Oracles: liveness against a naive fixed point over Python sets; the lower bound against a numpy
occupancy array over instructions; arena plans against a brute-force overlap check."""
from __future__ import annotations

import json
import os
import random
import re
import sys

import numpy as np
import pytest

import disttensor as dt
from disttensor.jit import verify
from disttensor.jit.memory import (
    ALIGN,
    STRATEGIES,
    Block,
    Buffer,
    OverlapError,
    aligned,
    check_arena,
    live_ranges,
    liveness,
    lower_bound,
    plan_arena,
)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import train  # noqa: E402

# a reference instance of the problem
EXAMPLE = os.path.join(HERE, "..", "data", "memory_planning_example.json")


def _example() -> tuple[list[Buffer], dict]:
    with open(EXAMPLE) as f:
        data = json.load(f)
    # the paper's sizes in units of ALIGN bytes, so every size is aligned
    return [Buffer(r["tensor"], r["size"] * ALIGN, r["first_op"], r["last_op"])
            for r in data["records"]], data


def _overlaps(buffers, offsets) -> list[tuple[int, int]]:
    """Brute force: pairs live at one instruction that share a byte."""
    bad = []
    for i, a in enumerate(buffers):
        for b in buffers[i + 1:]:
            if a.first <= b.last and b.first <= a.last and \
                    offsets[a.id] < offsets[b.id] + b.size and \
                    offsets[b.id] < offsets[a.id] + a.size:
                bad.append((a.id, b.id))
    return bad


def _occupancy_bound(buffers) -> int:
    n = max(b.last for b in buffers) + 1
    live = np.zeros(n, np.int64)
    for b in buffers:
        live[b.first:b.last + 1] += b.size
    return int(live.max())


# -- the Pisarchyk & Lee example ---------------------------------------------------------------

def test_paper_example_reaches_the_lower_bound():
    buffers, data = _example()
    assert lower_bound(buffers) == data["lower_bound"] * ALIGN == _occupancy_bound(buffers)
    plan = plan_arena(buffers, list(STRATEGIES))
    assert plan.no_reuse == data["no_reuse_total"] * ALIGN
    assert plan.size == data["lower_bound"] * ALIGN  # 124: optimal
    assert plan.tried["greedy_by_size"] == 124 * ALIGN
    assert _overlaps(buffers, plan.offsets) == []
    for name in STRATEGIES:  # every strategy alone gives a valid plan, never below the bound
        p = plan_arena(buffers, [name])
        assert _overlaps(buffers, p.offsets) == [] and p.size >= p.lower_bound


def test_planner_refuses_unaligned_sizes():
    with pytest.raises(ValueError, match="buffer 3 has size 100"):
        plan_arena([Buffer(3, 100, 0, 1)])


@pytest.mark.parametrize("seed", range(40))
def test_random_instances_are_valid_and_not_below_the_bound(seed):
    rng = random.Random(seed)
    n_ops = rng.randint(1, 60)
    buffers = []
    for i in range(rng.randint(1, 80)):
        f = rng.randrange(n_ops)
        buffers.append(Buffer(i, aligned(rng.randint(1, 5000)), f,
                              min(n_ops - 1, f + rng.choice([0, 1, 2, 5, 30]))))
    bound = _occupancy_bound(buffers)
    plan = plan_arena(buffers, list(STRATEGIES))
    assert plan.lower_bound == bound
    assert plan.size >= bound and plan.size == min(plan.tried.values())
    for name in STRATEGIES:
        p = plan_arena(buffers, [name])
        assert _overlaps(buffers, p.offsets) == [], name
        assert all(o % ALIGN == 0 for o in p.offsets.values())
        assert p.size >= bound
        check_arena(buffers, p.offsets)  # the verifier agrees with brute force


def test_verifier_names_both_buffers_of_a_corrupted_plan():
    buffers, _ = _example()
    plan = plan_arena(buffers)
    offsets = dict(plan.offsets)
    offsets[3] = offsets[2]  # tensors 2 and 3 are both live at ops 3..5
    with pytest.raises(OverlapError, match=r"buffer (2|3) .* overlaps buffer (2|3)"):
        check_arena(buffers, offsets)
    offsets = dict(plan.offsets)
    offsets[0] += 8
    with pytest.raises(OverlapError, match="not a multiple of 64"):
        check_arena(buffers, offsets)


@pytest.mark.parametrize("first,last", [(0, 3), (3, 5), (2, 2), (3, 3)])
def test_verifier_rejects_buffers_sharing_one_instruction(first, last):
    """Live ranges are inclusive: a buffer whose first (or last) instruction is another's last
    (or first) is live with it there, so the two may not share a byte, in either order of
    ids and with the second block only partly over the first."""
    a = Buffer(0, 4 * ALIGN, 3, 3) if (first, last) == (3, 3) else Buffer(0, 4 * ALIGN, 0, 3)
    b = Buffer(1, 2 * ALIGN, first, last)
    for buffers in ([a, b], [b, a]):
        for off_b in (0, 2 * ALIGN, 3 * ALIGN):
            with pytest.raises(OverlapError, match=r"buffer (0|1) .* overlaps buffer (0|1)"):
                check_arena(buffers, {0: 0, 1: off_b})
            assert _overlaps(buffers, {0: 0, 1: off_b})
        check_arena(buffers, {0: 0, 1: 4 * ALIGN})  # side by side: fine


@pytest.mark.parametrize("order", ["as_given", "reversed"])
def test_verifier_accepts_adjacent_lifetimes_in_one_place(order):
    """[0, 2] then [3, 5] then [6, 6] in the same bytes: never live together, accepted; a buffer
    that dies where the next one starts is not."""
    chain = [Buffer(0, 2 * ALIGN, 0, 2), Buffer(1, 2 * ALIGN, 3, 5), Buffer(2, ALIGN, 6, 6),
             Buffer(3, 3 * ALIGN, 7, 9)]
    buffers = chain if order == "as_given" else chain[::-1]
    check_arena(buffers, {i: 0 for i in range(4)})
    bad = buffers + [Buffer(4, ALIGN, 5, 7)]  # live with buffer 1 at 5, 2 at 6 and 3 at 7
    with pytest.raises(OverlapError, match="buffer 4"):
        check_arena(bad, {**{i: 0 for i in range(4)}, 4: 0})
    check_arena(bad, {**{i: 0 for i in range(4)}, 4: 3 * ALIGN})


@pytest.mark.parametrize("seed", range(30))
def test_verifier_agrees_with_brute_force_on_random_plans(seed):
    """Random buffers with few distinct instructions (many shared first/last ones) at random
    aligned offsets in a small arena: the verifier raises exactly when brute force finds a pair
    live at one instruction that shares a byte, and names a pair it finds."""
    rng = random.Random(seed)
    for _ in range(40):
        n_ops = rng.randint(1, 8)
        buffers = []
        for i in range(rng.randint(1, 8)):
            f = rng.randrange(n_ops)
            buffers.append(Buffer(i, ALIGN * rng.randint(1, 4), f, rng.randint(f, n_ops - 1)))
        offsets = {b.id: ALIGN * rng.randint(0, 8) for b in buffers}
        bad = _overlaps(buffers, offsets)
        if bad:
            with pytest.raises(OverlapError) as info:
                check_arena(buffers, offsets)
            named = {int(m) for m in re.findall(r"buffer (\d+)", str(info.value))}
            assert any(set(p) == named for p in bad), (str(info.value), bad)
        else:
            check_arena(buffers, offsets)


# -- liveness -----------------------------------------------------------------------------------

def _naive_liveness(blocks):
    """Round-robin fixed point over Python sets (the slow algorithm the worklist replaced)."""
    n = len(blocks)
    live_in = [set() for _ in range(n)]
    live_out = [set() for _ in range(n)]
    changed = True
    while changed:
        changed = False
        for b in range(n):
            out = set().union(*(live_in[s] for s in blocks[b].succs)) if blocks[b].succs else set()
            live = set(out)
            for uses, defs in reversed(blocks[b].instrs):
                live = (live - _ids(defs)) | _ids(uses)
            if live != live_in[b] or out != live_out[b]:
                live_in[b], live_out[b], changed = live, out, True
    return live_in, live_out


def _ids(bits: int) -> set[int]:
    return {i for i in range(bits.bit_length()) if bits >> i & 1}


@pytest.mark.parametrize("seed", range(30))
def test_worklist_liveness_equals_the_naive_fixed_point_with_loops(seed):
    rng = random.Random(seed)
    n_blocks, n_vals = rng.randint(1, 8), rng.randint(1, 30)
    blocks = []
    for b in range(n_blocks):
        instrs = [(sum(1 << v for v in rng.sample(range(n_vals), rng.randint(0, min(3, n_vals)))),
                   sum(1 << v for v in rng.sample(range(n_vals), rng.randint(0, min(2, n_vals)))))
                  for _ in range(rng.randint(1, 6))]
        succs = tuple(rng.sample(range(n_blocks), rng.randint(0, min(2, n_blocks))))  # loops too
        blocks.append(Block(instrs, succs))
    live_in, live_out = liveness(blocks)
    naive_in, naive_out = _naive_liveness(blocks)
    assert [_ids(x) for x in live_in] == naive_in
    assert [_ids(x) for x in live_out] == naive_out


def test_live_ranges_of_a_straight_line_program():
    # v0 input; 0: v1 = f(v0); 1: v2 = g(v1, v0); 2: v3 = h(v1); 3: use v2, v3; v4 never used
    instrs = [(1 << 0, 1 << 1), ((1 << 1) | 1, 1 << 2), (1 << 1, (1 << 3) | (1 << 4)),
              ((1 << 2) | (1 << 3), 0)]
    first, last = live_ranges([Block(instrs)], 5)
    assert first == [-1, 0, 1, 2, 2]
    assert last == [1, 2, 3, 3, 2]


def test_live_ranges_through_a_loop():
    # block 0 defines v0; block 1 (a loop body) uses v0 and loops to itself or exits to block 2
    blocks = [Block([(0, 1)], (1,)), Block([(1, 2), (2, 0)], (1, 2)), Block([(0, 4)], ())]
    first, last = live_ranges(blocks, 3)
    assert first[0] == 0 and last[0] == 2   # live around the loop: to the end of block 1
    assert first[2] == 3 and last[2] == 3


# -- captured training steps in their planned arena ---------------------------------------------

def _steps(model_name, size, mesh, captured, plan_memory=True, n=5, batch=16):
    model, opt, batches = train.build(model_name, 7, mesh, batch=batch, size=size)
    step = (lambda x, y: train.train_step(model, opt, x, y))
    if captured:
        step = dt.jit.to_static(step, plan_memory=plan_memory)
    losses = [float(step(*train.to_tensors(*batches[k % 4], mesh)).numpy()) for k in range(n)]
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    return losses, params, step


WORLD = dt.get_world_size()


def tightness(scope: str, recompute: bool = False) -> float:
    """How close to the lower bound the arena must come. 1.01 at 1, 2 and 4 ranks.
    On the [3, 1] mesh with every temporary placed, batch 16 splits 6/5/5 and the GPT's peak
    holds one large short-lived temporary among many long-lived pieces: the strategies stop at
    1.03-1.04x and 1,500 random placement orders at best reach 1.06x (the bound is a bound, not
    always an achievable size). Recomputed programs in scope "all" reach 1.012-1.018x."""
    if scope == "all" and WORLD == 3:
        return 1.05
    return 1.02 if recompute and scope == "all" else 1.01


@pytest.mark.mpi
@pytest.mark.parametrize("scope", ["kernels", "all"])
@pytest.mark.parametrize("size", ["default", "large"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_planned_step_is_tight_verified_and_equals_eager(model_name, size, scope, comm):
    mesh = train.default_mesh(WORLD)
    eager = _steps(model_name, size, mesh, captured=False)
    losses, params, step = _steps(model_name, size, mesh, captured=True, plan_memory=scope)
    prog = step.program
    verify(prog, prog.memory)
    report = prog.memory_report()
    assert report["arena_bytes"] <= tightness(scope) * report["lower_bound_bytes"], report["tried"]
    assert report["arena_bytes"] >= report["lower_bound_bytes"]
    assert report["no_reuse_bytes"] > report["arena_bytes"]  # dead blocks were reused
    assert report["inplace_reuse"], "no op wrote into its dying input"
    assert "out=B" in prog.forward.source  # kernels write into the arena directly
    assert report["scope"] == scope
    copies = prog.forward.source.count("_into(") + prog.backward.source.count("_into(")
    assert (copies > 0) == (scope == "all")  # only "all" copies what a kernel made itself
    buckets = [op.outs[0] for op in prog.ops if op.name == "grad_bucket_start"]
    assert bool(buckets) == (mesh.shape[0] > 1)  # data parallel: buckets, packed in the arena
    assert all(prog.values[b].reg in prog.memory.group for b in buckets)
    assert losses == eager[0]
    for k in eager[1]:
        np.testing.assert_array_equal(params[k], eager[1][k], err_msg=k)


@pytest.mark.mpi
def test_a_corrupted_program_plan_is_caught(comm):
    mesh = train.default_mesh(WORLD)
    _, _, step = _steps("mlp", "default", mesh, captured=True, n=3)
    prog, mp = step.program, step.program.memory
    verify(prog, mp)
    # hand a buffer's bytes to another while it is still needed: shorten its live range so the
    # arena lets a later buffer take them, then place that one on top of it
    b = max(mp.buffers, key=lambda b: b.last - b.first)
    victim_last = b.last
    b.last = b.first
    with pytest.raises(OverlapError, match=r"(reads|writes) .* (after|outside) the live range"):
        verify(prog, mp)
    b.last = victim_last
    other = next(o for o in mp.buffers if o.first > b.first and o.first < b.last and o is not b)
    saved = mp.arena.offsets[other.id]
    mp.arena.offsets[other.id] = mp.arena.offsets[b.id]
    with pytest.raises(OverlapError, match="overlaps"):
        verify(prog, mp)
    mp.arena.offsets[other.id] = saved
    verify(prog, mp)


def test_values_backward_needs_only_the_shape_of_die_in_forward():
    """add's inputs are no_need_buffer: the tape does not save them, so the matmul output feeding
    the first bias add is dead after that add, long before backward starts."""
    _, _, step = _steps("mlp", "default", None, captured=True, n=3)
    prog = step.program
    n_fwd = sum(len(op.steps) for op in prog.forward.ops)
    add = next(op for op in prog.forward.ops if op.name == "add")
    mm_out = add.ins[0]
    assert prog.ops[prog.values[mm_out].producer].name == "matmul"
    assert prog.memory.last[mm_out] < n_fwd
    assert mm_out not in prog.forward.outputs["middles"]


def test_planned_and_unplanned_replays_agree_and_the_plot_is_drawn(tmp_path):
    a = _steps("gpt", "default", None, captured=True, plan_memory="all")
    b = _steps("gpt", "default", None, captured=True, plan_memory=False)
    assert a[0] == b[0]
    assert b[2].program.memory is None
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    path = tmp_path / "arena.png"
    a[2].program.plot_memory(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.mpi
def test_a_kernel_writing_outside_its_buffer_is_caught(comm):
    mesh = train.default_mesh(WORLD)
    model, opt, batches = train.build("gpt", 7, mesh)
    step = dt.jit.to_static(lambda x, y: train.train_step(model, opt, x, y))
    data = [train.to_tensors(*b, mesh) for b in batches]
    for k in range(2):
        step(*data[k])
    prog = step.program
    prog.watch_writes()
    step(*data[2])  # a correct plan passes every check
    watch = prog.forward.fn.__globals__["_watch"]
    k = next(k for k in range(len(prog.forward.ops)) if watch.protect[k])
    g, off, _ = watch.protect[k][0]
    env = prog.forward.fn.__globals__
    kernel = env[f"F{k}"]

    def stray(*args, **kwargs):  # the kernel also flips a byte of a live neighbour
        out = kernel(*args, **kwargs)
        prog.arena[off] ^= 0xFF
        return out
    env[f"F{k}"] = stray
    with pytest.raises(OverlapError, match=rf"step {k} \(\w+\) wrote outside its buffers: the "
                                           rf"bytes of buffer of %\d+, live across it, changed"):
        step(*data[3])


def test_plan_memory_values_are_checked():
    with pytest.raises(ValueError, match="to_static: argument 'plan_memory'='some': expected "
                                         "'kernels', 'all' or False"):
        dt.jit.to_static(lambda x: x, plan_memory="some")


@pytest.mark.mpi
@pytest.mark.parametrize("scope", ["kernels", "all"])
def test_a_layout_unchanged_reshard_copies_nothing_when_its_input_dies(scope, comm):
    """A reshard to the layout a value already has is a copy (eager returns a new tensor). In a
    planned replay the copy takes its input's block when the input dies there, and nothing
    moves; where the input is read afterwards, the copy has its own block and writing into the
    copy leaves the input as it was. Oracle: numpy on the global arrays."""
    mesh = dt.ProcessMesh(list(range(WORLD)), dim_names=["x"])
    rng = np.random.default_rng(0)

    def step(x):
        y = dt.reshard(x * 2.0, mesh, [dt.Shard(0)])   # x * 2 dies at the copy
        z = x * 3.0
        w = dt.reshard(z, mesh, [dt.Shard(0)])         # z is read again below
        w.scale_(1.0, 1.0)
        return y + w + z

    captured = dt.jit.to_static(step, plan_memory=scope)
    for k in range(3):
        a = rng.standard_normal((4 * WORLD, 8))
        out = captured(dt.shard_tensor(a, mesh, [dt.Shard(0)])).numpy()
        np.testing.assert_allclose(out, 2 * a + (3 * a + 1) + 3 * a, rtol=1e-12)
    prog = captured.program
    verify(prog, prog.memory)
    copies = [op for op in prog.ops if op.name == "reshard"]
    assert len(copies) == 2 and all(s.kind == "local" for op in copies for s in op.steps)
    reused = [(i, o) for name, i, o in prog.memory.reused if name == "reshard"]
    names = {v: prog.values[v].name for op in copies for v in op.ins + op.outs}
    assert reused == [(names[copies[0].ins[0]], names[copies[0].outs[0]])]
    group = prog.memory.group
    y, w = (prog.values[op.outs[0]].reg for op in copies)
    assert group[y] == group[prog.values[copies[0].ins[0]].reg]
    assert group.get(w, "outside the arena") != group[prog.values[copies[1].ins[0]].reg]


@pytest.mark.mpi
def test_bucket_gradients_are_made_in_place_in_the_bucket(comm):
    """A data-parallel weight gradient made by a kernel with ``out=`` that dies in its gradient
    bucket is written at its part of the bucket's block, so packing the bucket copies nothing,
    and the arena is no larger than without that placement. Oracle: SGD in numpy on the global
    arrays."""
    if WORLD < 2:
        pytest.skip("needs a data-parallel mesh dim of 2 ranks or more")
    from disttensor.jit import buffers
    mesh = dt.ProcessMesh(list(range(WORLD)), dim_names=["dp"])
    rng = np.random.default_rng(3)
    w0, b0 = rng.standard_normal((24, 40)), rng.standard_normal(40)
    xs = [rng.standard_normal((4 * WORLD, 24)) for _ in range(4)]
    lr = 0.05

    def run(pack: bool):
        w = dt.shard_tensor(w0, mesh, [dt.Replicate()], stop_gradient=False)
        b = dt.shard_tensor(b0, mesh, [dt.Replicate()], stop_gradient=False)
        opt = dt.optimizer.SGD(learning_rate=lr, parameters=[w, b])

        def step(x):
            y = dt.matmul(x, w) + b
            loss = (y * y).mean()
            loss.backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
            return loss
        saved = buffers._pack_in_place
        if not pack:
            buffers._pack_in_place = lambda *args: {}
        try:
            captured = dt.jit.to_static(step)
            for x in xs:
                captured(dt.shard_tensor(x, mesh, [dt.Shard(0)]))
        finally:
            buffers._pack_in_place = saved
        return w.numpy(), b.numpy(), captured.program

    w, b, prog = run(pack=True)
    wn, bn = w0.copy(), b0.copy()
    for x in xs:
        y = x @ wn + bn
        g = 2 * y / y.size
        wn, bn = wn - lr * (x.T @ g), bn - lr * g.sum(0)
    np.testing.assert_allclose(w, wn, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b, bn, rtol=1e-12, atol=1e-12)
    verify(prog, prog.memory)
    mp = prog.memory
    start = next(op for op in prog.ops if op.name == "grad_bucket_start")
    bucket, = (prog.values[v].reg for v in start.outs)
    dw = next(v for v in start.ins if prog.values[v].local_shape == (24, 40))
    assert prog.ops[prog.values[dw].producer].name == "matmul"
    r, (s,) = prog.values[dw].reg, start.steps
    assert mp.group[r] == mp.group[bucket]   # in the bucket's block, at its part of it
    lo = s.packs[s.ins.index(r)]
    assert mp.reg_at[r][0] == mp.reg_at[bucket][0] + lo * 8
    unpacked = run(pack=False)[2]
    assert unpacked.memory.group.get(prog.values[dw].reg) != unpacked.memory.group[bucket]
    assert mp.arena.size <= unpacked.memory.arena.size


def test_a_step_on_another_array_module_stays_out_of_the_arena():
    """Each replayed step runs with the array module eager ran its op with: a creation op's
    place may differ from the program's device (the optimizer's learning rate is a host scalar
    beside GPU kernels). The planner keeps what such a step makes out of the program's arena.
    (On the CPU every step is numpy: one step is marked as another module's here.)"""
    from disttensor.jit.buffers import plan_buffers, timeline
    _, _, step = _steps("mlp", "default", None, captured=True, plan_memory="all", n=3)
    prog = step.program
    assert all(s.xp is np for _, s in timeline(prog))
    planned = [s for k, (_, s) in enumerate(timeline(prog))
               if s.kind == "kernel" and any((k, r) in prog.memory.define for r in s.outs)]
    marked = planned[len(planned) // 2]
    marked.xp = object()  # stands for cupy
    mp = plan_buffers(prog, prog.escaping(), "all")
    defined = {r for _, r in mp.define}
    assert not defined & set(marked.outs)
    assert len(defined) >= len({r for _, r in prog.memory.define}) - len(marked.outs) - 2
