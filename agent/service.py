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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nodeagent.agent.slot import Slot
from nodeagent.devices.topology import Topology
from nodeagent.runtime.logs import LogLine
from nodeagent.schema.request import ResourceChanges, SlotRequest
from nodeagent.schema.worker import WorkerSpec


@dataclass(frozen=True)
class AllocateResult:
    slot: Slot
    created: bool  #: False when the same request under the same name already existed (idempotent)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    hostname: str
    agent_version: str
    started_at: float
    cgroup_mode: str
    degraded: tuple[str, ...] = field(default_factory=tuple)  #: what this agent cannot isolate, and why
    #: host partitioning's mode and last pass (None: this agent does not partition the host)
    host_partitioning: dict[str, Any] | None = None
    #: The workers' sandbox: switched on, in force, what the host supports (agent.sandbox).
    sandbox: dict[str, Any] | None = None
    #: Each Kubernetes integration that is on (device_plugin, node_resource_topology) -> what keeps
    #: it from working now (empty: it works).
    integrations: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "agent_version": self.agent_version,
            "started_at": self.started_at,
            "cgroup_mode": self.cgroup_mode,
            "degraded": list(self.degraded),
            "host_partitioning": self.host_partitioning,
            "sandbox": self.sandbox,
            "integrations": {name: list(problems) for name, problems in self.integrations.items()},
        }


class QosView(Protocol):
    """What the QoS loop (agent.qos_loop) adds to the service's answers, and its say in admission."""

    def batch(self) -> dict[str, Any] | None:
        """The batch capacity view for capacity(); None before the loop has measured."""
        ...

    def slot_view(self, slot_id: str) -> tuple[tuple[dict[str, Any], ...], bool]:
        """The slot's recent QoS actions (newest last) and whether its worker is evicted."""
        ...

    def admit(self, request: SlotRequest, best_effort_cpus: float, best_effort_memory: int) -> None:
        """Raise PlacementError when a best-effort ``request`` does not fit what may be resold now,
        given what best-effort slots hold already (CPUs of quota, memory bytes)."""
        ...


class SlotService(Protocol):
    def node(self) -> NodeInfo: ...

    def topology(self) -> Topology: ...

    def capacity(self) -> dict[str, Any]:
        """placement.capacity(...).to_dict() plus device health and slot counts."""
        ...

    def shared_pool(self) -> frozenset[int]:
        """The CPUs burstable and best-effort slots share now (usable, held by no exclusive slot)."""
        ...

    def list_slots(self, *, standby: bool = False) -> list[Slot]:
        """Every slot; warm pools' standbys too with ``standby``."""
        ...

    def get_slot(self, slot_id: str) -> Slot:
        """By id or by name; NotFound otherwise."""
        ...

    def allocate(self, request: SlotRequest) -> AllocateResult:
        """Idempotent by name: Conflict (409) when the name exists with a different request,
        PlacementError when it does not fit."""
        ...

    def resize(self, slot_id: str, patch: ResourceChanges) -> Slot:
        """Change a slot's resources in place (the fields ``patch`` names; the others stay)."""
        ...

    def release(self, slot_id: str) -> None:
        """Stop its worker, remove its kernel objects, free its resources. NotFound if unknown."""
        ...

    def start_worker(self, slot_id: str, spec: WorkerSpec | None) -> Slot:
        """Start the slot's worker (``spec``, or None for the one in its request)."""
        ...

    def stop_worker(self, slot_id: str) -> Slot: ...

    def logs(self, slot_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines of the worker's output (stdout and stderr interleaved)."""
        ...

    def cdi_spec(self, slot_id: str) -> dict[str, Any]:
        """The slot's CDI spec (kind nodeagent.io/slot) as written for container runtimes;
        NotFound when it has none, Unsupported when the agent writes none."""
        ...

    def log_entries(self, slot_id: str, lines: int, since: str | None = None) -> tuple[str, list[LogLine]]:
        """The slot's id and the same lines with stream and time; ``since``: only complete lines
        after that time. Also a released slot's kept logs."""
        ...

    def ready(self) -> bool:
        """True once start-up reconciliation is done and the agent accepts work."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread, quickly) whenever slots or capacity change."""
        ...
