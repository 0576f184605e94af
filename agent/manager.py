"""The slot manager: the one place that sequences placement -> isolation -> runtime and writes state.

``SlotManager`` implements :class:`nodeagent.agent.service.SlotService`. The kernel side
(:class:`SlotKernel`: cgroups, cpusets, devices, netns) and the worker side (:class:`WorkerRuntime`)
sit behind small Protocols so the manager's logic is tested with fakes and the daemon plugs in
the real ones.

Durability (the crash-safety contract)::

    allocate:  plan under the lock -> slot row "pending" WITH its assignment (committed)
               -> kernel.apply -> "ready" -> worker row (desired running) -> launch
    release:   "releasing" (committed) -> stop worker -> kernel.release -> row deleted
    resize:    new request + assignment committed -> kernel.resize (apply is idempotent)

The placement ledger counts every slot in pending, ready, running or releasing, so whatever
instant the agent dies at, resources held by a kernel object are also held in the database, and
no CPU or device can be handed out twice.

Reconcile on :meth:`SlotManager.start` (decisions):

- ``pending`` slots are *finished*: their assignment is in the ledger and isolation is idempotent,
  so apply runs again; a client that never saw the answer retries by name and gets this slot. If
  apply fails now, the slot is rolled back (kernel objects removed) and marked ``failed``.
- ``releasing`` slots are finished: worker killed, kernel objects removed, row deleted.
- kernel objects under our prefixes that no slot row names are orphans and are removed.
- ready/running slots whose cgroup vanished are *re-created* (apply again): their resources are
  still held, and re-creating keeps the slot usable; its worker, gone with the cgroup, then
  follows its restart policy.
- workers: live ones are re-adopted (pid + start time through a pidfd), dead ones are recorded
  and their restart policy applied; a worker wanted but never launched is launched.

``failed`` slots hold no resources and no kernel objects; allocating the same name again retries.

Degraded mode: when the kernel side cannot isolate (no root, no cgroups), ``node().degraded`` says
why and ``allocate`` raises Unsupported, unless ``allow_unisolated`` is set, in which case slots
are bookkeeping only and workers run without kernel isolation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import secrets
import select
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent import __version__
from nodeagent.agent.service import AllocateResult, NodeInfo, SlotState, SlotView
from nodeagent.agent.state import SlotRecord, StateStore, WorkerRecord
from nodeagent.cgroups import CgroupManager, open_manager
from nodeagent.devices.topology import Topology
from nodeagent.errors import Conflict, InvalidRequest, NodeAgentError, NotFound, Unsupported, WorkerError
from nodeagent.isolation.slot import SlotIsolator
from nodeagent.isolation.spec import NetworkRequest as IsolationNetwork
from nodeagent.isolation.spec import SlotIsolationSpec
from nodeagent.placement import (
    Allocated,
    Assignment,
    PlacementOptions,
    capacity,
    placement_index,
    plan,
)
from nodeagent.runtime.adopt import resume_supervision
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.launch import SlotBinding, build_launch_request
from nodeagent.runtime.logs import tail
from nodeagent.runtime.process import ExitRecord, pidfd_exited
from nodeagent.runtime.spawner import Spawner
from nodeagent.runtime.spec import WorkerSpec, parse_worker_spec
from nodeagent.runtime.supervisor import Phase, SlotCgroup, SpawnerLauncher, Supervisor, WorkerStatus
from nodeagent.schema.request import SlotRequest, parse_slot_request, request_to_dict

log = logging.getLogger("nodeagent.manager")

#: States in which a slot holds its resources (and may hold kernel objects).
HOLDING = frozenset({SlotState.PENDING, SlotState.READY, SlotState.RUNNING, SlotState.RELEASING})
_ALIVE_PHASES = frozenset({Phase.STARTING, Phase.RUNNING, Phase.UNREADY, Phase.STOPPING})


# =========================================================================== the kernel and runtime sides


@dataclass(frozen=True)
class KernelSlot:
    """What isolation needs to build (or rebuild) one slot's kernel objects."""

    id: str
    name: str
    qos: str
    request: SlotRequest
    assignment: Assignment
    #: The shared pool's CPUs right now (burstable and best-effort slots run on it).
    shared_pool: frozenset[int]


class SlotKernel(Protocol):
    """The isolation side. Every method is idempotent: reconcile calls them again after a crash."""

    @property
    def cgroup_mode(self) -> str: ...

    def degraded(self) -> tuple[str, ...]:
        """What this host cannot isolate, and why (empty when everything works)."""
        ...

    def prepare(self) -> None:
        """Create the agent's parent objects (cgroup parents, netns directory)."""
        ...

    def apply(self, slot: KernelSlot, applied: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """Create or correct the slot's objects; returns what was built (JSON, stored as ``applied``)
        with at least ``cgroup`` (str | None) and ``network`` (object | None)."""
        ...

    def exists(self, slot_id: str, applied: Mapping[str, Any]) -> bool:
        """Whether the slot's cgroup is still there."""
        ...

    def release(self, slot_id: str, applied: Mapping[str, Any] | None) -> None:
        """Kill what runs in the slot and remove its objects; missing objects are fine."""
        ...

    def set_shared_pool(self, cpus: frozenset[int]) -> None:
        """Exclusive slots came or went: shared-pool slots get the new pool."""
        ...

    def remove_orphans(self, keep: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
        """Remove our objects that belong to no slot in ``keep`` (slot id -> applied); say what went."""
        ...

    def binding(self, slot_id: str, applied: Mapping[str, Any]) -> SlotBinding:
        """Where a worker of this slot must go (cgroup.procs files, netns, OOM counter)."""
        ...

    def slot_cgroup(self, slot_id: str, applied: Mapping[str, Any]) -> SlotCgroup:
        """The slot's cgroup as supervision needs it (kill all, OOM count, pids)."""
        ...


class WorkerRuntime(Protocol):
    """The runtime side: builds supervisors and finds workers again after a restart."""

    def supervisor(
        self,
        slot: KernelSlot,
        spec: WorkerSpec,
        binding: SlotBinding,
        cgroup: SlotCgroup,
        addresses: Sequence[str],
    ) -> Supervisor: ...

    def readopt(self, slot_id: str, supervisor: Supervisor) -> str:
        """Resume the worker last launched for ``slot_id``: "adopted" (alive), "exited" (ended while
        we were away; its restart policy is applied) or "none" (nothing was ever launched)."""
        ...

    def logs(self, slot_id: str, lines: int) -> list[str]: ...

    def discard(self, slot_id: str) -> None:
        """The slot is gone: remove its worker directory."""
        ...

    def close(self) -> None: ...


# =========================================================================== reconcile report


@dataclass
class ReconcileReport:
    """What start-up reconciliation did; logged and stored as events."""

    finished_pending: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    finished_releasing: list[str] = field(default_factory=list)
    recreated: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    workers_adopted: list[str] = field(default_factory=list)
    workers_exited: list[str] = field(default_factory=list)
    workers_started: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        parts = [
            f"{len(v)} {k.replace('_', ' ')}" for k, v in self.to_dict().items() if isinstance(v, list) and v
        ]
        return ", ".join(parts) if parts else "nothing to do"


# =========================================================================== the manager


def new_slot_id() -> str:
    # Short, unique, and a valid cgroup, netns and file name.
    return "s" + secrets.token_hex(6)


def worker_status_dict(status: WorkerStatus) -> dict[str, Any]:
    return {
        "phase": str(status.phase),
        "pid": status.pid,
        "restarts": status.restarts,
        "consecutive_failures": status.consecutive_failures,
        "last_exit": None if status.last_exit is None else exit_dict(status.last_exit),
        "next_restart_in": status.next_restart_in,
        "message": status.message,
    }


def _same_status(a: WorkerStatus, b: WorkerStatus) -> bool:
    """Equal but for the restart countdown, which changes every instant and is computed when read."""
    return (
        a.phase is b.phase
        and a.pid == b.pid
        and a.restarts == b.restarts
        and a.consecutive_failures == b.consecutive_failures
        and a.last_exit == b.last_exit
        and a.message == b.message
    )


def exit_dict(record: ExitRecord) -> dict[str, Any]:
    return {
        "code": record.code,
        "signal": record.signal,
        "oom_killed": record.oom_killed,
        "finished_at": record.finished_at,
        "reason": record.reason,
        "description": record.describe(),
    }


class SlotManager:
    """The daemon's service layer (see the module docstring for the sequencing and recovery rules)."""

    def __init__(
        self,
        store: StateStore,
        topology: Topology,
        kernel: SlotKernel,
        runtime: WorkerRuntime,
        *,
        options: PlacementOptions | None = None,
        node_id: str | None = None,
        allow_unisolated: bool = False,
        tick_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._topology = topology
        self._kernel = kernel
        self._runtime = runtime
        self._options = options or PlacementOptions()
        self._node_id = node_id or socket.gethostname()
        self._allow_unisolated = allow_unisolated
        self._tick_seconds = tick_seconds
        self._clock = clock
        self._started_at = clock()
        self._lock = threading.RLock()
        self._supervisors: dict[str, Supervisor] = {}
        self._worker_status: dict[str, WorkerStatus] = {}
        # The supervision loop's agenda: when each supervisor next has timed work (stale heap
        # entries are skipped by checking _due), and which pidfd belongs to which slot.
        self._due: dict[str, float] = {}
        self._agenda: list[tuple[float, int, str]] = []
        self._agenda_order = itertools.count()
        self._exit_watch: select.epoll | None = None
        self._wake_fd = -1
        self._fd_slots: dict[int, str] = {}
        self._subscribers: list[Callable[[], None]] = []
        self._ready = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ledger = Allocated()
        self.report: ReconcileReport | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self, *, supervise: bool = True) -> ReconcileReport:
        """Reconcile database and kernel, then (``supervise``) start the supervision thread."""
        if supervise and self._exit_watch is None:
            self._exit_watch = select.epoll()
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._exit_watch.register(self._wake_fd, select.EPOLLIN)
        report = self.reconcile()
        if supervise and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._supervise_loop, name="nodeagent-supervision", daemon=True
            )
            self._thread.start()
        return report

    def close(self) -> None:
        """Stop supervision (workers keep running: they outlive the agent) and close the store."""
        self._stop.set()
        if self._wake_fd >= 0:
            os.eventfd_write(self._wake_fd, 1)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._exit_watch is not None:
            self._exit_watch.close()
            os.close(self._wake_fd)
            self._exit_watch, self._wake_fd = None, -1
        self._runtime.close()
        self._store.close()

    # ------------------------------------------------------------------ SlotService: reads

    def node(self) -> NodeInfo:
        return NodeInfo(
            node_id=self._node_id,
            hostname=socket.gethostname(),
            agent_version=__version__,
            started_at=self._started_at,
            cgroup_mode=self._kernel.cgroup_mode,
            degraded=self._kernel.degraded(),
        )

    def topology(self) -> Topology:
        return self._topology

    def capacity(self) -> dict[str, Any]:
        with self._lock:
            body = capacity(self._topology, self._ledger, self._options).to_dict()
            records = self._store.list_slots()
        counts: dict[str, int] = {str(s): 0 for s in SlotState}
        for record in records:
            counts[record.state] = counts.get(record.state, 0) + 1
        body["slots"] = counts
        body["device_health"] = [
            {
                "kind": "gpu",
                "index": g.index,
                "uuid": g.uuid,
                "healthy": g.healthy,
                "events": list(g.health_events),
            }
            for g in self._topology.gpus
        ] + [{"kind": "fpga", "id": f.id, "healthy": f.healthy} for f in self._topology.fpgas]
        return body

    def list_slots(self) -> list[SlotView]:
        return [self._view(r) for r in self._store.list_slots()]

    def get_slot(self, slot_id: str) -> SlotView:
        return self._view(self._record(slot_id))

    def logs(self, slot_id: str, lines: int) -> list[str]:
        if lines < 0:
            raise InvalidRequest(f"logs: lines is {lines}; ask for 0 or more")
        record = self._record(slot_id)
        return self._runtime.logs(record.id, lines)

    def ready(self) -> bool:
        return self._ready

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def events(self, slot_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The event log (newest ``limit``), for the API and operators."""
        return [dataclasses.asdict(e) for e in self._store.events(slot_id=slot_id, limit=limit)]

    # ------------------------------------------------------------------ SlotService: allocate

    def allocate(self, request: Mapping[str, Any]) -> AllocateResult:
        req = parse_slot_request(request)
        if req.worker is not None:
            parse_worker_spec(req.worker)  # refuse a bad worker before anything is placed
        self._check_isolation()
        with self._lock:
            existing = self._store.find_slot(req.name)
            if existing is not None:
                same = dict(existing.request) == request_to_dict(req)
                if existing.state == SlotState.FAILED:
                    self._discard_failed(existing)
                elif not same:
                    raise Conflict(
                        f"slot name {req.name!r} is taken by slot {existing.id} with a different request; "
                        "release it first or choose another name"
                    )
                elif existing.state == SlotState.RELEASING:
                    raise Conflict(f"slot {req.name!r} is being released; retry once it is gone")
                else:
                    return AllocateResult(self._view(existing), created=False)
            assignment = plan(self._topology, self._ledger, req, self._options)
            record = self._store.insert_slot(
                SlotRecord(
                    id=new_slot_id(),
                    name=req.name,
                    qos=req.qos,
                    request=request_to_dict(req),
                    assignment=assignment.to_dict(),
                    state=SlotState.PENDING,
                )
            )
            self._ledger = self._ledger.add(assignment)
            self._store.add_event(
                "allocate", f"slot {req.name!r} pending: {_describe(assignment)}", record.id
            )
            record = self._finish_pending(record)
            if req.worker is not None:
                self._start_worker(record, req.worker)
        self._notify()
        return AllocateResult(self._view(self._record(record.id)), created=True)

    def _check_isolation(self) -> None:
        degraded = self._kernel.degraded()
        if degraded and not self._allow_unisolated:
            raise Unsupported(
                "this agent cannot isolate slots: " + "; ".join(degraded) + ". Run it as root (or on a "
                "delegated cgroup), or set [isolation] allow_unisolated = true to run slots without isolation"
            )

    def _finish_pending(self, record: SlotRecord) -> SlotRecord:
        """Apply isolation for a pending slot; on failure roll back, mark failed and re-raise."""
        slot = self._kernel_slot(record)
        try:
            applied = dict(self._kernel.apply(slot, record.applied))
            if slot.assignment.exclusive:
                self._kernel.set_shared_pool(self._shared_pool())
        except NodeAgentError as err:
            self._fail(record, f"isolation failed: {err}")
            raise
        return self._store.update_slot(
            record.id,
            state=SlotState.READY,
            applied=applied,
            cgroup=applied.get("cgroup"),
            network=applied.get("network"),
        )

    def _fail(self, record: SlotRecord, reason: str) -> None:
        """Roll a slot back: kernel objects removed, resources freed, row kept as ``failed``.

        When its kernel objects cannot be removed, the slot keeps its resources as ``releasing``
        instead: freeing CPUs that a cgroup still holds would hand them to a second slot. The release
        is retried by DELETE and on the next start.
        """
        try:
            self._kernel.release(record.id, record.applied or {})
        except NodeAgentError as err:
            why = f"{reason}; removing its kernel objects failed too ({err}); release it to retry"
            self._store.update_slot(record.id, state=SlotState.RELEASING, reason=why)
            self._store.add_event("failed", f"slot {record.name!r}: {why}", record.id)
            log.warning("slot failed and could not be rolled back", extra={"slot": record.id, "reason": why})
            return
        if record.state in HOLDING and record.assignment is not None:
            with contextlib.suppress(Conflict):
                self._ledger = self._ledger.remove(Assignment.from_dict(record.assignment))
        self._store.update_slot(record.id, state=SlotState.FAILED, reason=reason, applied=None)
        self._store.add_event("failed", f"slot {record.name!r}: {reason}", record.id)
        log.warning("slot failed", extra={"slot": record.id, "reason": reason})

    def _discard_failed(self, record: SlotRecord) -> None:
        self._store.delete_slot(record.id)
        self._runtime.discard(record.id)
        self._store.add_event(
            "discard", f"failed slot {record.name!r} replaced by a new allocation", record.id
        )

    # ------------------------------------------------------------------ SlotService: resize

    def resize(self, slot_id: str, resources: Mapping[str, Any]) -> SlotView:
        if not isinstance(resources, Mapping):
            raise InvalidRequest('resize: resources must be an object such as {"cpus": 4}')
        with self._lock:
            record = self._record(slot_id)
            if record.state not in (SlotState.READY, SlotState.RUNNING):
                raise Conflict(f"slot {record.name!r} is {record.state}; only ready or running slots resize")
            body = dict(record.request)
            body["resources"] = {**dict(body.get("resources", {})), **dict(resources)}
            new_req = parse_slot_request(body)
            old = Assignment.from_dict(record.assignment)
            without = self._ledger.remove(old)
            new = plan(self._topology, without, new_req, self._options)
            self._store.update_slot(record.id, request=request_to_dict(new_req), assignment=new.to_dict())
            self._ledger = without.add(new)
            updated = self._record(record.id)
            try:
                applied = dict(self._kernel.apply(self._kernel_slot(updated), updated.applied))
                if old.exclusive or new.exclusive:
                    self._kernel.set_shared_pool(self._shared_pool())
            except NodeAgentError:
                self._ledger = self._ledger.remove(new).add(old)
                self._store.update_slot(record.id, request=record.request, assignment=record.assignment)
                with contextlib.suppress(NodeAgentError):
                    self._kernel.apply(self._kernel_slot(record), record.applied)
                raise
            updated = self._store.update_slot(record.id, applied=applied, cgroup=applied.get("cgroup"))
            self._store.add_event("resize", f"slot {record.name!r} now {_describe(new)}", record.id)
        self._notify()
        return self._view(updated)

    # ------------------------------------------------------------------ SlotService: release

    def release(self, slot_id: str) -> None:
        with self._lock:
            record = self._record(slot_id)
            if record.state != SlotState.RELEASING:
                record = self._store.update_slot(record.id, state=SlotState.RELEASING)
            supervisor = self._supervisors.pop(record.id, None)
        self._notify()
        if supervisor is not None:
            self._stop_and_wait(supervisor)
        with self._lock:
            self._finish_release(record)
        self._notify()

    def _finish_release(self, record: SlotRecord) -> None:
        self._kernel.release(record.id, record.applied)
        if record.assignment is not None and record.state in HOLDING:
            assignment = Assignment.from_dict(record.assignment)
            with contextlib.suppress(Conflict):
                self._ledger = self._ledger.remove(assignment)
            if assignment.exclusive:
                self._kernel.set_shared_pool(self._shared_pool())
        self._store.delete_slot(record.id)
        self._worker_status.pop(record.id, None)
        self._due.pop(record.id, None)
        self._runtime.discard(record.id)
        self._store.add_event("release", f"slot {record.name!r} released", record.id)

    def _stop_and_wait(self, supervisor: Supervisor) -> None:
        """Graceful stop: SIGTERM, the spec's grace period, then the cgroup is killed."""
        supervisor.stop()
        deadline = time.monotonic() + supervisor.spec.stop_grace_seconds + 10
        while supervisor.tick().phase in _ALIVE_PHASES and time.monotonic() < deadline:
            time.sleep(0.01)

    # ------------------------------------------------------------------ SlotService: workers

    def start_worker(self, slot_id: str, spec: Mapping[str, Any] | None) -> SlotView:
        with self._lock:
            record = self._record(slot_id)
            body = spec if spec is not None else record.request.get("worker")
            if body is None:
                raise InvalidRequest(f"slot {record.name!r} has no worker in its request; send a worker spec")
            parse_worker_spec(body)
            if record.state not in (SlotState.READY, SlotState.RUNNING):
                raise Conflict(f"slot {record.name!r} is {record.state}; workers start in ready slots")
            current = self._supervisors.get(record.id)
            if current is not None and current.phase in _ALIVE_PHASES:
                stored = self._store.get_worker(record.id)
                if stored is not None and dict(stored.spec) == dict(body):
                    return self._view(record)
                raise Conflict(f"slot {record.name!r} already runs a worker; stop it first")
            self._start_worker(record, body)
        self._notify()
        return self.get_slot(slot_id)

    def _start_worker(self, record: SlotRecord, body: Mapping[str, Any]) -> None:
        spec = parse_worker_spec(body)
        self._store.put_worker(WorkerRecord(slot_id=record.id, spec=dict(body), desired="running"))
        supervisor = self._make_supervisor(record, spec)
        supervisor.start()
        self._supervisors[record.id] = supervisor
        self._record_status(record.id, supervisor.status())
        self._schedule(record.id, supervisor)
        self._store.add_event("worker", f"worker of {record.name!r}: {supervisor.message}", record.id)

    def stop_worker(self, slot_id: str) -> SlotView:
        with self._lock:
            record = self._record(slot_id)
            supervisor = self._supervisors.get(record.id)
            if supervisor is None:
                raise NotFound(f"slot {record.name!r} has no worker to stop")
            self._store.update_worker(record.id, desired="stopped")
            supervisor.stop()
            self._record_status(record.id, supervisor.tick())
            self._schedule(record.id, supervisor)
            self._store.add_event("worker", f"worker of {record.name!r}: stop requested", record.id)
        self._notify()
        return self.get_slot(slot_id)

    def _make_supervisor(self, record: SlotRecord, spec: WorkerSpec) -> Supervisor:
        applied = record.applied or {}
        network = record.network or {}
        addresses = [str(network["slot_address"])] if network.get("slot_address") else []
        return self._runtime.supervisor(
            self._kernel_slot(record),
            spec,
            self._kernel.binding(record.id, applied),
            self._kernel.slot_cgroup(record.id, applied),
            addresses,
        )

    # ------------------------------------------------------------------ supervision

    def _supervise_loop(self) -> None:
        # One epoll set holds every worker's pidfd, so an idle loop makes no per-slot system call:
        # it wakes for an exit, for the earliest timed work (probe, stop deadline, restart), or
        # after tick_seconds at the latest, and then ticks only the supervisors concerned.
        watch = self._exit_watch
        assert watch is not None
        while not self._stop.is_set():
            try:
                events = watch.poll(self._wait_seconds())
                self._tick_due([fd for fd, _ in events])
            except Exception:  # the loop must survive any one bad tick
                log.exception("supervision tick failed")
                self._stop.wait(self._tick_seconds)

    def tick(self) -> None:
        """Advance every supervisor once and persist what changed (a full sweep)."""
        changed = False
        with self._lock:
            for slot_id, supervisor in list(self._supervisors.items()):
                changed |= self._record_status(slot_id, supervisor.tick())
                self._schedule(slot_id, supervisor)
        if changed:
            self._notify()

    def _tick_due(self, fired: Sequence[int]) -> None:
        """Tick the supervisors whose worker exited (``fired`` pidfds) or whose timed work is due."""
        changed = False
        with self._lock:
            due: set[str] = set()
            for fd in fired:
                if fd == self._wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(fd)
                elif (slot_id := self._fd_slots.pop(fd, None)) is not None:
                    due.add(slot_id)
            now = time.monotonic()
            while self._agenda and self._agenda[0][0] <= now:
                when, _, slot_id = heapq.heappop(self._agenda)
                if self._due.get(slot_id) == when:
                    del self._due[slot_id]
                    due.add(slot_id)
            for slot_id in due:
                supervisor = self._supervisors.get(slot_id)
                if supervisor is not None:
                    changed |= self._record_status(slot_id, supervisor.tick())
                    self._schedule(slot_id, supervisor)
        if changed:
            self._notify()

    def _wait_seconds(self) -> float:
        with self._lock:
            while self._agenda and self._due.get(self._agenda[0][2]) != self._agenda[0][0]:
                heapq.heappop(self._agenda)  # superseded or released
            if not self._agenda:
                return self._tick_seconds
            return min(self._tick_seconds, max(0.0, self._agenda[0][0] - time.monotonic()))

    def _schedule(self, slot_id: str, supervisor: Supervisor) -> None:
        """Put a supervisor on the agenda after anything touched it: arm its pidfd, note its next due time."""
        due_in = supervisor.due_in()
        fd = supervisor.exit_fd()
        if (fd is None or not self._watch_exit(fd, slot_id)) and supervisor.phase in _ALIVE_PHASES:
            # Nothing will say when this worker exits (or it has, and the keeper has yet to write
            # down how): poll it every tick, as a fixed-tick loop would.
            due_in = self._tick_seconds if due_in is None else min(due_in, self._tick_seconds)
        if due_in is None:
            self._due.pop(slot_id, None)
            return
        when = time.monotonic() + due_in
        self._due[slot_id] = when
        heapq.heappush(self._agenda, (when, next(self._agenda_order), slot_id))
        if len(self._agenda) > 2 * len(self._due) + 64:
            # Superseded entries are dropped as they come up; rescheduling far ahead of that
            # (full sweeps, long backoffs) would let them pile up, so rebuild from _due.
            self._agenda = [(t, next(self._agenda_order), s) for s, t in self._due.items()]
            heapq.heapify(self._agenda)

    def _watch_exit(self, pidfd: int, slot_id: str) -> bool:
        """Arm a one-shot wake-up for this pidfd; False when it cannot serve (no loop, already exited)."""
        watch = self._exit_watch
        if watch is None or pidfd_exited(pidfd):
            # An exited pidfd stays readable: armed, it would wake the loop again and again.
            return False
        self._fd_slots[pidfd] = slot_id
        flags = select.EPOLLIN | select.EPOLLONESHOT
        try:
            watch.register(pidfd, flags)
        except FileExistsError:
            watch.modify(pidfd, flags)  # one-shot: fired once, re-armed here
        except OSError:
            return False
        return True

    def _record_status(self, slot_id: str, status: WorkerStatus) -> bool:
        previous = self._worker_status.get(slot_id)
        self._worker_status[slot_id] = status
        if previous is not None and _same_status(previous, status):
            return False
        record = self._store.get_slot(slot_id)
        if record is None:
            return False
        body = worker_status_dict(status)
        with self._store.transaction():
            self._store.update_worker(
                slot_id,
                worker_pid=status.pid,
                status=body,
                restarts=status.restarts,
                last_exit=body["last_exit"],
            )
            wanted = SlotState.RUNNING if status.phase is Phase.RUNNING else SlotState.READY
            if record.state in (SlotState.READY, SlotState.RUNNING) and record.state != wanted:
                self._store.update_slot(slot_id, state=wanted)
        if previous is None or previous.phase is not status.phase:
            self._store.add_event("worker", f"worker {body['phase']}: {status.message}", slot_id)
        return True

    # ------------------------------------------------------------------ reconcile

    def reconcile(self) -> ReconcileReport:
        """Bring database and kernel into agreement after a start (see the module docstring)."""
        began = time.monotonic()
        report = ReconcileReport()
        with self._lock:
            self._ready = False
            if not self._kernel.degraded():
                # Orphans first: a leftover shared-slot cgroup (say of a slot that failed mid-rollback)
                # would otherwise make the pool impossible to set up before anything else can run.
                known = {r.id: r.applied for r in self._store.list_slots() if r.state in HOLDING}
                report.orphans_removed += self._kernel.remove_orphans(known)
                self._kernel.prepare()
            self._ledger = self._build_ledger(report)
            records = self._store.list_slots()
            for record in records:
                if record.state == SlotState.RELEASING:
                    self._finish_release(record)
                    report.finished_releasing.append(record.name)
            keep = {r.id: r.applied for r in self._store.list_slots() if r.state in HOLDING}
            if not self._kernel.degraded():
                report.orphans_removed += self._kernel.remove_orphans(keep)
                self._kernel.set_shared_pool(self._shared_pool())
            for record in self._store.list_slots():
                self._reconcile_slot(record, report)
            for record in self._store.list_slots():
                self._reconcile_worker(record, report)
            report.seconds = time.monotonic() - began
            self.report = report
            self._store.add_event("reconcile", report.summary())
            self._ready = True
        log.info("reconcile done", extra={"report": report.to_dict()})
        self._notify()
        return report

    def _build_ledger(self, report: ReconcileReport) -> Allocated:
        ledger = Allocated()
        for record in self._store.list_slots():
            if record.state not in HOLDING or record.assignment is None:
                continue
            try:
                ledger = ledger.add(Assignment.from_dict(record.assignment))
            except (Conflict, InvalidRequest) as err:
                # Cannot happen through this manager; if the database says so anyway, the later slot yields.
                self._ledger = ledger
                self._fail(dataclasses.replace(record, state=SlotState.FAILED), f"on start: {err}")
                report.failed.append(record.name)
        return ledger

    def _reconcile_slot(self, record: SlotRecord, report: ReconcileReport) -> None:
        if record.state == SlotState.PENDING:
            try:
                self._finish_pending(record)
                report.finished_pending.append(record.name)
            except NodeAgentError:
                report.failed.append(record.name)
        elif record.state in (SlotState.READY, SlotState.RUNNING) and self._cgroup_vanished(record):
            try:
                self._finish_pending(dataclasses.replace(record, state=SlotState.PENDING))
                report.recreated.append(record.name)
                self._store.add_event("recreate", "its cgroup had vanished; isolation re-applied", record.id)
            except NodeAgentError:
                report.failed.append(record.name)

    def _cgroup_vanished(self, record: SlotRecord) -> bool:
        return not self._kernel.degraded() and not self._kernel.exists(record.id, record.applied or {})

    def _reconcile_worker(self, record: SlotRecord, report: ReconcileReport) -> None:
        worker = self._store.get_worker(record.id)
        if worker is None or record.state not in (SlotState.READY, SlotState.RUNNING):
            return
        try:
            supervisor = self._make_supervisor(record, parse_worker_spec(worker.spec))
        except (InvalidRequest, WorkerError) as err:
            self._store.add_event("worker", f"cannot supervise the stored worker: {err}", record.id)
            return
        found = self._runtime.readopt(record.id, supervisor)
        if found == "adopted":
            report.workers_adopted.append(record.name)
            if worker.desired == "stopped":
                supervisor.stop()
        elif found == "exited":
            report.workers_exited.append(record.name)
            if worker.desired == "stopped":
                supervisor.stop()
        elif worker.desired == "running":
            supervisor.start()
            report.workers_started.append(record.name)
        self._supervisors[record.id] = supervisor
        self._record_status(record.id, supervisor.status())
        self._schedule(record.id, supervisor)

    # ------------------------------------------------------------------ helpers

    def _record(self, slot_id: str) -> SlotRecord:
        record = self._store.get_slot(slot_id) or self._store.find_slot(slot_id)
        if record is None:
            raise NotFound(f"no slot with id or name {slot_id!r}; list slots with GET /v1/slots")
        return record

    def _shared_pool(self) -> frozenset[int]:
        usable = placement_index(self._topology).usable(self._options)
        pool = usable.pool_base & ~self._ledger.cpu_mask
        return frozenset(i for i in range(pool.bit_length()) if pool >> i & 1)

    def _kernel_slot(self, record: SlotRecord) -> KernelSlot:
        if record.assignment is None:
            raise InvalidRequest(f"slot {record.id} has no assignment")
        return KernelSlot(
            id=record.id,
            name=record.name,
            qos=record.qos,
            request=parse_slot_request(dict(record.request)),
            assignment=Assignment.from_dict(record.assignment),
            shared_pool=self._shared_pool(),
        )

    def _view(self, record: SlotRecord) -> SlotView:
        status = self._worker_status.get(record.id)
        worker: dict[str, Any] | None
        if status is not None:
            supervisor = self._supervisors.get(record.id)
            if status.next_restart_in is not None and supervisor is not None:
                status = supervisor.status()  # the countdown as of now, not as of the last tick
            worker = worker_status_dict(status)
        else:
            stored = self._store.get_worker(record.id)
            worker = None if stored is None or stored.status is None else dict(stored.status)
        return SlotView(
            id=record.id,
            name=record.name,
            qos=record.qos,
            state=SlotState(record.state),
            request=record.request,
            assignment=record.assignment,
            cgroup=record.cgroup,
            network=record.network,
            worker=worker,
            reason=record.reason,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )

    def _notify(self) -> None:
        for callback in list(self._subscribers):
            try:
                callback()
            except Exception:  # a subscriber's bug must not break the manager
                log.exception("subscriber failed")


def _describe(a: Assignment) -> str:
    cpus = f"CPUs {list(a.cpus)}" if a.exclusive else f"{a.cpu_quota_millis / 1000:g} CPU quota"
    extra = f", GPUs {list(a.gpus)}" if a.gpus else ""
    return f"{cpus} on NUMA {list(a.numa_nodes)}, {a.memory_bytes} bytes{extra}"


# =========================================================================== no-isolation kernel side


class UnisolatedKernel:
    """The kernel side when this host cannot isolate: bookkeeping only, workers run unconfined.

    ``degraded`` carries the reasons; the manager refuses slots unless ``allow_unisolated``.
    """

    def __init__(self, reasons: Sequence[str], cgroup_mode: str = "none") -> None:
        self._reasons = tuple(reasons)
        self._mode = cgroup_mode

    @property
    def cgroup_mode(self) -> str:
        return self._mode

    def degraded(self) -> tuple[str, ...]:
        return self._reasons

    def prepare(self) -> None:
        return None

    def apply(self, slot: KernelSlot, applied: Mapping[str, Any] | None) -> Mapping[str, Any]:
        return {"cgroup": None, "network": None, "isolated": False}

    def exists(self, slot_id: str, applied: Mapping[str, Any]) -> bool:
        return True

    def release(self, slot_id: str, applied: Mapping[str, Any] | None) -> None:
        return None

    def set_shared_pool(self, cpus: frozenset[int]) -> None:
        return None

    def remove_orphans(self, keep: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
        return []

    def binding(self, slot_id: str, applied: Mapping[str, Any]) -> SlotBinding:
        return SlotBinding(cgroup_procs=())

    def slot_cgroup(self, slot_id: str, applied: Mapping[str, Any]) -> SlotCgroup:
        return _NoCgroup()


class IsolatorKernel:
    """The real kernel side: :class:`~nodeagent.isolation.slot.SlotIsolator` behind :class:`SlotKernel`.

    The isolator keeps the shared pool right by itself (it cuts the pool before an exclusive slot
    gets its CPUs and grows it after a release), so :meth:`set_shared_pool` has nothing to do.
    """

    def __init__(
        self,
        isolator: SlotIsolator,
        topology: Topology,
        *,
        pids_max: int | None = None,
        extra_degraded: Sequence[str] = (),
    ) -> None:
        self._isolator = isolator
        self._topology = topology
        self._pids_max = pids_max
        self._extra_degraded = tuple(extra_degraded)

    @property
    def cgroup_mode(self) -> str:
        return self._isolator.host.mode

    def degraded(self) -> tuple[str, ...]:
        host = self._isolator.host
        reasons = list(self._extra_degraded)
        if not host.can_write:
            reasons.insert(
                0, f"cgroups (mode {host.mode}) are not writable: no CPU, memory or device isolation"
            )
        return tuple(reasons)

    def prepare(self) -> None:
        self._isolator.ensure_hierarchy()

    def apply(self, slot: KernelSlot, applied: Mapping[str, Any] | None) -> Mapping[str, Any]:
        return self._isolator.apply(self.spec(slot)).to_json()

    def spec(self, slot: KernelSlot) -> SlotIsolationSpec:
        """The isolation spec of a slot: its assignment, devices resolved to their nodes under /dev."""
        a = slot.assignment
        res = slot.request.resources
        quota = a.cpu_quota_millis / 1000 if slot.qos == "burstable" and a.cpu_quota_millis else None
        return SlotIsolationSpec(
            slot_id=slot.id,
            qos=slot.qos,  # type: ignore[arg-type]  # parse_slot_request checked it
            cpus=frozenset(a.cpus),
            exclusive=a.exclusive,
            mems=frozenset(a.numa_nodes) if a.memory_by_node else None,
            cpu_quota=quota,
            memory_bytes=a.memory_bytes or None,
            pids_max=self._pids_max,
            device_paths=self._device_paths(a),
            gpu=bool(a.gpus or a.mig or a.gpu_shares),
            network=None if res.network is None else IsolationNetwork(res.network.bandwidth_mbit),
            l3=res.l3_share,
        )

    def _device_paths(self, a: Assignment) -> tuple[str, ...]:
        paths = [d.path for d in a.devices]
        gpus = {g.index: g for g in self._topology.gpus}
        held = set(a.gpus) | {s.gpu_index for s in a.gpu_shares} | {m.gpu_index for m in a.mig}
        for index in sorted(held):
            gpu = gpus.get(index)
            if gpu is not None and gpu.minor is not None:
                paths.append(f"/dev/nvidia{gpu.minor}")
        for m in a.mig:
            gpu = gpus.get(m.gpu_index)
            instances = gpu.mig.instances if gpu is not None and gpu.mig is not None else ()
            for inst in instances:
                if (
                    inst.gpu_instance_id == m.gpu_instance_id
                    and inst.compute_instance_id == m.compute_instance_id
                ):
                    paths += inst.device_nodes
        fpgas = {f.id: f for f in self._topology.fpgas}
        for fpga_id in a.fpgas:
            if fpga_id in fpgas:
                paths += fpgas[fpga_id].device_nodes
        return tuple(dict.fromkeys(paths))

    def exists(self, slot_id: str, applied: Mapping[str, Any]) -> bool:
        cgroup = applied.get("cgroup")
        return bool(cgroup) and open_manager(self._isolator.host, str(cgroup)).exists()

    def release(self, slot_id: str, applied: Mapping[str, Any] | None) -> None:
        self._isolator.release(slot_id)

    def set_shared_pool(self, cpus: frozenset[int]) -> None:
        return None

    def remove_orphans(self, keep: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
        removed = self._isolator.remove_orphans(keep.keys())
        return (
            [f"cgroup {path}" for path in removed.cgroups.values()]
            + [f"netns {name}" for name in removed.network.netns]
            + [f"veth {name}" for name in removed.network.host_veths]
            + [f"resctrl group {name}" for name in removed.resctrl_groups]
        )

    def binding(self, slot_id: str, applied: Mapping[str, Any]) -> SlotBinding:
        network = applied.get("network") or {}
        return SlotBinding(
            cgroup_procs=tuple(applied.get("procs_files", ())),
            netns=network.get("netns_path"),
            oom_events=applied.get("oom_events"),
        )

    def slot_cgroup(self, slot_id: str, applied: Mapping[str, Any]) -> SlotCgroup:
        return ManagedCgroup(open_manager(self._isolator.host, str(applied["cgroup"])))


class ManagedCgroup:
    """runtime's SlotCgroup over a cgroups manager."""

    def __init__(self, manager: CgroupManager) -> None:
        self._manager = manager

    def kill_all(self, timeout: float) -> None:
        if self._manager.exists():
            self._manager.kill(timeout)

    def oom_kill_count(self) -> int:
        if not self._manager.exists():
            return 0
        return self._manager.oom_events().oom_kill or 0

    def pids(self) -> list[int]:
        return self._manager.subtree_pids() if self._manager.exists() else []


class SpawnerRuntime:
    """The real runtime side: workers launched through the spawner, one directory per slot.

    ``<workers_dir>/<slot id>/`` holds the slot file, the keeper's run state and the logs (see
    runtime/launch.py); the run state is what :meth:`readopt` finds the worker by after a restart.
    """

    def __init__(self, workers_dir: Path, spawner: Spawner | None = None) -> None:
        self._dir = workers_dir
        self._spawner = spawner or Spawner()
        self._launcher = SpawnerLauncher(self._spawner)

    def supervisor(
        self,
        slot: KernelSlot,
        spec: WorkerSpec,
        binding: SlotBinding,
        cgroup: SlotCgroup,
        addresses: Sequence[str],
    ) -> Supervisor:
        a = slot.assignment
        description = SlotDescription(
            slot_id=slot.id,
            cpus=a.cpus if a.exclusive else tuple(sorted(slot.shared_pool)),
            numa_nodes=a.numa_nodes,
            memory_bytes=a.memory_bytes or None,
            gpus=tuple(u if u is not None else str(i) for i, u in zip(a.gpus, a.gpu_uuids, strict=False)),
            devices=tuple(d.path for d in a.devices),
            addresses=tuple(addresses),
            cpu_quota=None if a.exclusive else a.cpu_quota_millis / 1000,
        )
        template = build_launch_request(spec, description, binding, self._dir / slot.id)
        # A worker in its own network namespace listens on the slot's address, which the host
        # reaches over the slot's veth; 127.0.0.1 here would be the host's loopback, not the slot's.
        probe_host = addresses[0] if addresses else "127.0.0.1"
        return Supervisor(spec, template, self._launcher, cgroup, probe_host=probe_host)

    def readopt(self, slot_id: str, supervisor: Supervisor) -> str:
        found = resume_supervision(supervisor, self._dir / slot_id / "run")
        if found.process is not None:
            return "adopted"
        return "exited" if found.exit is not None else "none"

    def logs(self, slot_id: str, lines: int) -> list[str]:
        log_dir = self._dir / slot_id / "logs"
        out = tail(log_dir, "stdout", lines)
        with contextlib.suppress(NotFound):
            out += [f"[stderr] {line}" for line in tail(log_dir, "stderr", lines)]
        return out[-lines:] if lines else []

    def discard(self, slot_id: str) -> None:
        shutil.rmtree(self._dir / slot_id, ignore_errors=True)

    def close(self) -> None:
        # Closing our end ends the spawner; keepers and workers it started live on.
        self._spawner.close()


class _NoCgroup:
    def kill_all(self, timeout: float) -> None:
        return None

    def oom_kill_count(self) -> int:
        return 0

    def pids(self) -> list[int]:
        return []


__all__ = [
    "HOLDING",
    "IsolatorKernel",
    "KernelSlot",
    "ManagedCgroup",
    "ReconcileReport",
    "SlotKernel",
    "SlotManager",
    "SpawnerRuntime",
    "UnisolatedKernel",
    "WorkerRuntime",
    "new_slot_id",
]
