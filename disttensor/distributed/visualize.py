"""``visualize_sharding(x)``: a text picture of which rank holds which block of a distributed
tensor. Metadata only (global shape, mesh, DistAttr): nothing is communicated, so any rank can
call it, members of the mesh or not, and every rank gets the same text."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spmd_rules import local_slices

from ..layout.mesh_groups import get_rank
from ..tensor import Tensor

__all__ = ["visualize_sharding"]


def _fmt_placement(p) -> str:
    if p.is_shard():
        return f"S({p.dim})" if p.shard_order is None else f"S({p.dim}, order {p.shard_order})"
    if p.is_partial():
        return f"P({p.reduce_type.value})"
    return "R"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """An ASCII box table; cells may hold several lines separated by newlines."""
    cols = len(header)
    split = [[str(c).split("\n") for c in r] for r in [list(header)] + [list(r) for r in rows]]
    widths = [max(len(line) for r in split for line in r[j]) for j in range(cols)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [rule]
    for i, r in enumerate(split):
        height = max(len(c) for c in r)
        for k in range(height):
            out.append("|" + "|".join(f" {(c[k] if k < len(c) else ''):<{w}} "
                                      for c, w in zip(r, widths)) + "|")
        if i == 0 or i == len(split) - 1:
            out.append(rule)
    return out


def _rng(s: slice) -> str:
    return f"{s.start}:{s.stop}"


def visualize_sharding(x, print_: bool = True) -> str:
    """Return (and, with ``print_``, print on rank 0) a picture of ``x``'s layout.

    For 1-d and 2-d tensors a grid of blocks: each cell gives the global index ranges of the
    block and the ranks holding it (``P(sum)`` etc. marks blocks whose ranks hold addends of a
    Partial value rather than copies). Every tensor, whatever its rank, also gets a per-rank table:
    mesh coordinate, global index ranges, local shape and bytes."""
    if not isinstance(x, Tensor) or not x.is_dist():
        raise TypeError("visualize_sharding: x must be a distributed Tensor (made by shard_tensor "
                        "or dtensor_from_local)")
    v = x._value
    mesh, attr, shape = v.mesh, v.dist_attr, tuple(v.shape)
    itemsize = np.dtype(v.dtype).itemsize
    placements = attr.to_placements()
    lines = [f"DistTensor shape {list(shape)} dtype {np.dtype(v.dtype).name} on mesh "
             f"{mesh.shape} {mesh.mesh} dims {mesh.dim_names}, placements "
             f"[{', '.join(_fmt_placement(p) for p in placements)}]"]

    pieces = {}  # rank -> (coord, slices)
    for r in mesh.process_ids:
        c = mesh.get_coord(r)
        pieces[r] = (c, local_slices(shape, attr, c))
    marker = ""
    if attr.partial:
        kinds = sorted({red.value for _, red in attr.partial})
        marker = " " + "/".join(f"P({k})" for k in kinds)
        for m, red in attr.partial:
            lines.append(f"Partial({red.value}) on mesh dim {m} ({mesh.dim_names[m]}): the ranks "
                         f"along it hold addends whose {red.value} is the value")

    if len(shape) in (1, 2):
        # Per tensor dim the index ranges of all pieces partition it, so the blocks form a grid.
        ranges = [sorted({(sl[d].start, sl[d].stop) for _, sl in pieces.values()})
                  for d in range(len(shape))]
        rows = ranges[0] if len(shape) == 2 else [(0, 1)]
        cols = ranges[-1]

        def holders(ri, ci):
            out = []
            for r, (_, sl) in pieces.items():
                if len(shape) == 2 and (sl[0].start, sl[0].stop) != ri:
                    continue
                if (sl[-1].start, sl[-1].stop) == ci:
                    out.append(r)
            return out

        header = [""] + [f"[{a}:{b}]" if len(shape) == 1 else f"cols {a}:{b}" for a, b in cols]
        body = []
        for ri in rows:
            label = "" if len(shape) == 1 else f"rows {ri[0]}:{ri[1]}"
            cells = []
            for ci in cols:
                rs = holders(ri, ci)
                cells.append(("ranks " + ",".join(map(str, rs)) if rs else "-") + marker)
            body.append([label] + cells)
        if len(shape) == 1:
            header, body = header[1:], [b[1:] for b in body]
        lines.append("blocks (global index ranges -> ranks holding them):")
        lines += _table(header, body)
    elif len(shape) == 0:
        lines.append("0-d tensor: every rank holds the scalar"
                     + (marker and f" ({marker.strip()} addends)"))

    header = ["rank", "coord", "global ranges", "local shape", "bytes"]
    body = []
    for r, (c, sl) in pieces.items():
        lshape = tuple(s.stop - s.start for s in sl)
        nbytes = int(np.prod(lshape, dtype=np.int64)) * itemsize
        body.append([str(r), str(list(c)), "[" + ", ".join(_rng(s) for s in sl) + "]",
                     str(list(lshape)), str(nbytes) + marker])
    lines.append("per rank:")
    lines += _table(header, body)
    text = "\n".join(lines)
    if print_ and get_rank() == 0:
        print(text, flush=True)
    return text
