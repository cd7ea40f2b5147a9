"""Bad arguments get one clear message naming the op, the argument (and the shapes), raised by
the public function before any kernel or collective runs, so every rank raises the same error on
dense and on distributed tensors alike, and nothing is modified."""
from __future__ import annotations

import re

import numpy as np
import pytest

import disttensor as dt
from disttensor import ProcessMesh, Replicate, Shard

pytestmark = pytest.mark.mpi


def tensors() -> dict:
    """The same [4, 6] float32 data dense, replicated and sharded over every rank."""
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    mesh = ProcessMesh(list(range(dt.get_world_size())), dim_names=["x"])
    return {"dense": dt.to_tensor(a), "replicated": dt.shard_tensor(a, mesh, [Replicate()]),
            "sharded": dt.shard_tensor(a, mesh, [Shard(1)])}


CASES = {
    "transpose": (lambda x: dt.transpose(x, 1), TypeError,
                  "transpose: argument 'perm' must be a list of ints (a permutation of the 2 axes "
                  "of shape [4, 6]), got int 1"),
    "transpose_perm": (lambda x: x.transpose([0, 0]), ValueError,
                       "transpose: argument 'perm' [0, 0] is not a permutation of the 2 axes of "
                       "shape [4, 6]"),
    "mean": (lambda x: dt.mean(x, axis=1.0), TypeError,
             "mean: argument 'axis' must be an int, a list of ints or None, got float 1.0"),
    "mean_range": (lambda x: x.mean(axis=2), ValueError,
                   "mean: argument 'axis'=2 is out of range for a tensor of rank 2"),
    "clip": (lambda x: dt.clip(x, min="a"), TypeError,
             "clip: argument 'min' must be a number or None, got str 'a'"),
    "add": (lambda x: dt.add(x, dt.ones([3, 6])), ValueError,
            "add: shapes cannot be broadcast together: input 0=(4, 6), input 1=(3, 6)"),
    "add_operator": (lambda x: x + dt.ones([4, 5]), ValueError,
                     "add: shapes cannot be broadcast together: input 0=(4, 6), "
                     "input 1=(4, 5)"),
    "less_than": (lambda x: dt.less_than(dt.ones([2]), x), ValueError,
                  "less_than: shapes cannot be broadcast together: input 0=(2,), "
                  "input 1=(4, 6)"),
}


@pytest.mark.parametrize("layout", ["dense", "replicated", "sharded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_message_names_op_and_argument(case, layout):
    fn, exc, msg = CASES[case]
    x = tensors()[layout]
    v = x.inplace_version
    # distributed inputs: the rule's message, which adds the inputs' placements
    tail = "$" if layout == "dense" or "broadcast" not in msg else \
        r" \(distributed inputs: input 0: .*(Shard|Replicate).*\)$"
    with pytest.raises(exc, match="^" + re.escape(msg) + tail):
        fn(x)
    assert x.inplace_version == v
    np.testing.assert_array_equal(x.numpy(), np.arange(24, dtype=np.float32).reshape(4, 6))


@pytest.mark.parametrize("op", ["zeros", "ones", "full", "rand"])
def test_creation_shape_message_names_the_op(op):
    fn = {"zeros": dt.zeros, "ones": dt.ones, "rand": dt.rand,
          "full": lambda s: dt.full(s, 2.0)}[op]
    with pytest.raises(TypeError, match="^" + re.escape(
            f"{op}: argument 'shape' must be an int or a sequence of ints, got str 'abc'") + "$"):
        fn("abc")
    with pytest.raises(ValueError, match=re.escape(f"{op}: argument 'shape' [2, -1] has a "
                                                   "negative dim")):
        fn([2, -1])
    assert fn([2, 3]).shape == [2, 3]


@pytest.mark.parametrize("layout", ["dense", "sharded"])
def test_int_tensor_refuses_a_float_result_inplace(layout):
    a = np.arange(8, dtype=np.int64).reshape(2, 4)
    mesh = ProcessMesh(list(range(dt.get_world_size())))
    x = dt.to_tensor(a) if layout == "dense" else dt.shard_tensor(a, mesh, [Shard(1)])
    v = x.inplace_version
    with pytest.raises(TypeError, match=r"^add: inputs of different dtypes \(input 0: int64, "
                                        r"input 1: float32\)"):
        x.add_(0.5)
    with pytest.raises(TypeError, match="^divide_: result type float64 can't be cast to the "
                                        "desired output type int64"):
        x.divide_(dt.to_tensor(np.full((2, 4), 2)))
    assert x.inplace_version == v  # nothing was modified
    x.add_(1)
    np.testing.assert_array_equal(x.numpy(), a + 1)
