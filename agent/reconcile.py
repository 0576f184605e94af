"""Start-up reconciliation: the database and the kernel brought into agreement after any start
(a clean one, a crash, a lost database), before the API answers. A part of :class:`SlotManager`
kept in a module of its own; it runs under the manager's lock and uses the manager's own steps
(finish a pending slot, finish a release, fail a slot, supervise a worker). The rules are in
agent/manager.py's docstring and docs/recovery.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodeagent.agent.recovery import Evidence, decide
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.agent.state import slot_from_record, worker_from_record
from nodeagent.agent.translate import slot_from_kernel
from nodeagent.errors import Conflict, InvalidRequest, NodeAgentError, WorkerError
from nodeagent.isolation.backend import OwnedSlot
from nodeagent.placement import Allocated
from nodeagent.runtime.workers import Readoption

if TYPE_CHECKING:
    from nodeagent.agent.manager import SlotManager

log = logging.getLogger("nodeagent.manager")


@dataclass
class ReconcileReport:
    """What start-up reconciliation did; logged and stored as events."""

    recovered: list[str] = field(default_factory=list)
    finished_pending: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    finished_releasing: list[str] = field(default_factory=list)
    recreated: list[str] = field(default_factory=list)
    resized: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    workers_adopted: list[str] = field(default_factory=list)
    workers_exited: list[str] = field(default_factory=list)
    workers_started: list[str] = field(default_factory=list)
    #: CDI specs of slots the agent does not hold (by slot id), removed
    cdi_removed: list[str] = field(default_factory=list)
    #: worker directories of slots the database does not name (by slot id), removed
    worker_dirs_removed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        parts = [
            f"{len(v)} {k.replace('_', ' ')}" for k, v in self.to_dict().items() if isinstance(v, list) and v
        ]
        return ", ".join(parts) if parts else "nothing to do"


def reconcile(manager: SlotManager, *, restart_workers: frozenset[str] = frozenset()) -> ReconcileReport:
    """Bring database and kernel into agreement after a start (see the module docstring)."""
    began = time.monotonic()
    report = ReconcileReport()
    with manager._lock:
        manager._ready = False
        manager.ledger.hold_host()
        isolated = manager._isolation.isolates
        if isolated:
            _account_for_busy_slots(manager, report)
            # Orphans first: a leftover shared-slot cgroup (say of a slot that failed mid-rollback)
            # would otherwise make the pool impossible to set up before anything else can run.
            known = {s.id for s in manager._store.list_slots() if s.holding}
            report.orphans_removed += manager._isolation.remove_orphans(known)
            manager._isolation.prepare()
        manager.ledger.set(_build_ledger(manager, report))
        # After a crash the record on disk says what the last agent changed; the slots that
        # exist now say what must stay confined: the host is made to match them, in one pass.
        manager.ledger.follow()
        for slot in manager._store.list_slots():
            if slot.state == SlotState.RELEASING:
                manager._finish_release(slot)
                report.finished_releasing.append(slot.name)
        if isolated:
            keep = {s.id for s in manager._store.list_slots() if s.holding}
            report.orphans_removed += manager._isolation.remove_orphans(keep)
        for slot in manager._store.list_slots():
            _reconcile_slot(manager, slot, report)
        held = [s for s in manager._store.list_slots() if s.state in (SlotState.READY, SlotState.RUNNING)]
        report.cdi_removed = manager.cdi.reconcile(held)
        for slot in manager._store.list_slots():
            _reconcile_worker(manager, slot, report, restart=slot.id in restart_workers)
        # A release killed between its row and its directory leaves the directory (the worker's
        # files, logs) to no slot: gone at the next start, which is what release would have done.
        try:
            report.worker_dirs_removed = manager._runtime.reap(s.id for s in manager._store.list_slots())
        except OSError as err:
            log.warning("stale worker directories not removed", extra={"reason": str(err)})
        manager.worker_logs.prune()
        report.seconds = time.monotonic() - began
        manager.report = report
        manager._store.add_event("reconcile", report.summary())
        manager._ready = True
    log.info("reconcile done", extra={"report": report.to_dict()})
    manager._notify()
    return report


def _account_for_busy_slots(manager: SlotManager, report: ReconcileReport) -> None:
    """Refuse to start, or rebuild, where the kernel runs slots the database does not name."""
    owned = {o.slot_id: o for o in manager._isolation.owned_slots()}
    evidence = Evidence(busy={o.slot_id: o.pids for o in owned.values() if o.pids}, cgroups=owned.keys())
    known = {s.id for s in manager._store.list_slots()}
    decision = decide(evidence, known, manager._recovery, manager._store.path)
    for slot_id in decision.rebuild:
        _rebuild(manager, owned[slot_id], report)
    if decision.discard:
        log.warning("discarding unexplained slots", extra={"slots": list(decision.discard)})


def _rebuild(manager: SlotManager, owned: OwnedSlot, report: ReconcileReport) -> None:
    """A slot the database lost, back from its manifest, or from its cgroup when it has none."""
    manifest = manager._store.manifests.read(owned.slot_id) if manager._store.manifests else None
    worker = None
    try:
        if manifest is not None:
            slot = slot_from_record(manifest)
            stored = manifest.get("worker")
            worker = None if stored is None else worker_from_record(slot.id, stored)
            how = "from its manifest"
        else:
            slot = slot_from_kernel(owned)
            how = "from its cgroup (no manifest: its worker is unsupervised; release the slot to end it)"
    except (NodeAgentError, KeyError, TypeError, ValueError) as err:
        slot = slot_from_kernel(owned)
        how = f"from its cgroup (its manifest is unreadable: {err})"
    with manager._store.transaction():
        manager._store.insert_slot(slot)
        if worker is not None:
            manager._store.put_worker(worker)
        if manifest is not None:
            how += manager.ports.restore(slot.id, manifest)
        how += manager.identity.restore(slot.id, owned.pids, manifest)
        manager._store.add_event("recover", f"slot {slot.name!r} rebuilt {how}", slot.id)
    report.recovered.append(slot.name)
    log.warning("slot recovered", extra={"slot": slot.id, "how": how})


def _build_ledger(manager: SlotManager, report: ReconcileReport) -> Allocated:
    ledger = Allocated()
    for slot in manager._store.list_slots():
        if not slot.holding or slot.assignment is None:
            continue
        try:
            ledger = ledger.add(slot.assignment)
        except (Conflict, InvalidRequest) as err:
            # Cannot happen through this manager; if the database says so anyway, the later slot yields.
            manager.ledger.set(ledger)
            manager._fail(dataclasses.replace(slot, state=SlotState.FAILED), f"on start: {err}")
            report.failed.append(slot.name)
    return ledger


def _reconcile_slot(manager: SlotManager, slot: Slot, report: ReconcileReport) -> None:
    if slot.state == SlotState.PENDING:
        try:
            manager._finish_pending(slot)
            report.finished_pending.append(slot.name)
        except NodeAgentError:
            report.failed.append(slot.name)
    elif slot.state in (SlotState.READY, SlotState.RUNNING) and _cgroup_vanished(manager, slot):
        try:
            manager._finish_pending(dataclasses.replace(slot, state=SlotState.PENDING))
            report.recreated.append(slot.name)
            manager._store.add_event("recreate", "its cgroup had vanished; isolation re-applied", slot.id)
        except NodeAgentError:
            report.failed.append(slot.name)
    elif slot.state in (SlotState.READY, SlotState.RUNNING) and _resize_interrupted(manager, slot):
        # A resize commits the new assignment before it changes the kernel and records what the
        # kernel holds after: killed in between, the cgroup still has the old CPUs. Finish it.
        try:
            manager._finish_pending(dataclasses.replace(slot, state=SlotState.PENDING))
            report.resized.append(slot.name)
            manager._store.add_event(
                "resize", "a resize the agent did not finish: isolation re-applied", slot.id
            )
        except NodeAgentError:
            report.failed.append(slot.name)


def _resize_interrupted(manager: SlotManager, slot: Slot) -> bool:
    """Whether the stored kernel state is older than the stored assignment: an exclusive slot's
    CPUs (or any slot's memory limit) differ between the two."""
    applied, assignment = slot.applied, slot.assignment
    if not manager._isolation.isolates or applied is None or assignment is None:
        return False
    if assignment.exclusive and applied.cpus != frozenset(assignment.cpus):
        return True
    # Guaranteed and burstable slots are limited at their assignment (best-effort at a multiple).
    online = slot.request.qos != "best-effort"
    return online and applied.memory_max is not None and applied.memory_max != assignment.memory_bytes


def _cgroup_vanished(manager: SlotManager, slot: Slot) -> bool:
    if not manager._isolation.isolates:
        return False
    return slot.applied is None or not manager._isolation.exists(slot.applied)


def _reconcile_worker(
    manager: SlotManager, slot: Slot, report: ReconcileReport, *, restart: bool = False
) -> None:
    worker = manager._store.get_worker(slot.id)
    if worker is None or slot.state not in (SlotState.READY, SlotState.RUNNING):
        return
    try:
        supervisor = manager._make_supervisor(slot, worker.spec)
    except (InvalidRequest, WorkerError, Conflict) as err:
        manager._store.add_event("worker", f"cannot supervise the stored worker: {err}", slot.id)
        return
    found = manager._runtime.readopt(slot.id, supervisor)
    if found is Readoption.ADOPTED:
        report.workers_adopted.append(slot.name)
    elif found is Readoption.EXITED:
        report.workers_exited.append(slot.name)
    if found is not Readoption.NONE and worker.desired == "stopped":
        supervisor.stop()
    elif found is Readoption.NONE and worker.desired == "running":
        supervisor.start()
        report.workers_started.append(slot.name)
    elif found is Readoption.EXITED and worker.desired == "running" and restart:
        # Stopped by the last agent because it was stopped, not by its own doing or the user's:
        # it comes back with the agent, whatever its restart policy says of an exit.
        supervisor.start()
        report.workers_started.append(slot.name)
    manager._loop.add(slot.id, supervisor)
    manager._record_status(slot.id, supervisor.status())
