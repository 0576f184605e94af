"""Between the layers: a slot's typed record turned into what isolation and the runtime need, and
back from what the kernel shows when the database lost it.

Only the agent knows both sides (placement's Assignment, the request), so the translation lives
here; isolation and the runtime receive their own types (:class:`SlotIsolationSpec`,
:class:`SlotDescription`) and never see a request or an assignment.
"""

from __future__ import annotations

from nodeagent.agent.recovery import recovered_name
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.cpulist import shared_ids
from nodeagent.devices.topology import Topology
from nodeagent.errors import InvalidRequest
from nodeagent.isolation.backend import OwnedSlot
from nodeagent.isolation.devices import assigned_device_nodes
from nodeagent.isolation.slot_spec import AllowedHostPort, SlotIsolationSpec, SlotNetworkSpec
from nodeagent.placement import Assignment
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.worker_kind import slot_kind
from nodeagent.schema.request import parse_slot_request


def isolation_spec(slot: Slot, topology: Topology) -> SlotIsolationSpec:
    """What isolation must build for ``slot``: its assignment, devices resolved to their nodes under /dev."""
    a = assignment_of(slot)
    res = slot.request.resources
    quota = a.cpu_quota_millis / 1000 if slot.qos == "burstable" and a.cpu_quota_millis else None
    devices = assigned_device_nodes(
        topology,
        gpus=(*a.gpus, *(share.gpu_index for share in a.gpu_shares)),
        mig=[(m.gpu_index, m.gpu_instance_id, m.compute_instance_id) for m in a.mig],
        fpgas=a.fpgas,
        named=[d.path for d in a.devices],
    )
    return SlotIsolationSpec(
        slot_id=slot.id,
        qos=slot.request.qos,
        cpus=shared_ids(a.cpus),
        exclusive=a.exclusive,
        mems=shared_ids(a.numa_nodes) if a.memory_by_node else None,
        cpu_quota=quota,
        memory_bytes=a.memory_bytes or None,
        device_paths=devices,
        gpu=bool(a.gpus or a.mig or a.gpu_shares),
        network=None
        if res.network is None
        else SlotNetworkSpec(
            res.network.bandwidth_mbit,
            res.network.egress,
            tuple(AllowedHostPort(p.port, p.protocol) for p in res.network.host_ports),
        ),
        l3=res.l3_share,
        # Fixed at allocate (runtime/worker_kind.py): every resize and start gives the same answer.
        containers=slot_kind(slot.request).needs_container_runtime,
        background=slot.pool is not None,
    )


def slot_description(slot: Slot, shared_pool: frozenset[int]) -> SlotDescription:
    """The slot as its worker sees it (the slot file and the thread-count environment)."""
    a = assignment_of(slot)
    network = slot.network
    return SlotDescription(
        slot_id=slot.id,
        cpus=a.cpus if a.exclusive else tuple(sorted(shared_pool)),
        numa_nodes=a.numa_nodes,
        memory_bytes=a.memory_bytes or None,
        gpus=tuple(u if u is not None else str(i) for i, u in zip(a.gpus, a.gpu_uuids, strict=False)),
        devices=tuple(d.path for d in a.devices),
        addresses=() if network is None else (str(network.slot_address),),
        cpu_quota=None if a.exclusive else a.cpu_quota_millis / 1000,
    )


def slot_from_kernel(owned: OwnedSlot) -> Slot:
    """A slot rebuilt from nothing but its cgroup: its QoS class and CPUs (the rest is unknown)."""
    name = recovered_name(owned.slot_id)
    guaranteed = owned.qos == "guaranteed"
    cpus = tuple(sorted(owned.applied.cpus))
    request = parse_slot_request(
        {"name": name, "qos": owned.qos, "resources": {"cpus": len(cpus) if guaranteed else 0}}
    )
    assignment = Assignment(
        name=name,
        qos=owned.qos,
        cpus=cpus,
        exclusive=guaranteed,
        cpu_quota_millis=0,
        numa_nodes=tuple(sorted(owned.applied.mems or ())),
        memory_bytes=0,
        memory_by_node={},
        reasons=("rebuilt from its cgroup after the state database lost it",),
    )
    return Slot(
        id=owned.slot_id,
        name=name,
        state=SlotState.READY,
        request=request,
        assignment=assignment,
        applied=owned.applied,
    )


def assignment_of(slot: Slot) -> Assignment:
    if slot.assignment is None:
        raise InvalidRequest(f"slot {slot.id} has no assignment")
    return slot.assignment


__all__ = ["assignment_of", "isolation_spec", "slot_description", "slot_from_kernel"]
