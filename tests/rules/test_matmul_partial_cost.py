"""The matmul rule weighs keeping a Partial input (gathering the other operand, leaving the
output Partial) against resolving it, counting the output's later reduction: after a
normalisation written from primitives (its output Partial on mp), a column-parallel weight
stays sharded and the activation is all-reduced."""
from rules_util import meta, run

from spmd_rules import Partial, Replicate, Shard

S, R, P = Shard, Replicate, Partial
MESH = (2, 2)   # [dp, mp]


def test_column_parallel_after_partial_activation_reduces_the_activation():
    # h: [batch, seq, hidden] batch on dp, Partial on mp; w: [hidden, 4 * hidden] columns on mp
    r = run("matmul", meta((4, 8, 32), [S(0), P()], MESH), meta((32, 128), [R(), S(1)], MESH))
    assert r.inputs[0].to_placements() == [S(0), R()]          # all-reduce of h over mp
    assert r.inputs[1].to_placements() == [R(), S(1)]          # the weight is not gathered
    assert r.outputs[0].dist_attr.to_placements() == [S(0), S(2)]


def test_tied_head_after_partial_embedding_keeps_the_vocab_shards():
    # the embedding's vocab-parallel output is Partial on mp; logits = h @ E^T, E [vocab, d]
    r = run("matmul", meta((4, 3, 8), [S(0), P()], MESH), meta((97, 8), [R(), S(0)], MESH),
            transpose_y=True)
    assert r.inputs[0].to_placements() == [S(0), R()]
    assert r.inputs[1].to_placements() == [R(), S(0)]
    assert r.outputs[0].dist_attr.to_placements() == [S(0), S(2)]


def test_keeping_the_partial_wins_when_the_output_is_smaller():
    # a narrow projection [32 -> 4] of a Partial activation: reducing the [.., 4] output
    # later moves fewer bytes than reducing the [.., 32] input now
    r = run("matmul", meta((4, 8, 32), [S(0), P()], MESH), meta((32, 4), [R(), R()], MESH))
    assert r.inputs[0].to_placements() == [S(0), P()]
    assert r.outputs[0].dist_attr.to_placements() == [S(0), P()]
