"""The layout machinery below the seam: distributed tensors (dist_tensor), process groups per
mesh (mesh_groups), reshard execution (reshard) and planning a call from its rule (planner)."""
