"""The op functions Paddle keeps in ``paddle.nn.functional`` (re-exported from
:mod:`disttensor.ops`), plus ``linear``."""
from __future__ import annotations

from ..ops import (
    add,
    batch_norm,
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    log_softmax,
    matmul,
    mse_loss,
    one_hot,
    relu,
    relu_,
    sigmoid,
    silu,
    softmax,
    softmax_with_cross_entropy,
    tanh,
)
from ..ops.attention import scaled_dot_product_attention  # noqa: E402
from ..ops.conv import conv1d, conv2d  # noqa: F401
from ..ops.conv_transpose import conv1d_transpose, conv2d_transpose  # noqa: E402,F401
from ..ops.norm import rms_norm  # noqa: E402
from ..ops.padding import pad  # noqa: F401
from ..ops.pool import adaptive_avg_pool2d, adaptive_max_pool2d, avg_pool2d, interpolate, max_pool2d  # noqa: F401
from ..tensor import Tensor

__all__ = ["relu", "relu_", "gelu", "silu", "sigmoid", "tanh", "softmax", "log_softmax",
           "layer_norm", "batch_norm", "embedding", "cross_entropy", "softmax_with_cross_entropy",
           "mse_loss", "dropout", "one_hot", "linear"]
__all__ += ["scaled_dot_product_attention", "rms_norm", "conv1d", "conv2d", "adaptive_avg_pool2d",
            "adaptive_max_pool2d", "avg_pool2d", "interpolate", "max_pool2d", "pad"]
__all__ += ["conv1d_transpose", "conv2d_transpose"]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, name: str | None = None
           ) -> Tensor:
    """``x @ weight + bias`` with ``weight`` of shape ``[in_features, out_features]`` (Paddle's
    layout) and ``bias`` of shape ``[out_features]``."""
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D [in_features, out_features], got shape "
                         f"{weight.shape}")
    if x.ndim < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"linear: the last dim of x {x.shape} must equal in_features "
                         f"{weight.shape[0]} of weight {weight.shape}")
    out = matmul(x, weight)
    if bias is not None:
        if bias.shape != [weight.shape[1]]:
            raise ValueError(f"linear: bias shape {bias.shape} must be [{weight.shape[1]}] "
                             f"(out_features of weight {weight.shape})")
        out = add(out, bias)
    return out
