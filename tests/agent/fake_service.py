"""An in-memory SlotService for the API and CLI tests.

It uses the real request parser, placement and capacity code over a synthetic topology, so the
errors it raises (unknown fields, does-not-fit, unknown devices) are the ones the daemon raises;
only the kernel side (cgroups, workers) is replaced by plain records.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nodeagent.agent.service import AllocateResult, NodeInfo
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import Conflict, InvalidRequest, NotFound, WorkerError
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.placement import Allocated, Assignment, PlacementOptions, capacity, plan
from nodeagent.runtime.logs import LogLine
from nodeagent.runtime.supervisor import Phase, WorkerStatus
from nodeagent.schema.request import ResourceChanges, SlotRequest, apply_patch, request_to_dict
from nodeagent.schema.worker import WorkerSpec


@dataclass
class _Slot:
    view: Slot
    assignment: Assignment
    logs: list[str] = field(default_factory=list)


class FakeSlotService:
    """Slots in a dict, placed by the real planner; ``calls`` records every mutating call."""

    def __init__(
        self, topology: Topology | None = None, *, ready: bool = True, options: PlacementOptions | None = None
    ) -> None:
        self._topology = topology or synthetic_topology(2, 1, 4, 2, gpus_per_numa=1)
        self._options = options
        self._slots: dict[str, _Slot] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[], None]] = []
        self.is_ready = ready
        self.calls: list[tuple[str, Any]] = []
        #: Set to make the next worker start fail as a kernel/runtime refusal would.
        self.fail_worker_start: str | None = None

    # --- reads

    def node(self) -> NodeInfo:
        return NodeInfo(
            node_id="node-fake",
            hostname=self._topology.hostname,
            agent_version="0.0.test",
            started_at=1_700_000_000.0,
            cgroup_mode="fake",
            degraded=("network: no netns in the fake",),
        )

    def topology(self) -> Topology:
        return self._topology

    def capacity(self) -> dict[str, Any]:
        with self._lock:
            return capacity(self._topology, self._allocated()).to_dict()

    def shared_pool(self) -> frozenset[int]:
        with self._lock:
            exclusive = {c for s in self._slots.values() if s.assignment.exclusive for c in s.assignment.cpus}
        return frozenset(c.id for c in self._topology.cpus) - exclusive

    def list_slots(self) -> list[Slot]:
        with self._lock:
            return [s.view for s in self._slots.values()]

    def get_slot(self, slot_id: str) -> Slot:
        with self._lock:
            return self._find(slot_id).view

    def logs(self, slot_id: str, lines: int) -> list[str]:
        with self._lock:
            return self._find(slot_id).logs[-lines:]

    def cdi_spec(self, slot_id: str) -> dict[str, Any]:
        with self._lock:
            slot = self._find(slot_id).view
        return {
            "cdiVersion": "0.4.0",
            "kind": "nodeagent.io/slot",
            "devices": [{"name": slot.name, "containerEdits": {"env": [f"NODEAGENT_SLOT_ID={slot.id}"]}}],
        }

    def log_entries(self, slot_id: str, lines: int, since: str | None = None) -> tuple[str, list[LogLine]]:
        with self._lock:
            slot = self._find(slot_id)
            return slot.view.id, [LogLine("stdout", text) for text in slot.logs[-lines:]]

    def ready(self) -> bool:
        return self.is_ready

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    # --- changes

    def allocate(self, request: SlotRequest) -> AllocateResult:
        parsed = request
        self.calls.append(("allocate", request_to_dict(request)))
        with self._lock:
            existing = self._by_name(parsed.name)
            if existing is not None:
                if existing.view.request != parsed:
                    raise Conflict(
                        f"slot name {parsed.name!r} is taken by slot {existing.view.id} with a different "
                        "request; release it first or pick another name"
                    )
                return AllocateResult(existing.view, created=False)
            assignment = plan(self._topology, self._allocated(), parsed, self._options)
            slot_id = f"s{next(self._ids)}"
            now = time.time()
            view = Slot(
                id=slot_id,
                name=parsed.name,
                state=SlotState.READY,
                request=parsed,
                assignment=assignment,
                applied=_applied(slot_id, parsed.qos, f"nodeagent.slice/{parsed.qos}/{slot_id}"),
                created_at=now,
                updated_at=now,
            )
            self._slots[slot_id] = _Slot(view, assignment, [f"{parsed.name} line {i}" for i in range(5)])
        self._changed()
        return AllocateResult(view, created=True)

    def resize(self, slot_id: str, patch: ResourceChanges) -> Slot:
        self.calls.append(("resize", (slot_id, patch.changes())))
        with self._lock:
            slot = self._find(slot_id)
            parsed = apply_patch(slot.view.request, patch)
            others = Allocated.from_assignments(s.assignment for s in self._slots.values() if s is not slot)
            assignment = plan(self._topology, others, parsed)
            slot.assignment = assignment
            slot.view = replace(slot.view, request=parsed, assignment=assignment, updated_at=time.time())
            view = slot.view
        self._changed()
        return view

    def release(self, slot_id: str) -> None:
        self.calls.append(("release", slot_id))
        with self._lock:
            slot = self._find(slot_id)
            del self._slots[slot.view.id]
        self._changed()

    def start_worker(self, slot_id: str, spec: WorkerSpec | None) -> Slot:
        body = None if spec is None else spec.model_dump(mode="json", exclude_unset=True)
        self.calls.append(("start_worker", (slot_id, body)))
        with self._lock:
            slot = self._find(slot_id)
            if self.fail_worker_start:
                raise WorkerError(self.fail_worker_start)
            if spec is None and slot.view.request.worker is None:
                raise InvalidRequest(
                    f"slot {slot.view.id} has no worker in its request; send a WorkerSpec in the body"
                )
            worker = WorkerStatus(Phase.RUNNING, 4242, 2, 0, None, None, "started")
            slot.view = replace(slot.view, state=SlotState.RUNNING, worker=worker, updated_at=time.time())
            return slot.view

    def stop_worker(self, slot_id: str) -> Slot:
        self.calls.append(("stop_worker", slot_id))
        with self._lock:
            slot = self._find(slot_id)
            worker = WorkerStatus(Phase.STOPPED, None, 2, 0, None, None, "stopped on request")
            slot.view = replace(slot.view, state=SlotState.READY, worker=worker, updated_at=time.time())
            return slot.view

    # --- helpers

    def _find(self, slot_id: str) -> _Slot:
        slot = self._slots.get(slot_id) or self._by_name(slot_id)
        if slot is None:
            raise NotFound(f"no slot with id or name {slot_id!r}; `nodeagent slots list` shows the slots")
        return slot

    def _by_name(self, name: str) -> _Slot | None:
        return next((s for s in self._slots.values() if s.view.name == name), None)

    def _allocated(self) -> Allocated:
        return Allocated.from_assignments(s.assignment for s in self._slots.values())

    def _changed(self) -> None:
        for callback in self._subscribers:
            callback()


def _applied(slot_id: str, qos: str, cgroup: str) -> AppliedSlot:
    """What a kernel would have built, as far as the API shows it (the cgroup path)."""
    return AppliedSlot(
        slot_id=slot_id,
        qos=qos,
        cgroup=cgroup,
        cgroup_version="fake",
        procs_files=(),
        oom_events=None,
        cpus=frozenset(),
        mems=None,
        memory_max=None,
        sched_idle=False,
        oom_score_adj=0,
        device_rules=(),
    )
