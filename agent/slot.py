"""A slot as the daemon knows it: one typed record from the API to the kernel and back.

``Slot`` carries what the client asked for (:class:`SlotRequest`), what placement gave it
(:class:`Assignment`), what isolation built (:class:`AppliedSlot`) and, when it is read through the
service, its worker's status (:class:`WorkerStatus`). The state store turns it into rows and the
REST layer into JSON; nothing in between handles its JSON form.

Life cycle: ``pending`` (written with its assignment, kernel objects being created) -> ``ready``
(isolated, no worker running) -> ``running`` (its worker is running and ready) -> ``releasing``;
or ``failed`` with a reason (then it holds no resources and no kernel objects).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nodeagent.isolation.foreign import ForeignCpu
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.isolation.network import SlotNetwork
from nodeagent.placement import Assignment
from nodeagent.runtime.ports import Endpoint
from nodeagent.runtime.supervisor import WorkerStatus
from nodeagent.schema.pool import standby_pool
from nodeagent.schema.request import QoS, SlotRequest, request_to_dict
from nodeagent.schema.worker import WorkerSpec


class SlotState(enum.StrEnum):
    PENDING = "pending"  #: written with its assignment, kernel objects being created
    READY = "ready"  #: isolated, no worker running
    RUNNING = "running"  #: its worker is running and ready
    RELEASING = "releasing"  #: being torn down
    FAILED = "failed"  #: see ``reason``
    #: A warm pool's standby (schema/pool.py): its worker ready and frozen, its memory held, no CPU.
    STANDBY = "standby"


#: States in which a slot holds its resources (and may hold kernel objects).
HOLDING = frozenset(
    {SlotState.PENDING, SlotState.READY, SlotState.RUNNING, SlotState.RELEASING, SlotState.STANDBY}
)

#: What the operator wants of a slot's worker.
Desired = Literal["running", "stopped"]


# Slotted: the store keeps one per slot for the slot's life (no __dict__ each).
@dataclass(frozen=True, slots=True)
class Slot:
    id: str
    name: str
    state: SlotState
    request: SlotRequest
    assignment: Assignment | None
    #: What isolation built: what release must take down. None before isolation, or unisolated.
    applied: AppliedSlot | None = None
    reason: str | None = None  #: why it failed, when state is failed
    created_at: float = 0.0
    updated_at: float = 0.0
    #: The worker's live status; set on slots read through the service, None without a worker.
    worker: WorkerStatus | None = None
    #: CPU time spent on a guaranteed slot's CPUs by anything else; set on slots read through the
    #: service where it can be measured.
    foreign_cpu: ForeignCpu | None = None
    #: The slot's own uid for its sandboxed workers, once it has one; set on slots read through
    #: the service (the state store keeps it in a table of its own).
    sandbox_uid: int | None = None
    #: Recent actions of the QoS loop on this slot (newest last), as published; set when read
    #: through the service.
    qos_actions: tuple[Mapping[str, Any], ...] = ()
    #: Whether the QoS loop has its worker stopped (evicted) until memory is calm again.
    qos_evicted: bool = False
    #: Where its worker serves: one per named port the slot holds; set on slots read through the
    #: service (the state store keeps the ports in a table of their own).
    endpoints: tuple[Endpoint, ...] = ()

    def viewed(
        self,
        *,
        worker: WorkerStatus | None,
        foreign_cpu: ForeignCpu | None,
        sandbox_uid: int | None,
        endpoints: tuple[Endpoint, ...],
        qos_actions: tuple[Mapping[str, Any], ...],
        qos_evicted: bool,
    ) -> Slot:
        """This slot with its live parts as the service reads them (every listing and scrape builds
        one per slot: a direct construction, a fifth of ``dataclasses.replace``'s cost)."""
        return Slot(
            self.id, self.name, self.state, self.request, self.assignment, self.applied, self.reason,
            self.created_at, self.updated_at, worker, foreign_cpu, sandbox_uid, qos_actions,
            qos_evicted, endpoints,
        )  # fmt: skip

    @property
    def pool(self) -> str | None:
        """The warm pool this slot is a standby of (agent/pools.py), by its name: set while it
        starts and while it waits frozen, None once a claim took it (it has the claim's name then)
        and for every other slot."""
        return standby_pool(self.name)

    @property
    def qos(self) -> QoS:
        return self.request.qos

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    @property
    def cgroup(self) -> str | None:
        """The slot's cgroup path, relative to the cgroup root(s)."""
        return None if self.applied is None else self.applied.cgroup

    @property
    def network(self) -> SlotNetwork | None:
        return None if self.applied is None else self.applied.network

    def to_json(self) -> dict[str, Any]:
        """The published form: the body of GET /v1/slots/{id}."""
        return {
            "id": self.id,
            "name": self.name,
            "qos": self.qos,
            "state": str(self.state),
            "request": request_to_dict(self.request),
            "assignment": None if self.assignment is None else self.assignment.to_dict(),
            "cgroup": self.cgroup,
            "network": None if self.network is None else self.network.to_json(),
            "worker": None if self.worker is None else self.worker.to_json(),
            "sandbox": None
            if self.sandbox_uid is None
            else {"uid": self.sandbox_uid, "gid": self.sandbox_uid},
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "foreign_cpu": None if self.foreign_cpu is None else self.foreign_cpu.to_json(),
            "qos_actions": [dict(action) for action in self.qos_actions],
            "qos_evicted": self.qos_evicted,
            "endpoints": [e.to_json() for e in self.endpoints],
            "pool": self.pool,
        }


# Slotted: the store keeps one per slot.
@dataclass(frozen=True, slots=True)
class Worker:
    """A slot's worker as stored: its spec (the client's, presets not yet applied), what the operator
    wants of it, and its last known status."""

    slot_id: str
    spec: WorkerSpec
    desired: Desired = "running"
    status: WorkerStatus | None = None
    updated_at: float = 0.0


__all__ = ["HOLDING", "Desired", "Slot", "SlotState", "Worker"]
