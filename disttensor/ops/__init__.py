"""All ops: each family module registers its ops in :data:`disttensor.schema.OPS` (one call per
op: kernel, backward, rule, dtype, view/inplace/mutates pairs, ...) and its public functions and
Tensor methods with :func:`disttensor.schema.public`. This package exports every public function
(the registry :data:`disttensor.schema.API` is the list; nothing here is kept by hand).

Family modules import each other in one direction: common -> creation -> elementwise -> shape ->
reduction -> matmul -> activation -> random -> embedding -> indexing -> norm -> loss -> optim.
"""
from __future__ import annotations

from ..schema import API, OPS
from . import (common, creation, elementwise, shape, reduction, matmul, activation, random,  # noqa: F401
               embedding, indexing, norm, loss, optim)
from . import math, einsum, statistics, scatter, sorting, sampling, subscript  # noqa: F401,E402
from . import conv, pool  # noqa: F401,E402
from . import attention, position, gated  # noqa: F401,E402
from . import conv_transpose, padding  # noqa: F401,E402

globals().update(API)
__all__ = sorted(API) + ["OPS"]
