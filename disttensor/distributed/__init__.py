"""The distributed user API: the entry points that plan themselves (``api``: ``shard_tensor``,
``reshard``, ``dtensor_from_local``, ...), rank agreement (``agreement``), ``cache_info``
(``caches``) and ``visualize``. They sit above the seam and ``ops``; the layout machinery they
use (DistTensor, process groups per mesh, reshard execution, the planner) is
:mod:`disttensor.layout`, below the seam.

The entry points are exported by :mod:`disttensor` itself (``dt.shard_tensor``, ...); this
package keeps no imports of its own."""
