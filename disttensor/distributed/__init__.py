"""The distributed layer: DistTensor, process groups per mesh dim, reshard execution, the
planner of calls with distributed inputs, the entry points (``api``) and ``visualize``.

The entry points are exported by :mod:`disttensor` itself (``dt.shard_tensor``, ...); this
package keeps no imports of its own so the dispatcher can import the planner without a cycle."""
