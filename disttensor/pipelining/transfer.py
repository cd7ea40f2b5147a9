"""Point-to-point hand-over of a distributed tensor's pieces between pipeline stages.

The rank at coordinate c of stage s's sub-mesh sends its local piece to the rank at the same
coordinate of stage t's sub-mesh (both sub-meshes have one shape, so the pieces match and the
layout, Partial included, carries over unchanged). Each message is a fixed-size header (global
shape, layout, piece shape and dtype, and an integer note for the receiver) then the piece,
both on one tag: MPI keeps the order of
messages of one (sender, tag). Sends are nonblocking (their waits deferred to the end of the
step) and receives blocking, so stages running different action orders cannot deadlock.
"""
from __future__ import annotations

import pickle

import numpy as np

from spmd_rules import ProcessMesh

from ..layout.dist_tensor import DistTensor
from ..layout.mesh_groups import world
from ..tensor import DenseTensor, Tensor

__all__ = ["send_tensor", "recv_tensor", "TAG_BASE"]

HEADER = 1024     # bytes of a message header
TAG_BASE = 4096   # pipeline tags sit above the runtime's own point-to-point tags


def send_tensor(t: Tensor, dst: int, tag: int, note: int = 0) -> list:
    """Start sending this rank's piece of distributed ``t`` (and the int ``note``) to global
    rank ``dst``; the handles to wait on."""
    v = t._value
    piece = v.local.array
    meta = pickle.dumps((tuple(v.shape), v.dist_attr, tuple(piece.shape), piece.dtype.str,
                         int(note)))
    if len(meta) + 4 > HEADER:
        raise ValueError(f"pipeline send: the layout of a {list(v.shape)} tensor does not fit "
                         f"the {HEADER}-byte header")
    head = np.zeros(HEADER, dtype=np.uint8)
    head[:4] = np.frombuffer(np.uint32(len(meta)).tobytes(), dtype=np.uint8)
    head[4:4 + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
    group = world()
    return [group.isend(head, dst, tag), group.isend(piece, dst, tag)]


def recv_tensor(mesh: ProcessMesh, src: int, tag: int, like=None) -> tuple[Tensor, int]:
    """Receive a piece from global rank ``src`` as a distributed leaf on ``mesh`` that wants a
    gradient (``stop_gradient=False``), with the sender's note."""
    group = world()
    head = group.recv((HEADER,), np.uint8, src, tag)
    n = int(np.frombuffer(head[:4].tobytes(), dtype=np.uint32)[0])
    shape, attr, piece_shape, dtype, note = pickle.loads(head[4:4 + n].tobytes())
    piece = group.recv(piece_shape, np.dtype(dtype), src, tag, like=like)
    return Tensor(DistTensor(DenseTensor(piece), mesh, attr, shape), stop_gradient=False), note
