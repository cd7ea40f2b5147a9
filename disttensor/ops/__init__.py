"""All ops, the public functions over them, and the Tensor methods/operators they provide.

Each family module registers its ops (kernel, backward, rule, view/inplace pairs) in
:data:`registry.OPS` next to their definitions."""
from __future__ import annotations

from . import creation, elementwise, matmul as _matmul_mod, optim, reduction, shape
from .activation import log_softmax, softmax
from .creation import arange, full, numel, ones, rand, randn, seed, uniform, zeros
from .elementwise import (abs, add, add_, assign, cast, clip, clip_, divide, divide_, equal, exp,
                          exp_, full_like, gelu, greater_equal, greater_than, less_equal,
                          less_than, log, logical_and, logical_not, logical_or, maximum, minimum,
                          multiply, multiply_, neg, not_equal, ones_like, pow, relu, relu_, rsqrt,
                          scale, scale_, sigmoid, silu, sqrt, subtract, subtract_, tanh, where,
                          zeros_like)
from .embedding import embedding
from .indexing import gather, index_select, one_hot
from .loss import cross_entropy, mse_loss, softmax_with_cross_entropy
from .matmul import matmul
from .norm import batch_norm, layer_norm
from .random import dropout
from .reduction import argmax, argmin, max, mean, min, sum
from .registry import OPS, OpDef, apply, apply_inplace, register
from .shape import (broadcast_to, chunk, concat, copy_, detach, expand, fill_, flatten, getitem,
                    reshape, setitem, split, squeeze, stack, tile, transpose, unsqueeze, zero_)
