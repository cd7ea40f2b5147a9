"""The piece sizes reshard's gathers and all-to-alls are prepared with, in one process, against
``numpy.array_split`` (nested for co-sharded dims): a wrong uneven size fails here as a value
mismatch instead of hanging a job in a collective whose ranks disagree on counts."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from disttensor.layout.reshard import _extent, _sizes
from spmd_rules import DistAttr


def _np_piece(n: int, splits: list[tuple[int, int]]) -> np.ndarray:
    """The indices of a dim of size ``n`` a coordinate holds: ``numpy.array_split`` into
    ``parts`` pieces taking piece ``c``, for each (parts, c) in split order."""
    idx = np.arange(n)
    for parts, c in splits:
        idx = np.array_split(idx, parts)[c]
    return idx


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7])
def test_piece_sizes_are_numpy_array_split(parts):
    for total in range(0, 3 * parts + 2):
        want = [len(p) for p in np.array_split(np.arange(total), parts)]
        assert _sizes(total, parts) == want, (total, parts)


MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (4, 3)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_local_extents_and_gather_sizes_are_nested_array_splits(mesh):
    """Every dims mapping of a 2-d tensor of uneven sizes (co-sharded in both split orders),
    every coordinate: the local extent of each dim, and the sizes a gather over the innermost
    mesh dim of a dim receives (those of its siblings), against nested numpy.array_split."""
    shapes = [(0, 5), (1, 7), (5, 3), (7, 11), (13, 2)]
    mesh_dims = range(len(mesh))
    mappings = []
    for d0 in itertools.chain.from_iterable(itertools.permutations(mesh_dims, k)
                                            for k in range(len(mesh) + 1)):
        rest = [m for m in mesh_dims if m not in d0]
        for k in range(len(rest) + 1):
            for d1 in itertools.permutations(rest, k):
                mappings.append((tuple(d0), tuple(d1)))
    checked = 0
    for shape in shapes:
        for dm in mappings:
            attr = DistAttr(mesh, dm)
            for coord in itertools.product(*(range(n) for n in mesh)):
                for d in range(2):
                    splits = [(mesh[m], coord[m]) for m in dm[d]]
                    piece = _np_piece(shape[d], splits)
                    assert _extent(shape, attr, coord, d) == len(piece), (shape, dm, coord, d)
                    if not dm[d]:
                        continue
                    m = dm[d][-1]  # the innermost split: what a gather over m undoes
                    parent = _np_piece(shape[d], splits[:-1])
                    assert _extent(shape, attr, coord, d, without=m) == len(parent)
                    siblings = [len(_np_piece(shape[d], splits[:-1] + [(mesh[m], c)]))
                                for c in range(mesh[m])]
                    assert _sizes(len(parent), mesh[m]) == siblings, (shape, dm, coord, d)
                    checked += 1
    assert checked > 0
