"""An in-memory SlotService for the API and CLI tests.

It uses the real request parser, placement and capacity code over a synthetic topology, so the
errors it raises (unknown fields, does-not-fit, unknown devices) are the ones the daemon raises;
only the kernel side (cgroups, workers) is replaced by plain records.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nodeagent.agent.service import AllocateResult, NodeInfo, SlotState, SlotView
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import Conflict, InvalidRequest, NotFound, WorkerError
from nodeagent.placement import Allocated, Assignment, capacity, plan
from nodeagent.schema.request import parse_slot_request, request_to_dict


@dataclass
class _Slot:
    view: SlotView
    assignment: Assignment
    logs: list[str] = field(default_factory=list)


class FakeSlotService:
    """Slots in a dict, placed by the real planner; ``calls`` records every mutating call."""

    def __init__(self, topology: Topology | None = None, *, ready: bool = True) -> None:
        self._topology = topology or synthetic_topology(2, 1, 4, 2, gpus_per_numa=1)
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

    def list_slots(self) -> list[SlotView]:
        with self._lock:
            return [s.view for s in self._slots.values()]

    def get_slot(self, slot_id: str) -> SlotView:
        with self._lock:
            return self._find(slot_id).view

    def logs(self, slot_id: str, lines: int) -> list[str]:
        with self._lock:
            return self._find(slot_id).logs[-lines:]

    def ready(self) -> bool:
        return self.is_ready

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    # --- changes

    def allocate(self, request: Mapping[str, Any]) -> AllocateResult:
        parsed = parse_slot_request(dict(request))
        self.calls.append(("allocate", dict(request)))
        with self._lock:
            existing = self._by_name(parsed.name)
            if existing is not None:
                if existing.view.request != request_to_dict(parsed):
                    raise Conflict(
                        f"slot name {parsed.name!r} is taken by slot {existing.view.id} with a different "
                        "request; release it first or pick another name"
                    )
                return AllocateResult(existing.view, created=False)
            assignment = plan(self._topology, self._allocated(), parsed)
            slot_id = f"s{next(self._ids)}"
            now = time.time()
            view = SlotView(
                id=slot_id,
                name=parsed.name,
                qos=parsed.qos,
                state=SlotState.READY,
                request=request_to_dict(parsed),
                assignment=assignment.to_dict(),
                cgroup=f"nodeagent.slice/{parsed.qos}/{slot_id}",
                network=None,
                worker=None,
                reason=None,
                created_at=now,
                updated_at=now,
            )
            self._slots[slot_id] = _Slot(view, assignment, [f"{parsed.name} line {i}" for i in range(5)])
        self._changed()
        return AllocateResult(view, created=True)

    def resize(self, slot_id: str, resources: Mapping[str, Any]) -> SlotView:
        self.calls.append(("resize", (slot_id, dict(resources))))
        with self._lock:
            slot = self._find(slot_id)
            merged = dict(slot.view.request)
            merged["resources"] = {**merged["resources"], **resources}
            parsed = parse_slot_request(merged)
            others = Allocated.from_assignments(s.assignment for s in self._slots.values() if s is not slot)
            assignment = plan(self._topology, others, parsed)
            slot.assignment = assignment
            slot.view = replace(
                slot.view,
                request=request_to_dict(parsed),
                assignment=assignment.to_dict(),
                updated_at=time.time(),
            )
            view = slot.view
        self._changed()
        return view

    def release(self, slot_id: str) -> None:
        self.calls.append(("release", slot_id))
        with self._lock:
            slot = self._find(slot_id)
            del self._slots[slot.view.id]
        self._changed()

    def start_worker(self, slot_id: str, spec: Mapping[str, Any] | None) -> SlotView:
        self.calls.append(("start_worker", (slot_id, spec)))
        with self._lock:
            slot = self._find(slot_id)
            if self.fail_worker_start:
                raise WorkerError(self.fail_worker_start)
            if spec is None and slot.view.request.get("worker") is None:
                raise InvalidRequest(
                    f"slot {slot.view.id} has no worker in its request; send a WorkerSpec in the body"
                )
            if spec is not None and not isinstance(spec.get("command"), list):
                raise InvalidRequest("worker: command must be a list of strings (argv)")
            worker = {"phase": "running", "pid": 4242, "restarts": 2, "message": "started"}
            slot.view = replace(slot.view, state=SlotState.RUNNING, worker=worker, updated_at=time.time())
            return slot.view

    def stop_worker(self, slot_id: str) -> SlotView:
        self.calls.append(("stop_worker", slot_id))
        with self._lock:
            slot = self._find(slot_id)
            worker = {"phase": "stopped", "pid": None, "restarts": 2, "message": "stopped on request"}
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
