"""Capacity reports: what the host has and what is left, and how many more slots of a shape fit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.devices.topology import Topology
from nodeagent.errors import PlacementError
from nodeagent.placement.assignment import mig_key
from nodeagent.placement.index import PlacementIndex, UsableCpus, placement_index
from nodeagent.placement.ledger import Allocated
from nodeagent.placement.options import PlacementOptions
from nodeagent.placement.planner import plan
from nodeagent.schema.request import MILLI, QOS_CLASSES, SlotRequest, parse_slot_request


@dataclass(frozen=True, slots=True)
class ResourceCapacity:
    total: int | float
    reserved: int | float
    allocatable: int | float
    allocated: int | float
    free: int | float

    def to_dict(self) -> dict[str, int | float]:
        return {
            "total": self.total,
            "reserved": self.reserved,
            "allocatable": self.allocatable,
            "allocated": self.allocated,
            "free": self.free,
        }


@dataclass(frozen=True)
class Capacity:
    """Totals, reserved, allocatable, allocated and free per resource, host-wide and per NUMA node,
    and what each QoS class holds.

    Host-wide memory counts every slot's memory, bound to a node or not: what placement checks a
    request against. Per node, only memory bound to that node is counted (unbound memory has no
    node); ``resources.memory_bytes.allocated`` is their sum plus the unbound memory.
    """

    resources: Mapping[str, ResourceCapacity]
    by_numa: Mapping[int, Mapping[str, ResourceCapacity]]
    shared_pool: Mapping[str, int | float]
    #: QoS class -> {"slots", "cpus" (exclusive CPUs or shared-pool quota), "memory_bytes"}
    by_qos: Mapping[str, Mapping[str, int | float]]
    #: NUMA node -> MIG profile -> instances of GPUs on that node (instances of GPUs without a
    #: known node are in ``resources`` only). Typed callers only (agent/nrt.py): not in ``to_dict``.
    mig_by_numa: Mapping[int, Mapping[str, ResourceCapacity]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "resources": {k: v.to_dict() for k, v in self.resources.items()},
            "by_numa": {str(n): {k: v.to_dict() for k, v in r.items()} for n, r in self.by_numa.items()},
            "shared_pool": dict(self.shared_pool),
            "by_qos": {k: dict(v) for k, v in self.by_qos.items()},
        }


def capacity(topology: Topology, allocated: Allocated, options: PlacementOptions | None = None) -> Capacity:
    """What the host has and what is left, as the controller wants it reported."""
    opts = options or PlacementOptions()
    index = placement_index(topology)
    usable = index.usable(opts)
    by_numa: dict[int, dict[str, ResourceCapacity]] = {}
    for node in index.node_ids:
        by_numa[node] = _node_capacity(topology, index, usable, allocated, node)
    resources = {
        kind: _sum_capacity([by_numa[n][kind] for n in index.node_ids])
        for kind in ("cpus", "memory_bytes", "gpus", "fpgas")
    }
    floating = _node_capacity(topology, index, usable, allocated, None)
    for kind in ("gpus", "fpgas"):
        resources[kind] = _sum_capacity([resources[kind], floating[kind]])
    memory = resources["memory_bytes"]
    held = memory.allocated + allocated.memory_unbound
    resources["memory_bytes"] = ResourceCapacity(
        memory.total, memory.reserved, memory.allocatable, held, max(0, memory.allocatable - held)
    )
    by_qos: dict[str, dict[str, int | float]] = {}
    for qos in QOS_CLASSES:
        cpus: int | float = (
            len(allocated.cpus) if qos == "guaranteed" else allocated.quota_millis.get(qos, 0) / MILLI
        )
        by_qos[qos] = {
            "slots": allocated.slots_by_qos.get(qos, 0),
            "cpus": cpus,
            "memory_bytes": allocated.memory_by_qos.get(qos, 0),
        }
    pool = usable.pool_base & ~allocated.cpu_mask
    pool_cpus = pool.bit_count()
    shared_pool: dict[str, int | float] = {
        "cpus": pool_cpus,
        "burstable_quota": allocated.quota_millis.get("burstable", 0) / MILLI,
        "burstable_capacity": pool_cpus * opts.burstable_overcommit,
        "best_effort_quota": allocated.quota_millis.get("best-effort", 0) / MILLI,
        "best_effort_capacity": pool_cpus * opts.best_effort_overcommit,
    }
    # profile -> NUMA node (None: unknown) -> [instances, free instances]
    mig: dict[str, dict[int | None, list[int]]] = {}
    for g in topology.gpus:
        if g.mig is None or not g.mig.enabled or g.healthy is False:
            continue
        for inst in g.mig.instances:
            held = (
                mig_key(g.index, inst.uuid, inst.gpu_instance_id, inst.compute_instance_id) in allocated.mig
            )
            counts = mig.setdefault(inst.profile, {}).setdefault(g.numa, [0, 0])
            counts[0] += 1
            counts[1] += not held
    mig_by_numa: dict[int, dict[str, ResourceCapacity]] = {}
    for profile, nodes in sorted(mig.items()):
        total = sum(c[0] for c in nodes.values())
        free = sum(c[1] for c in nodes.values())
        resources[f"mig/{profile}"] = ResourceCapacity(total, 0, total, total - free, free)
        for numa, (count, node_free) in nodes.items():
            if numa is not None:
                mig_by_numa.setdefault(numa, {})[profile] = ResourceCapacity(
                    count, 0, count, count - node_free, node_free
                )
    return Capacity(
        resources=resources, by_numa=by_numa, shared_pool=shared_pool, by_qos=by_qos, mig_by_numa=mig_by_numa
    )


def _node_capacity(
    topo: Topology, index: PlacementIndex, usable: UsableCpus, alloc: Allocated, node: int | None
) -> dict[str, ResourceCapacity]:
    out: dict[str, ResourceCapacity] = {}
    if node is not None:
        node_mask = index.node_mask[node]
        total = node_mask.bit_count()
        reserved = (usable.reserved & node_mask).bit_count()
        allocatable = (usable.exclusive_cpus & node_mask).bit_count()
        held = (alloc.cpu_mask & node_mask).bit_count()
        out["cpus"] = ResourceCapacity(total, reserved, allocatable, held, allocatable - held)
        mem = index.node_memory[node]
        mem_held = alloc.memory_by_node.get(node, 0)
        out["memory_bytes"] = ResourceCapacity(mem, 0, mem, mem_held, max(0, mem - mem_held))
    gpus = [g for g in topo.gpus if g.numa == node]
    good = [g for g in gpus if g.healthy is not False and not (g.mig is not None and g.mig.enabled)]
    gpu_held = sum(g.index in alloc.gpus or g.index in alloc.gpu_shares for g in good)
    out["gpus"] = ResourceCapacity(
        len(gpus), len(gpus) - len(good), len(good), gpu_held, len(good) - gpu_held
    )
    fpgas = [f for f in topo.fpgas if f.numa == node]
    good_f = [f for f in fpgas if f.healthy is not False]
    f_held = sum(f.id in alloc.fpgas for f in good_f)
    out["fpgas"] = ResourceCapacity(
        len(fpgas), len(fpgas) - len(good_f), len(good_f), f_held, len(good_f) - f_held
    )
    return out


def _sum_capacity(items: Sequence[ResourceCapacity]) -> ResourceCapacity:
    return ResourceCapacity(
        total=sum(i.total for i in items),
        reserved=sum(i.reserved for i in items),
        allocatable=sum(i.allocatable for i in items),
        allocated=sum(i.allocated for i in items),
        free=sum(i.free for i in items),
    )


def count_fits(
    topology: Topology,
    allocated: Allocated,
    request_shape: SlotRequest | Mapping[str, Any],
    options: PlacementOptions | None = None,
    *,
    limit: int = 4096,
) -> int:
    """How many more slots of this shape fit, placing them one after another as ``plan`` would.

    Each placement costs about one decision: the ledgers it makes hand their per-node views on.
    """
    shape = (
        request_shape if isinstance(request_shape, SlotRequest) else parse_slot_request(dict(request_shape))
    )
    shape = shape.model_copy(update={"name": "fit"})  # the name only words reasons and refusals
    planner_options = options or PlacementOptions()
    ledger = allocated
    for count in range(limit):
        try:
            a = plan(topology, ledger, shape, planner_options)
        except PlacementError:
            return count
        ledger = ledger.add(a)
    return limit
