"""PyTorch's Distributed Checkpoint names (``torch.distributed.checkpoint.save`` / ``load``)
over the same checkpoint format as :func:`save_state_dict` / :func:`load_state_dict`."""
from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from .state_dict import load_state_dict, save_state_dict

__all__ = ["save", "load"]


def _check_id(fn: str, checkpoint_id: object) -> None:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"{fn}: checkpoint_id must be a directory path (str or PathLike), got "
                        f"{type(checkpoint_id).__name__}")


def save(state_dict: Mapping, checkpoint_id: str | os.PathLike) -> None:
    """Save ``state_dict`` to the checkpoint directory ``checkpoint_id``; every rank calls it.
    PyTorch's ``dcp.save``; the same as :func:`save_state_dict`.

    Example::

        dt.checkpoint.save({"model": model.state_dict()}, checkpoint_id="ckpt/step_100")
    """
    _check_id("checkpoint.save", checkpoint_id)
    save_state_dict(state_dict, checkpoint_id)


def load(state_dict: MutableMapping, checkpoint_id: str | os.PathLike) -> None:
    """Load the checkpoint ``checkpoint_id`` into ``state_dict`` in place, resharding into each
    target's layout; every rank calls it. PyTorch's ``dcp.load``; the same as
    :func:`load_state_dict` (entries of the checkpoint the state dict lacks are ignored; a
    target the checkpoint lacks raises on every rank).

    Example::

        state = {"model": model.state_dict()}
        dt.checkpoint.load(state, checkpoint_id="ckpt/step_100")
    """
    _check_id("checkpoint.load", checkpoint_id)
    load_state_dict(state_dict, checkpoint_id)
