"""Rematerialization of a captured step: run cheap forward ops again in the backward
instead of keeping their outputs alive from the forward to the backward.

A forward value the backward reads (a *middle*) is recomputed when it can be rebuilt by a short
chain of forward ops (at most :data:`DEPTH` deep) that are all

* marked ``recompute`` in the schema (cheap and deterministic: elementwise math, activations,
  layer_norm; never a random op) or views (reshape, transpose, ...), and
* one local kernel step each (after the steps resharding its inputs, whose results it is then
  recomputed from): no collective inside the kernel, nothing written in place, and no output
  whose register anything else writes,

from inputs the backward holds anyway at the point where it first reads the middle: program
inputs (parameters, buffers, data) that nothing writes in between, or forward values the
backward reads there or later. Chains that share an op, or where one reads a value another
recomputes, form one group. A group is copied into the backward just before the first read of
any of its middles, writing fresh registers (new SSA values), and every backward read of those
middles is pointed at the copies; the forward's values then die at their last forward use.
Groups that would only rebuild an op's non-differentiable side outputs (layer_norm's mean and
variance) are not worth it and are skipped.

A backward op never reshards a forward value again: autograd saves the value an op's kernel
read (a layer_norm of a Partial input saves the all-reduced input), so the gradient reads the
forward's reshard result, which a recomputed kernel then runs from.

In a GPT block the weight gradients read ``reshape(gelu(u))`` and ``reshape(layer_norm(x))``
long before ``gelu``'s and ``layer_norm``'s own gradients read ``u`` and ``x``: recomputing them
frees the MLP's widest activation between the forward and the backward. The copies are bitwise
the forward's values (the same kernels on the same inputs).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from ..schema import OPS

if TYPE_CHECKING:
    from .program import Program, ProgramOp

__all__ = ["rematerialize", "DEPTH"]

#: the longest chain of forward ops recomputed for one middle
DEPTH = 3


def rematerialize(prog: "Program") -> list[tuple[int, int]]:
    """Insert the recomputations into ``prog.ops`` (before :meth:`Program.split`); returns the
    ``(forward value, recomputed value)`` pairs of the middles now read from copies."""
    a = _Analysis(prog)
    groups = a.groups()
    if not groups:
        return []
    inserts: dict[int, list[tuple[list[int], list[int]]]] = {}
    for ops, middles in groups:
        at = min(a.first[m] for m in middles)
        inserts.setdefault(at, []).append((ops, middles))
    pairs: dict[int, int] = {}
    regs: dict[int, int] = {}                    # register of a middle -> its copy's
    new_ops: list = []
    for k, op in enumerate(prog.ops):
        for ops, middles in inserts.get(k, ()):
            copies: dict[int, int] = {}          # forward value -> its copy, in this group
            for j in ops:
                clone = _clone_op(prog, prog.ops[j], copies, len(prog.ops) + len(new_ops))
                new_ops.append(clone)
            for m in middles:
                pairs[m] = copies[m]
                regs[prog.values[m].reg] = prog.values[copies[m]].reg
        if op.phase != "forward" and any(v in pairs for v in op.ins):
            op = _reread(op, pairs, regs)
        new_ops.append(op)
    prog.ops = new_ops
    return sorted(pairs.items())


class _Analysis:
    """What :func:`rematerialize` needs to know about the program's ops and values."""

    def __init__(self, prog: "Program"):
        self.prog = prog
        ops = prog.ops
        self.writes: dict[int, list[int]] = {}   # register -> positions of ops writing it
        for k, op in enumerate(ops):
            for _, c in op.inplace:
                self.writes.setdefault(prog.values[c].reg, []).append(k)
        self.first: dict[int, int] = {}          # value -> first / last backward position
        self.last: dict[int, int] = {}
        self.pos: dict[int, int] = {}            # forward value -> position of its op
        for k, op in enumerate(ops):
            if op.phase == "forward":
                self.pos.update((v, k) for v in op.outs)
                continue
            for v in op.ins:
                if v is not None:
                    self.first.setdefault(v, k)
                    self.last[v] = k
        per_reg = Counter(v.reg for v in prog.values)
        self.ok = {k for k, op in enumerate(ops) if op.phase == "forward" and _cheap(op)
                   and all(per_reg[prog.values[v].reg] == 1 for v in op.outs)}
        self.reads = {k: _kernel_inputs(prog, ops[k]) for k in self.ok}
        self.kept = prog.escaping()

    def held(self, v: int, k: int, at: int) -> bool:
        """Whether input ``v`` of the op at position ``k`` still holds its value at ``at``
        without being kept longer than it is anyway."""
        if any(k < w < at for w in self.writes.get(self.prog.values[v].reg, ())):
            return False
        return self.prog.is_input(v) or self.last.get(v, -1) >= at

    def side_output(self, v: int) -> bool:
        """Whether forward value ``v`` is a non-differentiable side output of its op (a norm's
        statistics)."""
        op = self.prog.ops[self.pos[v]]
        return op.outs.index(v) in OPS[op.name].nondiff_outputs

    def chain(self, v: int, at: int, depth: int) -> set[int] | None:
        """Positions of the forward ops that rebuild ``v`` at ``at``, or None."""
        k = self.pos.get(v)
        if k is None or k not in self.ok or depth == 0:
            return None
        need = {k}
        for u in self.reads[k]:
            if u is None or self.held(u, k, at):
                continue
            sub = self.chain(u, at, depth - 1)
            if sub is None:
                return None
            need |= sub
        return need

    def groups(self) -> list[tuple[list[int], list[int]]]:
        """(op positions in order, middles they rebuild) per group worth recomputing."""
        prog = self.prog
        chains = {}
        for m in sorted(self.first, key=lambda v: self.pos.get(v, -1)):
            if m in self.pos and m not in self.kept:
                c = self.chain(m, self.first[m], DEPTH)
                if c is not None:
                    chains[m] = c
        parent = {m: m for m in chains}           # union-find over middles

        def find(m: int) -> int:
            while parent[m] != m:
                parent[m] = parent[parent[m]]
                m = parent[m]
            return m
        owner: dict[int, int] = {}                # op position -> a middle whose chain has it
        for m, c in chains.items():
            for k in c:
                parent[find(m)] = find(owner.setdefault(k, m))
        for m, c in chains.items():               # a chain reading another's middle joins it
            for k in c:
                for u in self.reads[k]:
                    if u in chains:
                        parent[find(m)] = find(u)
        members: dict[int, list[int]] = {}
        for m in chains:
            members.setdefault(find(m), []).append(m)
        out = []
        for ms in members.values():
            ops = sorted(set().union(*(chains[m] for m in ms)))
            made = {v for k in ops for v in prog.ops[k].outs}
            middles = sorted(v for v in made if v in self.first and v not in self.kept)
            at = min(self.first[v] for v in middles)
            if not all(u is None or u in made or self.held(u, k, at)
                       for k in ops for u in self.reads[k]):
                continue
            if all(self.side_output(v) for v in middles):
                continue
            out.append((ops, middles))
        return out


def _cheap(op: "ProgramOp") -> bool:
    """Whether the op's last step, a kernel marked ``recompute`` (or a view) with no collective
    inside, may run again; the steps before it may only reshard its inputs (their results are
    read from the forward)."""
    d = OPS[op.name]
    *moves, last = op.steps
    return (d.recompute or bool(d.view)) and not d.random and not op.inplace and \
        last.kind == "kernel" and len(op.scratch) == len(moves) and \
        all(s.kind in ("collective", "local") and not s.writes for s in moves) and \
        len(op.collectives) == sum(s.kind == "collective" for s in moves)


def _kernel_inputs(prog: "Program", op: "ProgramOp") -> tuple:
    """The values the op's last step reads: its inputs, or what its reshard steps made."""
    if len(op.steps) == 1:
        return op.ins
    at = {prog.values[v].reg: v for v in op.ins + op.scratch if v is not None}
    return tuple(at[r] for r in op.steps[-1].ins)


def _clone_op(prog: "Program", op: "ProgramOp", copies: dict[int, int], index: int
              ) -> "ProgramOp":
    """``op`` again, for the backward: reading the copies made so far in its group, writing new
    values in fresh registers (recorded in ``copies``)."""
    regs = {prog.values[v].reg: prog.values[c].reg for v, c in copies.items()}
    for m in op.outs:
        v = prog.values[m]
        reg = prog.n_regs
        prog.n_regs += 1
        regs[v.reg] = reg
        vid = len(prog.values)
        prog.values.append(replace(v, id=vid, name=f"{v.name}'", reg=reg, producer=index))
        prog.reg_value[reg] = vid
        copies[m] = vid
    s = op.steps[-1]
    step = replace(s, ins=tuple(regs.get(r, r) for r in s.ins), outs=tuple(regs[r] for r in s.outs))
    return replace(op, index=index, phase="backward", steps=(step,), scratch=(), collectives=(),
                   ins=tuple(None if v is None else copies.get(v, v)
                             for v in _kernel_inputs(prog, op)),
                   outs=tuple(copies[m] for m in op.outs),
                   views=tuple((copies.get(x, x), copies[y]) for x, y in op.views),
                   attrs=(op.attrs + ", " if op.attrs else "") + f"recomputes #{op.index}")


def _reread(op: "ProgramOp", values: dict[int, int], regs: dict[int, int]) -> "ProgramOp":
    """``op`` reading the recomputed copies instead of the forward's values."""
    steps = tuple(replace(s, ins=tuple(regs.get(r, r) for r in s.ins)) for s in op.steps)
    return replace(op, ins=tuple(None if v is None else values.get(v, v) for v in op.ins),
                   views=tuple((values.get(x, x), y) for x, y in op.views),
                   inplace=tuple((values.get(x, x), y) for x, y in op.inplace), steps=steps)
