"""Containers placed through containerd's NRI: each container the kubelet creates becomes a slot.

The NRI shim (kube/nri-shim) forwards the runtime's events; every decision is made here:

- :func:`slot_request` turns a container (its pod's QoS class, the Linux resources the kubelet set,
  the pod's ``nodeagent.io/`` annotations) into a :class:`SlotRequest` of the agent's own planner:
  a Guaranteed container with whole CPUs (quota a multiple of the period) gets a guaranteed slot of
  exclusive cores; a fractional Guaranteed or a Burstable one with a memory limit gets a burstable
  slot; a BestEffort one (and a Burstable one without a memory limit, which a burstable slot
  cannot express) gets a best-effort slot. Unknown ``nodeagent.io/`` keys are refused.
- :class:`NriContainers` allocates, releases and synchronizes those slots through the slot
  service (the one sequencer, so REST slots and containers share one ledger) and answers the
  adjustment the runtime applies (:func:`adjustment`).

A container's slot is named ``nri-`` and its container id (:func:`slot_name`), so the name is the
idempotency key: a repeated CreateContainer gets the same slot, a Synchronize after an agent or
containerd restart finds it again, and the slot list shows which slots hold containers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodeagent.agent.service import SlotService
from nodeagent.agent.slot import Slot
from nodeagent.cpulist import format_cpulist
from nodeagent.devices.topology import Topology
from nodeagent.errors import InvalidRequest, NodeAgentError, NotFound
from nodeagent.schema.nri_messages import NriAdjustment, NriContainer, NriSyncResult, NriUpdate, NriUpdates
from nodeagent.schema.quantity import MILLI
from nodeagent.schema.request import NAME_PATTERN, QoS, SlotRequest, parse_slot_request

log = logging.getLogger(__name__)

#: Slots made for containers are named this and the container id; REST clients may not use it
#: while NRI is on (the agent would take their slot for a container that is gone).
SLOT_PREFIX = "nri-"
ANNOTATION_PREFIX = "nodeagent.io/"
#: containerd's container ids: random, so their first 59 digits tell them apart.
HEX_ID = re.compile(r"[0-9a-f]{64}")
#: The kernel's CFS period when the kubelet sets none (100 ms).
DEFAULT_PERIOD_US = 100_000
#: cpu.shares per CPU, as the kubelet converts requests (1 CPU = 1024 shares).
SHARES_PER_CPU = 1024

_KUBELET_CLASSES: dict[str, QoS] = {
    "guaranteed": "guaranteed",
    "burstable": "burstable",
    "besteffort": "best-effort",
    "best-effort": "best-effort",
}


def slot_name(container_id: str) -> str:
    """``nri-`` and the container id (containerd's are 64 hex digits: the first 59 are kept, far
    more than any two ids share); an id that is no safe slot name is hashed."""
    room = 63 - len(SLOT_PREFIX)
    safe = NAME_PATTERN.fullmatch(container_id[:room]) is not None
    if safe and (len(container_id) <= room or HEX_ID.fullmatch(container_id)):
        return SLOT_PREFIX + container_id[:room]
    return SLOT_PREFIX + hashlib.sha256(container_id.encode()).hexdigest()[:room]


def is_container_slot(slot: Slot) -> bool:
    return slot.name.startswith(SLOT_PREFIX)


def pod_class(container: NriContainer) -> QoS | None:
    """The kubelet's QoS class: as the shim sent it, else from the pod's cgroup parent (the kubelet
    puts Burstable pods under ``burstable``, BestEffort under ``besteffort``, Guaranteed directly
    under ``kubepods``); None when neither says."""
    given = container.pod.qos_class.strip().lower()
    if given:
        if given not in _KUBELET_CLASSES:
            raise InvalidRequest(
                f"pod.qos_class is {container.pod.qos_class!r}; expected Guaranteed, Burstable or BestEffort"
            )
        return _KUBELET_CLASSES[given]
    parent = container.pod.cgroup_parent.lower()
    if "besteffort" in parent:
        return "best-effort"
    if "burstable" in parent:
        return "burstable"
    if "kubepods" in parent:
        return "guaranteed"
    return None


def _annotations(container: NriContainer) -> dict[str, str]:
    """The pod's ``nodeagent.io/`` annotations, checked: unknown keys are refused, not ignored."""
    ours = {k: v for k, v in container.pod.annotations.items() if k.startswith(ANNOTATION_PREFIX)}
    unknown = sorted(k for k in ours if k.removeprefix(ANNOTATION_PREFIX) not in KNOWN_ANNOTATIONS)
    if unknown:
        raise InvalidRequest(
            f"pod {_pod(container)} has annotation(s) {', '.join(unknown)} that the agent does not know; "
            f"known: {', '.join(ANNOTATION_PREFIX + k for k in KNOWN_ANNOTATIONS)}. Fix the spelling or "
            "remove them"
        )
    return ours


#: nodeagent.io/<key> -> what it sets in the slot request, and how its value is read.
KNOWN_ANNOTATIONS: dict[str, str] = {
    "numa": "resources.numa: single, prefer or none",
    "l3": "resources.l3: a share of the L3 cache above 0 and at most 1",
    "priority": "priority of a best-effort slot, 0 to 1000",
}


def _pod(container: NriContainer) -> str:
    pod = container.pod
    return f"{pod.namespace or '?'}/{pod.name or pod.uid or '?'}"


def _cpu_millis(quota: int, period: int) -> int:
    """CPUs of a CFS quota in thousandths, rounded up (never less than the quota allows)."""
    period = period or DEFAULT_PERIOD_US
    return -(-quota * MILLI // period)


#: A device node by what the kernel knows it as: type ("c" or "b"), major, minor.
DeviceNumber = tuple[str, int, int]


def managed_devices(paths: Iterable[str]) -> dict[DeviceNumber, str]:
    """The agent's allowed devices (``[placement] allowed_devices``) by device number, as they are
    on the host now (one that is missing or not a device node is left out)."""
    found: dict[DeviceNumber, str] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
            found[(kind, os.major(st.st_rdev), os.minor(st.st_rdev))] = path
    return found


def container_devices(container: NriContainer, managed: Mapping[DeviceNumber, str]) -> tuple[str, ...]:
    """The agent's devices among those the runtime gives the container (the kubelet's device
    plugin answered them, or CDI injected them), as the allow-list names them: the slot holds them,
    so the ledger, its NUMA placement and NodeResourceTopology count them. Matched by number, since
    the path inside the container may differ from the host's."""
    held = [managed.get((d.type, d.major, d.minor)) for d in container.devices]
    return tuple(dict.fromkeys(path for path in held if path is not None))


def pods_cgroups_problems(pods_cgroups: Sequence[str], roots: Sequence[Path]) -> tuple[str, ...]:
    """With host partitioning on: a problem when none of ``[kubernetes] pods_cgroups`` is under any
    of the cgroup ``roots`` (the kubelet's pods would be confined as the host's, and on cgroup v2
    its Guaranteed containers moved off their exclusive CPUs). Asked each time the node is read:
    a kubelet that starts after the agent makes it go away."""
    if any((root / path.strip("/")).is_dir() for root in roots for path in pods_cgroups):
        return ()
    return (
        f"none of [kubernetes] pods_cgroups ({', '.join(pods_cgroups)}) is a cgroup here: host "
        "partitioning would confine the kubelet's pods with the rest of the host (on cgroup v2 their "
        "Guaranteed containers would lose their exclusive CPUs); set pods_cgroups to the kubelet's "
        "cgroup root followed by kubepods (kubepods.slice with the systemd driver), or start the kubelet",
    )


def slot_request(container: NriContainer, managed: Mapping[DeviceNumber, str] | None = None) -> SlotRequest:
    """The slot request for ``container`` (``managed``: the agent's devices by number, see
    :func:`container_devices`); InvalidRequest naming what cannot be expressed."""
    res = container.resources
    qos = pod_class(container)
    quota = res.cpu_quota if res.cpu_quota > 0 else 0
    period = res.cpu_period or DEFAULT_PERIOD_US
    memory = res.memory_limit if res.memory_limit > 0 else 0
    if qos is None:  # no class given: the limits say which one the kubelet would have chosen
        qos = "guaranteed" if quota and memory else "burstable" if quota or memory else "best-effort"
    resources: dict[str, Any] = {}
    if qos == "guaranteed" and quota and memory and quota % period == 0:
        resources = {"cpus": quota // period, "memory": memory}
    elif qos in ("guaranteed", "burstable") and memory:
        # Fractional Guaranteed, or Burstable: a quota on the shared pool. Without a CPU limit the
        # request (cpu.shares) is what the pod is sure of; the quota stays the kubelet's.
        millis = _cpu_millis(quota, period) if quota else res.cpu_shares * MILLI // SHARES_PER_CPU
        qos = "burstable"
        resources = {"cpus": f"{max(millis, 1)}m", "memory": memory}
    else:
        # BestEffort, or a Burstable container without a memory limit (a burstable slot needs one).
        qos = "best-effort"
        if quota:
            resources["cpus"] = f"{_cpu_millis(quota, period)}m"
        if memory:
            resources["memory"] = memory
    devices = container_devices(container, managed or {})
    if devices:
        resources["devices"] = list(devices)
    body: dict[str, Any] = {"name": slot_name(container.id), "qos": qos, "resources": resources}
    for annotation, value in _annotations(container).items():
        key = annotation.removeprefix(ANNOTATION_PREFIX)
        if key == "priority":
            try:
                body["priority"] = int(value)
            except ValueError:
                raise InvalidRequest(
                    f"annotation {ANNOTATION_PREFIX}priority is {value!r}; give a whole number 0 to 1000"
                ) from None
        elif key == "l3":
            try:
                resources["l3"] = float(value)
            except ValueError:
                raise InvalidRequest(
                    f"annotation {ANNOTATION_PREFIX}l3 is {value!r}; give a share such as 0.25"
                ) from None
        else:
            resources[key] = value
    try:
        return parse_slot_request(body)
    except InvalidRequest as err:
        raise InvalidRequest(
            f"container {container.name or container.id} of pod {_pod(container)}: {err}"
        ) from None


def shared_cpus(
    slot: Slot, pool: frozenset[int], topology: Topology
) -> tuple[frozenset[int], frozenset[int]]:
    """A shared slot's cpuset and mems: the pool, on the slot's NUMA nodes when its memory is bound
    to them (as the isolator narrows a shared slot's own cgroup); no mems when it is not bound."""
    a = slot.assignment
    if a is None or not a.memory_by_node:
        return pool, frozenset()
    nodes = frozenset(a.numa_nodes)
    on_nodes = pool & frozenset(c for n in topology.numa_nodes if n.id in nodes for c in n.cpus)
    return (on_nodes or pool), nodes


def adjustment(slot: Slot, pool: frozenset[int], topology: Topology) -> NriAdjustment:
    """What the runtime applies: exclusive CPUs and their NUMA nodes for a guaranteed slot, the
    shared pool (as it is now; :class:`NriContainers` moves it later) for a shared one, and the
    slot's memory limit."""
    a = slot.assignment
    exclusive = a is not None and a.exclusive and bool(a.cpus)
    if exclusive and a is not None:
        cpus, mems = frozenset(a.cpus), frozenset(a.numa_nodes)
    elif pool:
        cpus, mems = shared_cpus(slot, pool, topology)
    else:  # no shared CPU left at all: leave the kubelet's cpuset rather than ask for an empty one
        cpus, mems = frozenset(), frozenset()
    return NriAdjustment(
        container_id="",
        slot_id=slot.id,
        slot_name=slot.name,
        qos=slot.qos,
        cpuset_cpus=format_cpulist(cpus),
        cpuset_mems=format_cpulist(mems),
        memory_limit=slot.request.resources.memory_bytes,
    )


def pool_version(pool: frozenset[int]) -> str:
    """The name of a shared pool in GET /v1/nri/updates: its CPU list ("none" when empty)."""
    return format_cpulist(pool) or "none"


class NriContainers:
    """The NRI events, over the slot service.

    Besides placing each container, it keeps the shared containers' cpusets on the shared pool:
    the pool shrinks when a guaranteed slot takes exclusive CPUs and grows when one is released,
    from a container or through the REST API alike. A guaranteed container's own answer carries
    the other shared containers' new cpusets (applied before it starts); every other change
    reaches the shim through :meth:`updates`, which it long-polls. The container ids are kept in
    memory (a slot's name holds only the first 59 digits); Synchronize, which follows every
    registration of the shim and so every agent restart, fills them again.
    """

    def __init__(self, service: SlotService, devices: Sequence[str] = ()) -> None:
        self._service = service
        #: ``[placement] allowed_devices``: a container given one of them holds it in its slot
        self._devices = tuple(devices)
        #: slot name -> the runtime's whole container id, for the containers the agent places
        self._ids: dict[str, str] = {}
        self._changed = threading.Condition()
        self._generation = 0
        service.subscribe(self._on_change)

    def _on_change(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def create(self, container: NriContainer) -> NriAdjustment:
        """Allocate the container's slot (the same slot again for the same id); the errors of
        translation (InvalidRequest) and placement (PlacementError) propagate with their reason."""
        request = slot_request(container, managed_devices(self._devices) if container.devices else None)
        with self._changed:
            self._ids[request.name] = container.id
        before = self._service.shared_pool()
        try:
            result = self._service.allocate(request)
            if not result.slot.holding:  # a failed slot of this container holds nothing: make it again
                self._service.release(result.slot.id)
                result = self._service.allocate(request)
        except NodeAgentError:
            self._forget_unless_held(request.name)
            raise
        if result.created:
            log.info(
                "nri container placed",
                extra={
                    "container": container.id,
                    "pod": _pod(container),
                    "slot": result.slot.id,
                    "qos": request.qos,
                },
            )
        pool = self._service.shared_pool()
        answer = adjustment(result.slot, pool, self._service.topology())
        updates: tuple[NriUpdate, ...] = ()
        if pool != before:
            # The exclusive CPUs it took leave every other shared container now, not a poll later.
            updates = tuple(u for u in self._shared_updates(pool) if u.container_id != container.id)
        return answer.model_copy(
            update={"container_id": container.id, "updates": updates, "pool_version": pool_version(pool)}
        )

    def _forget_unless_held(self, name: str) -> None:
        try:
            self._service.get_slot(name)
        except NotFound:
            with self._changed:
                self._ids.pop(name, None)

    def remove(self, container_id: str) -> bool:
        """Release the container's slot; False when it had none (already released, or refused)."""
        name = slot_name(container_id)
        with self._changed:
            self._ids.pop(name, None)
        try:
            self._service.release(name)
        except NotFound:
            return False
        log.info("nri container released", extra={"container": container_id, "slot": name})
        return True

    def synchronize(self, containers: tuple[NriContainer, ...]) -> NriSyncResult:
        """Match the runtime's containers to slots: keep those that still run, release those whose
        container is gone, allocate for containers without one (a container that cannot be placed
        keeps running as the kubelet made it, and is reported). Every kept or placed container's
        adjustment comes back, shared containers' cpusets on the pool as it is now."""
        wanted = {slot_name(c.id): c for c in containers}
        with self._changed:
            self._ids = {name: c.id for name, c in wanted.items()}
        held = {s.name: s for s in self._service.list_slots() if is_container_slot(s)}
        released: list[str] = []
        for name in sorted(set(held) - set(wanted)):
            try:
                self._service.release(name)
            except NotFound:
                continue
            released.append(name)
        refused: dict[str, str] = {}
        for name, container in wanted.items():
            slot = held.get(name)
            if slot is not None and slot.holding:
                continue
            try:
                self.create(container)
            except NodeAgentError as err:
                refused[container.id] = str(err)
        # Adjustments last, on the pool once every container is placed (a guaranteed one placed
        # above may have shrunk it after an earlier shared one's answer was made).
        pool = self._service.shared_pool()
        topology = self._service.topology()
        slots = {s.name: s for s in self._service.list_slots() if is_container_slot(s)}
        updates = tuple(
            adjustment(slots[name], pool, topology).model_copy(update={"container_id": c.id})
            for name, c in wanted.items()
            if name in slots and c.id not in refused
        )
        if released or refused:
            log.info("nri synchronize", extra={"released": released, "refused": refused})
        return NriSyncResult(updates=updates, released=tuple(released), refused=refused)

    def updates(self, version: str, wait: float) -> NriUpdates:
        """The shared containers' cpusets once the pool is not ``version`` any more (at once when
        it already is not; after ``wait`` seconds at most, with no updates, when it stays)."""
        deadline = time.monotonic() + wait
        while True:
            with self._changed:
                generation = self._generation
            pool = self._service.shared_pool()
            current = pool_version(pool)
            if current != version:
                return NriUpdates(version=current, updates=self._shared_updates(pool))
            with self._changed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return NriUpdates(version=current)
                if self._generation == generation:
                    self._changed.wait(remaining)

    def _shared_updates(self, pool: frozenset[int]) -> tuple[NriUpdate, ...]:
        """Each shared container's cpuset (and mems) on ``pool``; none when the pool is empty."""
        if not pool:
            return ()
        with self._changed:
            ids = dict(self._ids)
        topology = self._service.topology()
        found: list[NriUpdate] = []
        for slot in self._service.list_slots():
            container_id = ids.get(slot.name)
            a = slot.assignment
            if container_id is None or a is None or a.exclusive or not slot.holding:
                continue
            cpus, mems = shared_cpus(slot, pool, topology)
            found.append(
                NriUpdate(
                    container_id=container_id,
                    cpuset_cpus=format_cpulist(cpus),
                    cpuset_mems=format_cpulist(mems),
                )
            )
        return tuple(found)


__all__ = [
    "ANNOTATION_PREFIX",
    "SLOT_PREFIX",
    "NriContainers",
    "adjustment",
    "is_container_slot",
    "pod_class",
    "pool_version",
    "shared_cpus",
    "slot_name",
    "slot_request",
]
