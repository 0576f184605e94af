"""Which CPUs, memory, GPUs, MIG instances, FPGAs and devices a slot gets. Pure: no I/O.

``plan(topology, allocated, request, options)`` returns an :class:`Assignment` or raises
PlacementError saying what was asked, what is free and where. ``Allocated`` is the caller's ledger
of what slots hold (``add``/``remove`` return new ledgers). docs/placement.md explains the choices;
in short:

- guaranteed slots get exclusive CPUs from one NUMA node when they fit (best fit: the node, then
  the L3 cache, that leaves the least free behind, avoiding nodes whose devices the slot does not
  use), else from the fewest, nearest nodes (whole nodes first), or spread evenly in whole cores
  with ``distribute_across_numa``; inside a node, whole free cores come before single threads,
  and single threads come from partly used cores before a free core is split;
- burstable and best-effort slots get a CPU quota on the shared pool (neither reserved, isolated
  nor exclusive), within an overcommit ratio per class; exclusive slots may not shrink the pool
  below the quota burstable slots were promised;
- memory is accounted per NUMA node and bound to the slot's nodes unless its policy is ``none``;
- devices (whole GPUs, MIG instances by profile, GPU shares, FPGAs) come from the slot's nodes.

The modules, one concept each: ``options`` (PlacementOptions), ``assignment`` (what a slot is
given), ``bitset`` (CPU sets as ints), ``index`` (per-topology tables), ``ledger`` (Allocated and
what it leaves free), ``cores`` (which cores of one node), ``planner`` (the decision),
``shortfall`` (what a request needs, and the words of a refusal) and ``capacity`` (reports and
``count_fits``). Placement imports nothing from ``nodeagent.agent``: it
depends on the topology data types, the request types and the error hierarchy only.

Speed: a :class:`PlacementIndex` is built once per Topology object and CPU sets are ints used as
bitsets. What a ledger leaves free per node (free cores, pool CPUs, nodes without devices sorted
by free CPUs, free devices) is a view kept on the ledger; ``add``/``remove`` hand it to the new
ledger with only the touched nodes recomputed. A decision therefore looks at the nodes that hold
devices and at a handful of others, not at every node or CPU: a few tens of microseconds whether
the host has 16 CPUs or 1024 (bench/placement.py).
"""

from nodeagent.placement.assignment import Assignment, DeviceAssignment, GpuShare, MigAssignment, mig_key
from nodeagent.placement.capacity import Capacity, ResourceCapacity, capacity, count_fits
from nodeagent.placement.index import UNKNOWN_MEMORY, PlacementIndex, placement_index
from nodeagent.placement.ledger import Allocated
from nodeagent.placement.options import PlacementOptions
from nodeagent.placement.planner import plan

__all__ = [
    "UNKNOWN_MEMORY",
    "Allocated",
    "Assignment",
    "Capacity",
    "DeviceAssignment",
    "GpuShare",
    "MigAssignment",
    "PlacementIndex",
    "PlacementOptions",
    "ResourceCapacity",
    "capacity",
    "count_fits",
    "mig_key",
    "placement_index",
    "plan",
]
