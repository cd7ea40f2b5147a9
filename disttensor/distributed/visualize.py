"""``visualize_sharding(x)``: a text picture of which rank holds which block of a distributed
tensor. Metadata only (global shape, mesh, DistAttr): nothing is communicated, so any rank can
call it, members of the mesh or not, and every rank gets the same text."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spmd_rules import DistAttr, local_ranges, local_slices

from ..layout.mesh_groups import get_rank
from ..tensor import Tensor

__all__ = ["visualize_sharding"]


def _fmt_placement(p) -> str:
    if p.is_shard():
        extra = "" if p.shard_order is None else f", order {p.shard_order}"
        extra += "" if p.split_factor == 1 else f", split factor {p.split_factor}"
        return f"S({p.dim}{extra})"
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


def _rng(ranges: tuple) -> str:
    return "+".join(f"{a}:{b}" for a, b in ranges) if ranges else "-"


def _pieces(shape, attr: DistAttr, coord) -> tuple:
    """Per tensor dim the global ranges held at ``coord``: one (possibly empty) slice, or a
    strided dim's ranges in local order."""
    plain = local_slices(shape, attr.without_split_factors(), coord)
    strided = local_ranges(shape, attr, coord)
    return tuple(strided[d] if attr.is_strided(d) else ((sl.start, sl.stop),)
                 for d, sl in enumerate(plain))


def visualize_sharding(x, print_: bool = True) -> str:
    """Return (and, with ``print_``, print on rank 0) a picture of ``x``'s layout.

    For 1-d and 2-d tensors a grid of blocks: each cell gives the global index ranges of the
    block and the ranks holding it (``P(sum)`` etc. marks blocks whose ranks hold addends of a
    Partial value rather than copies). Every tensor, whatever its rank, also gets a per-rank table:
    mesh coordinate, global index ranges, local shape and bytes. A strided shard
    (``Shard(d, split_factor=k)``) holds several ranges of dim d, joined by ``+``; its grid
    has one block per range."""
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
        pieces[r] = (c, _pieces(shape, attr, c))
    marker = ""
    if attr.partial:
        kinds = sorted({red.value for _, red in attr.partial})
        marker = " " + "/".join(f"P({k})" for k in kinds)
        for m, red in attr.partial:
            lines.append(f"Partial({red.value}) on mesh dim {m} ({mesh.dim_names[m]}): the ranks "
                         f"along it hold addends whose {red.value} is the value")

    if len(shape) in (1, 2):
        # Per tensor dim the index ranges of all pieces partition it, so the blocks form a grid.
        ranges = [sorted({rg for _, sl in pieces.values() for rg in sl[d]})
                  for d in range(len(shape))]
        rows = ranges[0] if len(shape) == 2 else [(0, 1)]
        cols = ranges[-1]

        def holders(ri, ci):
            out = []
            for r, (_, sl) in pieces.items():
                if len(shape) == 2 and ri not in sl[0]:
                    continue
                if ci in sl[-1]:
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
        lshape = tuple(sum(b - a for a, b in rs) for rs in sl)
        nbytes = int(np.prod(lshape, dtype=np.int64)) * itemsize
        body.append([str(r), str(list(c)), "[" + ", ".join(_rng(rs) for rs in sl) + "]",
                     str(list(lshape)), str(nbytes) + marker])
    lines.append("per rank:")
    lines += _table(header, body)
    text = "\n".join(lines)
    if print_ and get_rank() == 0:
        print(text, flush=True)
    return text
