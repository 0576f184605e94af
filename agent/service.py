"""The service layer's contract: what the REST API, the CLI (through the API) and the controller
reporter may ask of the daemon.

One implementation, ``nodeagent.agent.manager.SlotManager``, sequences placement -> isolation ->
runtime and is the only writer of state. The API and the reporter depend on this Protocol only, so
they can be tested against a small fake.

Errors: every method raises the project's errors (``nodeagent.errors``): InvalidRequest (400/422),
NotFound (404), Conflict (409), PlacementError (409: the request does not fit), Unsupported (422),
KernelError/WorkerError (500/503). The API maps ``err.code`` and the class onto HTTP statuses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nodeagent.devices.topology import Topology


class SlotState(enum.StrEnum):
    PENDING = "pending"  #: written with its assignment, kernel objects being created
    READY = "ready"  #: isolated, no worker running
    RUNNING = "running"  #: its worker is running and ready
    RELEASING = "releasing"  #: being torn down
    FAILED = "failed"  #: see ``reason``


@dataclass(frozen=True)
class SlotView:
    """A slot as the API shows it. ``to_dict`` is the JSON body of GET /v1/slots/{id}."""

    id: str
    name: str
    qos: str
    state: SlotState
    request: Mapping[str, Any]  #: the SlotRequest as JSON (schema.request.request_to_dict)
    assignment: Mapping[str, Any] | None  #: placement.Assignment.to_dict()
    cgroup: str | None  #: cgroup path relative to the cgroup root(s)
    network: Mapping[str, Any] | None  #: netns name, addresses, limits
    worker: Mapping[str, Any] | None  #: worker status: phase, pid, restarts, last exit, message
    reason: str | None  #: why it failed, when state is failed
    created_at: float
    updated_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "qos": self.qos,
            "state": str(self.state),
            "request": dict(self.request),
            "assignment": None if self.assignment is None else dict(self.assignment),
            "cgroup": self.cgroup,
            "network": None if self.network is None else dict(self.network),
            "worker": None if self.worker is None else dict(self.worker),
            "reason": self.reason,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }


@dataclass(frozen=True)
class AllocateResult:
    slot: SlotView
    created: bool  #: False when the same request under the same name already existed (idempotent)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    hostname: str
    agent_version: str
    started_at: float
    cgroup_mode: str
    degraded: tuple[str, ...] = field(default_factory=tuple)  #: what this agent cannot isolate, and why

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "agent_version": self.agent_version,
            "started_at": self.started_at,
            "cgroup_mode": self.cgroup_mode,
            "degraded": list(self.degraded),
        }


class SlotService(Protocol):
    def node(self) -> NodeInfo: ...

    def topology(self) -> Topology: ...

    def capacity(self) -> dict[str, Any]:
        """placement.capacity(...).to_dict() plus device health and slot counts."""
        ...

    def list_slots(self) -> list[SlotView]: ...

    def get_slot(self, slot_id: str) -> SlotView:
        """By id or by name; NotFound otherwise."""
        ...

    def allocate(self, request: Mapping[str, Any]) -> AllocateResult:
        """A SlotRequest as decoded JSON (validated here); idempotent by name, Conflict (409) when
        the name exists with a different request, PlacementError when it does not fit."""
        ...

    def resize(self, slot_id: str, resources: Mapping[str, Any]) -> SlotView:
        """Change a slot's resources in place (a partial ``resources`` object)."""
        ...

    def release(self, slot_id: str) -> None:
        """Stop its worker, remove its kernel objects, free its resources. NotFound if unknown."""
        ...

    def start_worker(self, slot_id: str, spec: Mapping[str, Any] | None) -> SlotView:
        """Start the slot's worker (``spec`` as JSON, or None for the one in its request)."""
        ...

    def stop_worker(self, slot_id: str) -> SlotView: ...

    def logs(self, slot_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines of the worker's output (stdout and stderr interleaved)."""
        ...

    def ready(self) -> bool:
        """True once start-up reconciliation is done and the agent accepts work."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread, quickly) whenever slots or capacity change."""
        ...
