"""The slot manager: the one place that sequences placement -> isolation -> runtime and writes state.

``SlotManager`` implements :class:`nodeagent.agent.service.SlotService`. The kernel side
(:class:`~nodeagent.isolation.backend.IsolationBackend`: cgroups, cpusets, devices, netns) and the
worker side (:class:`~nodeagent.runtime.workers.WorkerRuntime`, driven by a
:class:`~nodeagent.runtime.supervision.SupervisionLoop`) sit behind small Protocols in the layers
they belong to, so the manager's logic is tested with fakes and the daemon plugs in the real ones.
What crosses each seam is typed: :class:`~nodeagent.agent.slot.Slot` (request, assignment,
applied kernel state, worker status) here, :class:`SlotIsolationSpec` -> :class:`AppliedSlot` to
isolation, :class:`SlotDescription` + :class:`AppliedSlot` -> :class:`Supervisor` to the runtime.

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

Degraded mode: when the kernel side cannot isolate at all (no root, no cgroups: ``isolates`` is
false), ``node().degraded`` says why and ``allocate`` raises Unsupported, unless
``allow_unisolated`` is set, in which case slots are bookkeeping only and workers run without
kernel isolation. ``degraded`` also lists single mechanisms the host lacks (network filtering);
isolation refuses the requests that need them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nodeagent import __version__
from nodeagent.agent.parts import CdiPart, IdentityPart, IsolationPart, LedgerPart, PortsPart, SlotParts
from nodeagent.agent.reconcile import ReconcileReport, reconcile
from nodeagent.agent.recovery import RecoveryMode
from nodeagent.agent.sandbox import SandboxPolicy
from nodeagent.agent.service import AllocateResult, NodeInfo, QosView
from nodeagent.agent.slot import Slot, SlotState, Worker
from nodeagent.agent.slot_cdi import SlotCdiSpecs
from nodeagent.agent.slot_workers import WorkersPart
from nodeagent.agent.state import StateStore
from nodeagent.agent.translate import assignment_of
from nodeagent.agent.worker_logs import WorkerLogs
from nodeagent.devices.topology import Topology
from nodeagent.errors import (
    Conflict,
    InsufficientStorage,
    InvalidRequest,
    NodeAgentError,
    NotFound,
    PlacementError,
    Unsupported,
    WorkerError,
)
from nodeagent.isolation.backend import IsolationBackend
from nodeagent.isolation.foreign import ForeignCpu
from nodeagent.isolation.isolator import Frozen
from nodeagent.isolation.partitioning import HostPartitioning
from nodeagent.placement import (
    Allocated,
    Assignment,
    Capacity,
    PlacementOptions,
    capacity,
    placement_index,
    plan,
)
from nodeagent.runtime.limits import RlimitCeilings, host_ceilings
from nodeagent.runtime.logs import LogLine
from nodeagent.runtime.ports import in_use_on_host
from nodeagent.runtime.presets import FindProgram
from nodeagent.runtime.supervisor import ALIVE_PHASES, Phase
from nodeagent.runtime.workers import Readoption, WorkerRuntime
from nodeagent.schema.pool import is_standby_name
from nodeagent.schema.request import (
    SLOT_ID_FORM,
    ResourceChanges,
    SlotRequest,
    apply_patch,
    check_client_request,
)
from nodeagent.schema.worker import WorkerSpec

log = logging.getLogger("nodeagent.manager")


# =========================================================================== helpers


def new_slot_id() -> str:
    # Short, unique, and a valid cgroup, netns and file name.
    slot_id = "s" + secrets.token_hex(6)
    assert SLOT_ID_FORM.fullmatch(slot_id), "ids keep the form names may not take"
    return slot_id


def _describe(a: Assignment) -> str:
    cpus = f"CPUs {list(a.cpus)}" if a.exclusive else f"{a.cpu_quota_millis / 1000:g} CPU quota"
    extra = f", GPUs {list(a.gpus)}" if a.gpus else ""
    return f"{cpus} on NUMA {list(a.numa_nodes)}, {a.memory_bytes} bytes{extra}"


# =========================================================================== the manager


class SlotManager:
    """The daemon's service layer (see the module docstring for the sequencing and recovery rules)."""

    def __init__(
        self,
        store: StateStore,
        topology: Topology,
        isolation: IsolationBackend,
        runtime: WorkerRuntime,
        *,
        options: PlacementOptions | None = None,
        node_id: str | None = None,
        allow_unisolated: bool = False,
        tick_seconds: float = 0.5,
        recovery: RecoveryMode = RecoveryMode.REFUSE,
        clock: Callable[[], float] = time.time,
        host: HostPartitioning | None = None,
        sandbox: SandboxPolicy | None = None,
        cdi: SlotCdiSpecs | None = None,
        port_range: tuple[int, int] = (20000, 29999),
        port_in_use: Callable[[int], bool] = in_use_on_host,
        find_program: FindProgram | None = None,
        log_retention_seconds: float = 0.0,
        rlimit_ceilings: RlimitCeilings | None = None,
    ) -> None:
        """``port_range``: where workers' ports are assigned from; ``port_in_use``: whether a host
        port has a listener outside the slots (runtime.ports). ``find_program``: look a worker's program
        up when it is submitted (refused at once when missing) and run it by its absolute path; None:
        the launch finds it. ``log_retention_seconds``: how long a released slot's worker logs are
        kept (0: removed with the slot). ``rlimit_ceilings``: what a worker's rlimits may ask for
        (runtime.limits; None: this process's own, read now).
        ``recovery``: what start-up does with busy slots the database does not name (agent.recovery).
        ``host``: keeps the rest of the host off exclusive CPUs and measures foreign CPU time (None:
        neither). ``sandbox``: the workers' sandbox (agent.sandbox), None for none. ``cdi``: where
        each slot's CDI spec is kept (agent.slot_cdi), None for no specs."""
        self._store = store
        self._topology = topology
        self._options = options or PlacementOptions()
        self._node_id = node_id or socket.gethostname()
        self._allow_unisolated = allow_unisolated
        self._recovery = recovery
        self._clock = clock
        self._sandbox = sandbox
        self._started_at = clock()
        self._lock = threading.RLock()
        self._subscribers: list[Callable[[], None]] = []
        #: Kubernetes integrations beside the manager (the daemon's): name -> their current problems
        self._integrations: dict[str, Callable[[], tuple[str, ...]]] = {}
        self._ready = False
        self._host = host
        self._qos: QosView | None = None
        self._pool_rank: Callable[[str], int] | None = None
        # The parts of a slot, one owner per resource (agent/parts.py, agent/slot_workers.py).
        self._isolation = IsolationPart(isolation, topology)
        self._ledger = LedgerPart(host)
        self._cdi = CdiPart(cdi, store, topology, self._shared_pool)
        self._ports = PortsPart(store, port_range, port_in_use)
        self._identity = IdentityPart(store, sandbox)
        self._workers = WorkersPart(
            store,
            runtime,
            self._lock,
            self._notify,
            isolation=self._isolation,
            ports=self._ports,
            identity=self._identity,
            cdi=self._cdi,
            sandbox=sandbox,
            find_program=find_program,
            rlimit_ceilings=rlimit_ceilings or host_ceilings(),
            host_memory=sum(node.memory_bytes or 0 for node in topology.numa_nodes),
            shared_pool=self._shared_pool,
            tick_seconds=tick_seconds,
        )
        self._logs = WorkerLogs(
            runtime,
            lambda key: self._view(self._slot(key)),
            retention_seconds=log_retention_seconds,
            clock=clock,
        )
        self._parts = SlotParts(
            ledger=self._ledger,
            isolation=self._isolation,
            ports=self._ports,
            identity=self._identity,
            cdi=self._cdi,
            workers=self._workers,
            logs=self._logs,
        )
        self.report: ReconcileReport | None = None

    @property
    def store(self) -> StateStore:
        """The state database (agent/pools.py keeps the pools' specs in it)."""
        return self._store

    @property
    def ports(self) -> PortsPart:
        """The slots' host ports (agent/parts.py)."""
        return self._ports

    @property
    def worker_logs(self) -> WorkerLogs:
        """Workers' output, and what released slots left (agent/worker_logs.py)."""
        return self._logs

    @property
    def ledger(self) -> LedgerPart:
        """What the slots hold, and the host partitioning that follows it (agent/parts.py)."""
        return self._ledger

    @property
    def cdi(self) -> CdiPart:
        """The slots' CDI specs (agent/parts.py)."""
        return self._cdi

    @property
    def identity(self) -> IdentityPart:
        """The slots' own uids for their sandboxed workers (agent/parts.py)."""
        return self._identity

    @property
    def isolation(self) -> IsolationBackend:
        """The kernel side this manager drives (the QoS loop acts on the same isolator)."""
        return self._isolation.backend

    def attach_qos(self, view: QosView | None) -> None:
        """Let the QoS loop (agent.qos_loop) add its view to slots and capacity and bound best-effort
        admission; None detaches it."""
        self._qos = view

    # ------------------------------------------------------------------ the ledger

    # ------------------------------------------------------------------ life cycle

    def start(
        self, *, supervise: bool = True, restart_workers: frozenset[str] = frozenset()
    ) -> ReconcileReport:
        """Reconcile database and kernel, then (``supervise``) start the supervision thread.

        ``restart_workers``: slots whose workers the previous agent stopped when it was stopped
        (``[workers] on_agent_stop = "stop"``); each one that is meant to run is started again at once.
        """
        if supervise:
            self._workers.open()
        report = self.reconcile(restart_workers=restart_workers)
        if supervise:
            self._workers.start()
            if self._host is not None:
                self._host.start()
        return report

    def close(self) -> None:
        """Stop supervision (workers keep running: they outlive the agent) and close the store.

        The host stays confined while exclusive slots remain (their workers keep running, and the next
        start takes over the record); with none left it is put back."""
        self._workers.close()  # the runtime too (the keeper's connection)
        if self._host is not None:
            self._host.close(exclusive_held=bool(self._ledger.held.cpus))
        self._store.close()

    # ------------------------------------------------------------------ SlotService: reads

    def node(self) -> NodeInfo:
        return NodeInfo(
            node_id=self._node_id,
            hostname=socket.gethostname(),
            agent_version=__version__,
            started_at=self._started_at,
            cgroup_mode=self._isolation.backend.cgroup_mode,
            host_partitioning=None if self._host is None else self._host.status(),
            degraded=(
                self._isolation.backend.degraded()
                + (self._sandbox.degraded() if self._sandbox else ())
                + tuple(filter(None, (self._store.short(),)))
            ),
            sandbox=None if self._sandbox is None else self._sandbox.to_json(),
            integrations={n: list(self._integration_problems(n)) for n in sorted(self._integrations)},
        )

    def watch_integration(self, name: str, problems: Callable[[], tuple[str, ...]]) -> None:
        """Show an integration the daemon runs beside the manager (the kubelet device plugins, the
        NodeResourceTopology publisher) in ``node()``, with what ``problems`` says keeps it from
        working; ``nodeagent doctor`` reads it from there."""
        self._integrations[name] = problems

    def _integration_problems(self, name: str) -> tuple[str, ...]:
        try:
            return self._integrations[name]()
        except Exception as err:  # noqa: BLE001 - the node's view must answer whatever the integration does
            return (f"its status could not be read: {err!r}",)

    def topology(self) -> Topology:
        return self._topology

    def capacity_report(self) -> Capacity:
        """What the host has and what the ledger leaves, host-wide and per NUMA node, typed (the
        NodeResourceTopology publisher reads it; ``capacity`` is the API's view with slot counts)."""
        with self._lock:
            return capacity(self._topology, self._ledger.held, self._options)

    def capacity(self) -> dict[str, Any]:
        with self._lock:
            body = capacity(self._topology, self._ledger.held, self._options).to_dict()
            slots = self._store.list_slots()
        counts: dict[str, int] = {str(s): 0 for s in SlotState}
        for slot in slots:
            counts[slot.state] = counts.get(slot.state, 0) + 1
        body["slots"] = counts
        standbys = [s for s in slots if s.pool is not None and s.holding]
        # What warm pools hold (agent/pools.py): memory reserved, no CPU once frozen. It is part
        # of the allocated figures above, and every allocate may take it back.
        body["standby"] = {
            "slots": len(standbys),
            "frozen": sum(1 for s in standbys if s.state == SlotState.STANDBY),
            "memory_bytes": sum(s.assignment.memory_bytes for s in standbys if s.assignment is not None),
        }
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
        qos = self._qos
        body["batch"] = None if qos is None else qos.batch()
        return body

    def list_slots(self, *, standby: bool = False) -> list[Slot]:
        """Every slot; warm pools' standbys only with ``standby`` (they belong to no client)."""
        return [self._view(s) for s in self._store.list_slots() if standby or s.pool is None]

    def get_slot(self, slot_id: str) -> Slot:
        return self._view(self._slot(slot_id))

    def find_slot(self, name: str) -> Slot | None:
        """The slot of this name, if any (as stored)."""
        return self._store.find_slot(name)

    def logs(self, slot_id: str, lines: int) -> list[str]:
        return [line.render() for line in self.log_entries(slot_id, lines)[1]]

    def log_entries(self, slot_id: str, lines: int, since: str | None = None) -> tuple[str, list[LogLine]]:
        """The slot's id and its worker's last ``lines`` lines (agent/worker_logs.py)."""
        return self._logs.entries(slot_id, lines, since)

    def ready(self) -> bool:
        return self._ready

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def events(self, slot_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The event log (newest ``limit``), for the API and operators."""
        return [dataclasses.asdict(e) for e in self._store.events(slot_id=slot_id, limit=limit)]

    # ------------------------------------------------------------------ SlotService: allocate

    def allocate(self, req: SlotRequest) -> AllocateResult:
        check_client_request(req)
        if req.worker is not None:
            self._workers.check(req.worker)  # before anything is placed
        self._check_isolation()
        with self._lock:
            self._store.check_space()
            existing = self._store.find_slot(req.name)
            if existing is not None:
                if existing.state == SlotState.FAILED:
                    self._discard_failed(existing)
                elif existing.request != req:
                    raise Conflict(
                        f"slot name {req.name!r} is taken by slot {existing.id} with a different request; "
                        "release it first or choose another name"
                    )
                elif existing.state == SlotState.RELEASING:
                    raise Conflict(f"slot {req.name!r} is being released; retry once it is gone")
                elif existing.state == SlotState.PENDING:
                    # Only an allocate that failed half-way (its "ready" could not be written) leaves a
                    # pending row behind while the agent runs: the client's retry finishes it.
                    return self._finish_allocate(existing, req)
                else:
                    return AllocateResult(self._view(existing), created=False)
            if self._qos is not None and req.qos == "best-effort":
                held = self._ledger.held
                self._qos.admit(
                    req,
                    held.quota_millis.get("best-effort", 0) / 1000,
                    held.memory_by_qos.get("best-effort", 0),
                )
            assignment = self._plan_making_room(req)
            # Committed before any kernel object exists, so a crash of the agent at any later instant
            # leaves a row that names what it may have created; not flushed (see transaction()).
            with self._store.transaction(durable=False):
                slot = self._store.insert_slot(
                    Slot(
                        id=new_slot_id(),
                        name=req.name,
                        state=SlotState.PENDING,
                        request=req,
                        assignment=assignment,
                    )
                )
                self._store.add_event(
                    "allocate", f"slot {req.name!r} pending: {_describe(assignment)}", slot.id
                )
                if req.worker is not None:
                    # In the same commit: a port that is taken refuses the allocate before anything
                    # is placed or built, and the slot never exists without the ports it was told.
                    self._ports.reserve(slot.id, req.worker)
            self._ledger.set(self._ledger.held.add(assignment))
            try:
                return self._finish_allocate(slot, req)
            except NodeAgentError as err:
                self._forget_refused(slot, err)
                raise

    def _plan_making_room(self, req: SlotRequest) -> Assignment:
        """Place ``req``; when it does not fit but would without warm pools' standbys, drop
        standbys (lowest pool priority first, then the newest) until it fits: a pool never makes an
        allocate fail that would have succeeded without it. A standby's own allocate never drops one."""
        try:
            return plan(self._topology, self._ledger.held, req, self._options, irq_load=self._irq_load())
        except PlacementError:
            standbys = [] if is_standby_name(req.name) else self._standby_victims()
            if not standbys:
                raise
            without = self._ledger.held
            for victim in standbys:
                if victim.assignment is not None:
                    without = without.remove(victim.assignment)
            # Does it fit with every standby gone? If not, dropping them helps no one.
            plan(self._topology, without, req, self._options, irq_load=self._irq_load())
        for victim in standbys:
            self._drop(victim, f"its memory went to slot {req.name!r}")
            try:
                return plan(self._topology, self._ledger.held, req, self._options, irq_load=self._irq_load())
            except PlacementError:
                continue
        raise AssertionError("placement fits without every standby but not once they are gone")

    def _standby_victims(self) -> list[Slot]:
        """Standby slots in the order they give way: lowest pool priority, then newest first."""
        rank = self._pool_rank or (lambda _pool: 0)
        found = [s for s in self._store.list_slots() if s.pool is not None and s.holding]
        found.sort(key=lambda s: -s.created_at)
        found.sort(key=lambda s: rank(s.pool or ""))
        return found

    def _drop(self, slot: Slot, why: str) -> None:
        """Remove a standby at once: no graceful stop (a standby serves no one), its cgroup killed."""
        self._store.add_event("pool", f"standby {slot.name!r} dropped: {why}", slot.id)
        if slot.state != SlotState.RELEASING:
            with self._store.transaction(durable=False):
                slot = self._store.update_slot(dataclasses.replace(slot, state=SlotState.RELEASING))
        self.finish_release(slot)

    def _forget_refused(self, slot: Slot, err: NodeAgentError) -> None:
        """An allocate that failed leaves no trace: the client has the error, and a failed row would
        only stand in the way of its next try. Kept: a row whose kernel objects could not be removed
        (releasing, it holds its resources), and a pending row a full disk would not let go of (the
        retry finishes it)."""
        current = self._store.get_slot(slot.id)
        if current is None or current.state != SlotState.FAILED:
            return
        with contextlib.suppress(NodeAgentError):
            self._store.delete_slot(slot.id)
            self._store.add_event("refused", f"slot {slot.name!r} not allocated: {err}", slot.id)

    def _finish_allocate(self, pending: Slot, req: SlotRequest) -> AllocateResult:
        slot = self.finish_pending(pending, worker=req.worker)
        if req.worker is not None:
            self._workers.launch(slot, req.worker)
        self._notify()
        return AllocateResult(self._view(self._slot(slot.id)), created=True)

    def _check_isolation(self) -> None:
        if not self._isolation.isolates and not self._allow_unisolated:
            degraded = self._isolation.backend.degraded()
            raise Unsupported(
                "this agent cannot isolate slots: " + "; ".join(degraded) + ". Run it as root (or on a "
                "delegated cgroup), or set [isolation] allow_unisolated = true to run slots without isolation"
            )

    # ------------------------------------------------------------------ the sequencer's steps
    # (public for start-up, agent/reconcile.py, which finishes what a killed agent left)

    def finish_pending(self, slot: Slot, *, worker: WorkerSpec | None = None) -> Slot:
        """Apply isolation for a pending slot (and record the worker it wants, in the same commit);
        on failure roll back, mark failed and re-raise. The caller holds the lock."""
        try:
            applied = self._isolation.apply(slot)
        except NodeAgentError as err:
            self.fail(slot, f"isolation failed: {err}")
            raise
        try:
            with self._store.transaction():
                ready = self._store.update_slot(
                    dataclasses.replace(slot, state=SlotState.READY, applied=applied)
                )
                if worker is not None:
                    # Before the launch: a worker the database does not name would be an orphan
                    # after a crash.
                    self._store.put_worker(Worker(slot_id=slot.id, spec=worker, desired="running"))
        except InsufficientStorage:
            # The kernel objects go again; the row stays pending (deleting it needs space too),
            # holding its resources, so the client's retry of the same request finishes it.
            with contextlib.suppress(NodeAgentError):
                self._isolation.release(slot.id)
            raise
        self._cdi.apply(ready, worker)
        return ready

    def fail(self, slot: Slot, reason: str) -> None:
        """Roll a slot back: kernel objects removed, resources freed, row kept as ``failed`` (the
        caller holds the lock).

        When its kernel objects cannot be removed, the slot keeps its resources as ``releasing``
        instead: freeing CPUs that a cgroup still holds would hand them to a second slot. The release
        is retried by DELETE and on the next start.
        """
        try:
            self._isolation.release(slot.id)
        except NodeAgentError as err:
            why = f"{reason}; removing its kernel objects failed too ({err}); release it to retry"
            self._store.update_slot(dataclasses.replace(slot, state=SlotState.RELEASING, reason=why))
            self._store.add_event("failed", f"slot {slot.name!r}: {why}", slot.id)
            log.warning("slot failed and could not be rolled back", extra={"slot": slot.id, "reason": why})
            return
        if slot.holding and slot.assignment is not None:
            with contextlib.suppress(Conflict):
                self._ledger.set(self._ledger.held.remove(slot.assignment))
        self._cdi.release(slot.id)
        failed = dataclasses.replace(slot, state=SlotState.FAILED, reason=reason, applied=None)
        self._store.update_slot(failed)
        self._store.add_event("failed", f"slot {slot.name!r}: {reason}", slot.id)
        log.warning("slot failed", extra={"slot": slot.id, "reason": reason})

    def _discard_failed(self, slot: Slot) -> None:
        self._store.delete_slot(slot.id)
        self._workers.discard(slot, keep_logs=False)
        self._store.add_event("discard", f"failed slot {slot.name!r} replaced by a new allocation", slot.id)

    # ------------------------------------------------------------------ SlotService: resize

    def resize(self, slot_id: str, patch: ResourceChanges) -> Slot:
        with self._lock:
            self._store.check_space()
            slot = self._slot(slot_id)
            if slot.state not in (SlotState.READY, SlotState.RUNNING):
                raise Conflict(f"slot {slot.name!r} is {slot.state}; only ready or running slots resize")
            new_request = apply_patch(slot.request, patch)
            old = assignment_of(slot)
            without = self._ledger.held.remove(old)
            new = plan(self._topology, without, new_request, self._options, irq_load=self._irq_load())
            resized = self._store.update_slot(dataclasses.replace(slot, request=new_request, assignment=new))
            self._ledger.set(without.add(new))
            try:
                applied = self._isolation.apply(resized)
            except NodeAgentError:
                self._ledger.set(self._ledger.held.remove(new).add(old))
                self._store.update_slot(slot)
                with contextlib.suppress(NodeAgentError):
                    self._isolation.apply(slot)
                raise
            resized = dataclasses.replace(resized, applied=applied)
            try:
                resized = self._store.update_slot(resized)
            except InsufficientStorage as err:
                # The resize is done (its new assignment was committed before the kernel changed);
                # only the copy of what isolation built is stale, and release does not need it.
                log.warning(
                    "resized slot's kernel state not stored", extra={"slot": slot.id, "reason": str(err)}
                )
            self._store.add_event("resize", f"slot {slot.name!r} now {_describe(new)}", slot.id)
            self._cdi.apply(resized)
        self._notify()
        return self._view(resized)

    # ------------------------------------------------------------------ SlotService: release

    def release(self, slot_id: str) -> None:
        with self._lock:
            slot = self._slot(slot_id)
            if slot.state != SlotState.RELEASING:
                with self._store.transaction(durable=False):  # the row's deletion is the durable step
                    slot = self._store.update_slot(dataclasses.replace(slot, state=SlotState.RELEASING))
            supervisor = self._workers.remove(slot.id)
        self._notify()
        if supervisor is not None:
            self._workers.stop_and_wait(supervisor)
        with self._lock:
            self.finish_release(slot)
        self._notify()

    def finish_release(self, slot: Slot) -> None:
        """The release of a ``releasing`` slot whose worker is stopped: its kernel objects, CDI
        spec and share of the ledger go, then its row, then its worker's directory (the logs kept
        as configured). The caller holds the lock."""
        self._isolation.release(slot.id)
        self._cdi.release(slot.id)
        if slot.assignment is not None and slot.holding:
            with contextlib.suppress(Conflict):
                self._ledger.set(self._ledger.held.remove(slot.assignment))
        with self._store.transaction():
            self._store.delete_slot(slot.id)
            self._store.add_event("release", f"slot {slot.name!r} released", slot.id)
        status = self._workers.unsupervise(slot.id)
        # Why a worker that is not running is not (a launch that failed wrote nothing of its own).
        said = status is not None and status.phase not in ALIVE_PHASES and status.message
        word = f"worker {status.phase}: {status.message}" if said and status is not None else None
        # Below the state file system's reserve the logs go with the slot: the space matters more.
        keep = self._logs.retention_seconds > 0 and self._store.short() is None
        self._workers.discard(slot, keep_logs=keep, last_word=word)
        self._logs.prune()
        if self._host is not None:
            self._host.slot_released(slot.id)

    def stop_workers(self, timeout: float) -> list[str]:
        """Stop every running worker gracefully (SIGTERM, its grace, then its slot is killed) and wait
        up to ``timeout`` seconds for all of them; returns their slot ids.

        For an agent that is being stopped with ``[workers] on_agent_stop = "stop"``: desired states are
        left as they are, slots and their cgroups stay, and ``start(restart_workers=...)`` of the next
        agent brings the workers back.
        """
        with self._lock:
            stopping = self._workers.alive()
            for slot_id, supervisor in stopping:
                supervisor.stop()
                self._workers.record_status(slot_id, supervisor.tick())
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                alive = [slot_id for slot_id, sup in stopping if sup.tick().phase in ALIVE_PHASES]
                for slot_id, supervisor in stopping:
                    self._workers.record_status(slot_id, supervisor.status())
            if not alive or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        if alive:
            log.warning("workers still stopping when the agent exits", extra={"slots": alive})
        return [slot_id for slot_id, _ in stopping]

    def running_worker_slots(self) -> list[str]:
        """The slots whose worker is alive now (starting, running or stopping)."""
        with self._lock:
            return [slot_id for slot_id, _ in self._workers.alive()]

    def longest_stop_grace(self) -> float:
        """The longest stop grace period of the workers that run now (how long ``stop_workers`` may take)."""
        with self._lock:
            graces = [sup.spec.stop_grace_seconds for _, sup in self._workers.alive()]
        return max(graces, default=0.0)

    # ------------------------------------------------------------------ SlotService: workers

    def start_worker(self, slot_id: str, spec: WorkerSpec | None) -> Slot:
        with self._lock:
            slot = self._slot(slot_id)
            body = spec if spec is not None else slot.request.worker
            if body is None:
                raise InvalidRequest(f"slot {slot.name!r} has no worker in its request; send a worker spec")
            self._workers.check(body)
            if slot.state not in (SlotState.READY, SlotState.RUNNING):
                raise Conflict(f"slot {slot.name!r} is {slot.state}; workers start in ready slots")
            self._workers.check_runs_in(slot, body)
            self._store.check_space()
            if self._workers.running_same(slot, body):
                return self._view(slot)
            self._workers.store_wanted(slot, body)
            self._cdi.apply(slot, body)  # the worker's env may override the slot's wiring
            self._workers.launch(slot, body)
        self._notify()
        return self.get_slot(slot_id)

    def stop_worker(self, slot_id: str) -> Slot:
        with self._lock:
            slot = self._slot(slot_id)
            event = ("worker", f"worker of {slot.name!r}: stop requested")
            if not self._workers.stop(slot, event, desired_stopped=True):
                raise NotFound(f"slot {slot.name!r} has no worker to stop")
        self._notify()
        return self.get_slot(slot_id)

    def evict_worker(self, slot_id: str, reason: str) -> bool:
        """Stop a slot's worker for the QoS loop: its slot stays, and what the operator wants of the
        worker (desired running) is unchanged, so the loop starts it again (restore_worker) when the
        pressure is gone, and an agent restart starts it too. False when no worker is alive."""
        with self._lock:
            slot = self._slot(slot_id)
            event = ("evict", f"worker of {slot.name!r} evicted by the QoS loop: {reason}")
            if not self._workers.stop(slot, event, desired_stopped=False):
                return False
        self._notify()
        return True

    def restore_worker(self, slot_id: str, reason: str) -> bool:
        """Start an evicted worker again. False when the slot is gone, its worker was stopped by the
        operator meanwhile (desired stopped) or is already running."""
        with self._lock:
            slot = self._store.get_slot(slot_id)
            if slot is None:
                return False
            event = ("restore", f"worker of {slot.name!r} restored by the QoS loop: {reason}")
            if not self._workers.restore(slot, event):
                return False
        self._notify()
        return True

    # ------------------------------------------------------------------ warm pools (agent/pools.py)

    def attach_pools(
        self, rank: Callable[[str], int] | None, shape: Callable[[str], float | None] | None
    ) -> None:
        """Let agent/pools.py say how standbys give way to allocations (lower ``rank`` first: pool
        priority) and the CPUs each pool's slots get (its standbys' thread counts)."""
        self._pool_rank = rank
        self._workers.pool_shape = shape

    def standby_slots(self, pool: str | None = None) -> list[Slot]:
        """Standby slots (of ``pool``, or of any), starting or frozen, with their worker's status."""
        return [self._view(s) for s in self._store.list_slots(pooled=True) if pool in (None, s.pool)]

    def freeze_standby(self, slot_id: str) -> Slot:
        """A standby whose worker is ready: stop supervising it (a frozen worker answers no probe),
        record it ``standby`` (before the freeze, so a crash in between leaves a slot start-up
        freezes again rather than a frozen worker its probes would kill), then freeze it."""
        with self._lock:
            slot = self._slot(slot_id)
            if slot.pool is None or slot.state not in (SlotState.READY, SlotState.RUNNING):
                raise Conflict(f"slot {slot.name!r} is not a starting standby")
            self._workers.unsupervise(slot.id)
            with self._store.transaction():
                frozen = self._store.update_slot(dataclasses.replace(slot, state=SlotState.STANDBY))
                self._store.add_event("pool", f"standby {slot.name!r} ready and frozen", slot.id)
            self._isolation.backend.freeze(slot.id, slot.qos)
        self._notify()
        return frozen

    def standby_kernel_state(self, slot: Slot) -> Frozen:
        """How a standby's cgroup stands (gone, empty, thawed or frozen)."""
        return self._isolation.backend.frozen(slot.id, slot.qos)

    def refreeze_standby(self, slot_id: str) -> None:
        """Freeze a recorded standby again (an agent killed between its record and its freeze)."""
        with self._lock:
            slot = self._slot(slot_id)
            if slot.state == SlotState.STANDBY:
                self._isolation.backend.freeze(slot.id, slot.qos)

    def preview(self, request: SlotRequest) -> Assignment:
        """Where ``request`` would be placed now (nothing is held)."""
        with self._lock:
            return plan(self._topology, self._ledger.held, request, self._options, irq_load=self._irq_load())

    def reserve_for_claims(self, claims: Sequence[tuple[str, SlotRequest]]) -> frozenset[int]:
        """Keep the rest of the host off the exclusive CPUs that each claim of ``claims`` (a
        standby's id and its pool's request) would be placed on, so that a claim placed there has
        no host partitioning pass to make; the CPUs stay free for placement. The prediction is
        made again at every change of what slots hold (in the same pass as the change: a release
        does not put back a CPU the next claim takes), until the next call. Returns the CPUs."""
        wanted = tuple(claims)
        with self._lock:
            due = self._ledger.predict((lambda held: self._claim_cpus(held, wanted)) if wanted else None)
            reserved = self._ledger.reserved
        if due:
            # Outside the lock: a claim or allocate meanwhile does not wait for this pass, and
            # the pass makes the host match the ledger as it is when it runs (LedgerPart).
            self._ledger.sync_host()
        return reserved

    def _claim_cpus(self, held: Allocated, claims: Sequence[tuple[str, SlotRequest]]) -> frozenset[int]:
        """The exclusive CPUs each claim would be placed on with ``held`` held (its standby's own
        share given back first); a standby taken or gone meanwhile, or a claim that would not fit,
        adds none."""
        cpus: set[int] = set()
        for standby_id, request in claims:
            standby = self._store.get_slot(standby_id)
            if standby is None or standby.pool is None or standby.assignment is None:
                continue
            try:
                assignment = plan(
                    self._topology,
                    held.remove(standby.assignment),
                    request,
                    self._options,
                    irq_load=self._irq_load(),
                )
            except NodeAgentError:
                continue
            if assignment.exclusive:
                cpus.update(assignment.cpus)
        return frozenset(cpus)

    def drop_standby(self, slot_id: str, why: str) -> None:
        """Remove a standby (starting or frozen) at once; one already gone is fine."""
        with self._lock:
            slot = self._store.get_slot(slot_id)
            if slot is None:
                return  # dropped meanwhile (a claim failed on it, its pool was deleted)
            if slot.pool is None:
                raise Conflict(f"slot {slot.name!r} is not a standby")
            self._drop(slot, why)
        self._notify()

    def take_standby(self, slot_id: str, request: SlotRequest, *, ready_within: float = 2.0) -> Slot:
        """Make the frozen standby ``slot_id`` the slot ``request`` asks for: placed now (its
        exclusive cores, NUMA node and limits; host partitioning as for any slot), renamed,
        moved into its class's cgroup and thawed, its worker supervised again and its readiness
        probed at once (up to ``ready_within`` seconds). When the worker is gone or not ready, the
        slot is released and WorkerError says why (the caller tries the next standby)."""
        marks = [time.perf_counter()]
        with self._lock:
            standby = self._slot(slot_id)
            if standby.pool is None or standby.state != SlotState.STANDBY or standby.assignment is None:
                # Taken by a claim that came first (or dropped): the caller tries the next one.
                raise NotFound(f"slot {standby.name!r} is not a frozen standby (any more)")
            worker = request.worker
            if worker is None:
                raise InvalidRequest(
                    f"a slot taken from pool {standby.pool!r} runs the pool's worker; the request has none"
                )
            if self._store.find_slot(request.name) is not None:
                raise Conflict(
                    f"slot name {request.name!r} is taken; release that slot first or choose another name"
                )
            without = self._ledger.held.remove(standby.assignment)
            assignment = plan(self._topology, without, request, self._options, irq_load=self._irq_load())
            # Committed before the kernel changes: a crash from here on leaves a slot that start-up
            # finishes or fails, never CPUs held by a cgroup the database does not account for.
            with self._store.transaction():
                self._store.rename_slot(standby.id, request.name)
                slot = self._store.update_slot(
                    dataclasses.replace(
                        standby,
                        name=request.name,
                        state=SlotState.READY,
                        request=request,
                        assignment=assignment,
                    )
                )
                self._store.put_worker(Worker(slot_id=slot.id, spec=worker, desired="running"))
                self._store.add_event(
                    "allocate",
                    f"slot {request.name!r} taken from pool {standby.pool!r}: {_describe(assignment)}",
                    slot.id,
                )
            self._ledger.set(without.add(assignment))
            marks.append(time.perf_counter())
            try:
                applied = self._isolation.take(slot, standby.qos)
                marks.append(time.perf_counter())
                slot = self._store.update_slot(dataclasses.replace(slot, applied=applied))
                supervisor = self._workers.supervisor(slot, worker)
                if self._workers.readopt(slot.id, supervisor) is not Readoption.ADOPTED:
                    raise WorkerError(
                        f"standby {standby.name!r} of pool {standby.pool!r}: its worker is gone"
                    )
                marks.append(time.perf_counter())
                status = supervisor.tick()  # the readiness probe, here and now (no executor yet)
                deadline = time.monotonic() + ready_within
                while status.phase is Phase.STARTING and time.monotonic() < deadline:
                    time.sleep(0.005)
                    status = supervisor.tick()
                if status.phase is not Phase.RUNNING:
                    supervisor.stop()
                    raise WorkerError(
                        f"standby {standby.name!r} of pool {standby.pool!r} was not ready after its thaw: "
                        f"{status.message}"
                    )
            except NodeAgentError as err:
                self._drop(slot, f"taking it failed: {err}")
                raise
            marks.append(time.perf_counter())
            self._workers.supervise(slot.id, supervisor, status)
            marks.append(time.perf_counter())
        self._notify()
        steps = ("placed", "kernel", "adopted", "ready", "recorded")
        log.info(
            "standby taken",
            extra={
                "slot": slot.id,
                "pool": standby.pool,
                "ms": {
                    step: round((end - start) * 1000, 1)
                    for step, start, end in zip(steps, marks[:-1], marks[1:], strict=True)
                },
            },
        )
        return self._view(self._slot(slot.id))

    # ------------------------------------------------------------------ supervision

    def tick(self) -> None:
        """Advance every supervisor once and persist what changed (a full sweep; tests drive this)."""
        self._workers.tick_all()

    # ------------------------------------------------------------------ reconcile

    def reconcile(self, *, restart_workers: frozenset[str] = frozenset()) -> ReconcileReport:
        """Bring database and kernel into agreement after a start (agent/reconcile.py): the API
        is not ready meanwhile."""
        with self._lock:
            self._ready = False
            report = reconcile(
                self, self._parts, self._store, self._recovery, restart_workers=restart_workers
            )
            self.report = report
            self._ready = True
        log.info("reconcile done", extra={"report": report.to_dict()})
        self._notify()
        return report

    def cdi_spec(self, slot_id: str) -> dict[str, Any]:
        """The slot's CDI spec as written (``nodeagent slots cdi NAME``)."""
        return self._cdi.view(self._slot(slot_id))

    # ------------------------------------------------------------------ helpers

    def _slot(self, slot_id: str) -> Slot:
        slot = self._store.get_slot(slot_id) or self._store.find_slot(slot_id)
        if slot is None:
            raise NotFound(f"no slot with id or name {slot_id!r}; list slots with GET /v1/slots")
        return slot

    def shared_pool(self) -> frozenset[int]:
        return self._shared_pool()

    def _shared_pool(self) -> frozenset[int]:
        usable = placement_index(self._topology).usable(self._options)
        pool = usable.pool_base & ~self._ledger.held.cpu_mask
        return frozenset(i for i in range(pool.bit_length()) if pool >> i & 1)

    def _irq_load(self) -> Mapping[int, int] | None:
        return None if self._host is None else self._host.irq_load()

    def _foreign_cpu(self, slot: Slot) -> ForeignCpu | None:
        if self._host is None or slot.applied is None or slot.qos != "guaranteed":
            return None
        return self._host.foreign_cpu(slot.id, slot.applied.cpus, slot.applied.cgroup)

    def _view(self, slot: Slot) -> Slot:
        """The slot with its worker's status and its foreign CPU time as of now."""
        status = self._workers.status(slot)
        foreign = self._foreign_cpu(slot)
        actions, evicted = self._qos.slot_view(slot.id) if self._qos is not None else ((), False)
        return slot.viewed(
            worker=status,
            foreign_cpu=foreign,
            sandbox_uid=self._identity.view(slot),
            endpoints=self._ports.view(slot),
            qos_actions=actions,
            qos_evicted=evicted,
        )

    def _notify(self) -> None:
        for callback in list(self._subscribers):
            try:
                callback()
            except Exception:  # a subscriber's bug must not break the manager
                log.exception("subscriber failed")


__all__ = ["ReconcileReport", "SlotManager", "new_slot_id"]
