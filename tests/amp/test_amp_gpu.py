"""On a GPU: float16 autocast runs the white list in float16 on cupy arrays, and bfloat16 (which
cupy lacks) is refused with an error naming the op, the shape and the device."""
from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt

pytestmark = pytest.mark.gpu  # skipped without a CUDA device (tests/conftest.py)


def test_float16_autocast_on_gpu_and_bfloat16_refused():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((8, 3)) \
        .astype(np.float32)
    x, w = dt.to_tensor(a, place="gpu"), dt.to_tensor(b, place="gpu")
    with dt.amp.auto_cast(dtype="float16"):
        y = dt.matmul(x, w)
    assert y.dtype == np.float16 and y.place.startswith("gpu")
    np.testing.assert_allclose(y.numpy().astype(np.float32),
                               a.astype(np.float16).astype(np.float32)
                               @ b.astype(np.float16).astype(np.float32), rtol=2e-3, atol=2e-3)
    with pytest.raises(TypeError, match=r"cast: bfloat16 tensors live on the CPU only.*\[4, 8\] "
                                        r"is on gpu:0"):
        x.cast("bfloat16")
