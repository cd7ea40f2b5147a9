"""Sizes of the runtime's caches, for debugging and for the tests that keep them flat.

Every cache keys on values (meshes and layouts are interned: equal values are one key) and is
bounded: the plan caches and the agreement cache are LRUs; the intern tables and the process
groups grow only with distinct meshes, layouts and rank sets."""
from __future__ import annotations

import collectives

from ..dispatch import PLAN_CACHE_LIMIT, plan_cache_info
from ..layout import dist_tensor, mesh_groups, reshard
from . import agreement, api

__all__ = ["cache_info"]


def cache_info() -> dict[str, int]:
    """Number of entries in each cache (``limit_*``: the bounds of the LRUs)."""
    return {
        "plans": plan_cache_info()["size"],
        "limit_plans": PLAN_CACHE_LIMIT,
        "reshard_plans": len(api._RESHARD_PLANS),
        "reshard_calls": len(api._RESHARD_CALLS),
        "prepared_reshards": reshard.prepare.cache_info().currsize,
        "layouts_of_placements": api._layout_of.cache_info().currsize,
        "agreed_fingerprints": agreement.agreement_cache_info()["size"],
        "limit_agreed_fingerprints": agreement.CACHE_LIMIT,
        "coords": mesh_groups._coord.cache_info().currsize,
        "groups_along": mesh_groups.group_along.cache_info().currsize,
        "groups_over": mesh_groups.group_over.cache_info().currsize,
        "process_groups": len(collectives._groups),
        "interned_meshes": len(dist_tensor._MESHES),
        "interned_layouts": len(dist_tensor._CANON),
    }
