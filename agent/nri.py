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
import re
from typing import Any

from nodeagent.agent.service import SlotService
from nodeagent.agent.slot import Slot
from nodeagent.cpulist import format_cpulist
from nodeagent.errors import InvalidRequest, NodeAgentError, NotFound
from nodeagent.schema.nri_messages import NriAdjustment, NriContainer, NriSyncResult
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


def slot_request(container: NriContainer) -> SlotRequest:
    """The slot request for ``container``; InvalidRequest naming what cannot be expressed."""
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


def adjustment(slot: Slot) -> NriAdjustment:
    """What the runtime applies: exclusive CPUs and their NUMA nodes for a guaranteed slot (a
    shared slot's pool moves as guaranteed slots come and go, so it is not pinned here), and the
    slot's memory limit."""
    a = slot.assignment
    exclusive = a is not None and a.exclusive and bool(a.cpus)
    return NriAdjustment(
        container_id="",
        slot_id=slot.id,
        slot_name=slot.name,
        qos=slot.qos,
        cpuset_cpus=format_cpulist(a.cpus) if exclusive and a is not None else "",
        cpuset_mems=format_cpulist(a.numa_nodes) if exclusive and a is not None and a.numa_nodes else "",
        memory_limit=slot.request.resources.memory_bytes,
    )


class NriContainers:
    """The NRI events, over the slot service."""

    def __init__(self, service: SlotService) -> None:
        self._service = service

    def create(self, container: NriContainer) -> NriAdjustment:
        """Allocate the container's slot (the same slot again for the same id); the errors of
        translation (InvalidRequest) and placement (PlacementError) propagate with their reason."""
        request = slot_request(container)
        result = self._service.allocate(request)
        if not result.slot.holding:  # a failed slot of this container holds nothing: make it again
            self._service.release(result.slot.id)
            result = self._service.allocate(request)
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
        return adjustment(result.slot).model_copy(update={"container_id": container.id})

    def remove(self, container_id: str) -> bool:
        """Release the container's slot; False when it had none (already released, or refused)."""
        name = slot_name(container_id)
        try:
            self._service.release(name)
        except NotFound:
            return False
        log.info("nri container released", extra={"container": container_id, "slot": name})
        return True

    def synchronize(self, containers: tuple[NriContainer, ...]) -> NriSyncResult:
        """Match the runtime's containers to slots: keep those that still run, release those whose
        container is gone, allocate for containers without one (a container that cannot be placed
        keeps running as the kubelet made it, and is reported)."""
        wanted = {slot_name(c.id): c for c in containers}
        held = {s.name: s for s in self._service.list_slots() if is_container_slot(s)}
        released: list[str] = []
        for name in sorted(set(held) - set(wanted)):
            try:
                self._service.release(name)
            except NotFound:
                continue
            released.append(name)
        updates: list[NriAdjustment] = []
        refused: dict[str, str] = {}
        for name, container in wanted.items():
            slot = held.get(name)
            try:
                if slot is None or not slot.holding:
                    updates.append(self.create(container))
                else:
                    updates.append(adjustment(slot).model_copy(update={"container_id": container.id}))
            except NodeAgentError as err:
                refused[container.id] = str(err)
        if released or refused:
            log.info("nri synchronize", extra={"released": released, "refused": refused})
        return NriSyncResult(updates=tuple(updates), released=tuple(released), refused=refused)


__all__ = [
    "ANNOTATION_PREFIX",
    "SLOT_PREFIX",
    "NriContainers",
    "adjustment",
    "is_container_slot",
    "pod_class",
    "slot_name",
    "slot_request",
]
