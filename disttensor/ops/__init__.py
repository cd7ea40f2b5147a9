"""All ops: each family module registers its ops in :data:`disttensor.schema.OPS` (one call per
op: kernel, backward, rule, dtype, view/inplace/mutates pairs, ...) and its public functions and
Tensor methods with :func:`disttensor.schema.public`. This package exports every public function
(the registry :data:`disttensor.schema.API` is the list; nothing here is kept by hand).

Family modules import each other in one direction: common -> creation -> elementwise -> shape ->
reduction -> matmul -> activation -> random -> embedding -> indexing -> norm -> loss -> optim.
"""
from __future__ import annotations

from ..schema import API, OPS
from . import (  # noqa: F401  # noqa: F401,E402  # noqa: F401,E402  # noqa: F401,E402  # noqa: F401,E402
               activation,
               attention,
               common,
               conv,
               conv_transpose,
               creation,
               einsum,
               elementwise,
               embedding,
               gated,
               indexing,
               loss,
               math,
               matmul,
               norm,
               optim,
               padding,
               pool,
               position,
               random,
               reduction,
               sampling,
               scatter,
               shape,
               sorting,
               statistics,
               subscript,
)

globals().update(API)
__all__ = sorted(API) + ["OPS"]
