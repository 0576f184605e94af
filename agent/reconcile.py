"""Start-up reconciliation: the database and the kernel brought into agreement after any start
(a clean one, a crash, a lost database), before the API answers. A loop over the slot's parts
(agent/parts.py, agent/slot_workers.py), each asked to reconcile its own resource, and the
sequencer's own steps (:class:`Sequencer`: finish a pending slot, finish a release, fail a slot)
for what a killed agent left half-done. The manager runs it under its lock. The rules are in
agent/manager.py's docstring and docs/recovery.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from nodeagent.agent.parts import SlotParts
from nodeagent.agent.recovery import Evidence, RecoveryMode, decide
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.agent.slot_workers import Restored
from nodeagent.agent.state import StateStore, slot_from_record, worker_from_record
from nodeagent.agent.translate import slot_from_kernel
from nodeagent.errors import Conflict, InvalidRequest, NodeAgentError
from nodeagent.isolation.backend import OwnedSlot
from nodeagent.placement import Allocated

log = logging.getLogger("nodeagent.manager")


class Sequencer(Protocol):
    """The sequencer's steps that start-up finishes a killed agent's work with (SlotManager's)."""

    def finish_pending(self, slot: Slot) -> Slot: ...

    def fail(self, slot: Slot, reason: str) -> None: ...

    def finish_release(self, slot: Slot) -> None: ...


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


def reconcile(
    steps: Sequencer,
    parts: SlotParts,
    store: StateStore,
    recovery: RecoveryMode,
    *,
    restart_workers: frozenset[str] = frozenset(),
) -> ReconcileReport:
    """Bring database and kernel into agreement after a start (see the module docstring); the
    caller holds the manager's lock."""
    began = time.monotonic()
    report = ReconcileReport()
    isolation = parts.isolation
    parts.ledger.hold_host()
    if isolation.isolates:
        _account_for_busy_slots(parts, store, recovery, report)
        # Orphans first: a leftover shared-slot cgroup (say of a slot that failed mid-rollback)
        # would otherwise make the pool impossible to set up before anything else can run.
        known = {s.id for s in store.list_slots() if s.holding}
        report.orphans_removed += isolation.remove_orphans(known)
        isolation.prepare()
    parts.ledger.set(_build_ledger(steps, parts, store, report))
    # After a crash the record on disk says what the last agent changed; the slots that
    # exist now say what must stay confined: the host is made to match them, in one pass.
    parts.ledger.follow()
    for slot in store.list_slots():
        if slot.state == SlotState.RELEASING:
            steps.finish_release(slot)
            report.finished_releasing.append(slot.name)
    if isolation.isolates:
        keep = {s.id for s in store.list_slots() if s.holding}
        report.orphans_removed += isolation.remove_orphans(keep)
    for slot in store.list_slots():
        _reconcile_slot(steps, parts, store, slot, report)
    held = [s for s in store.list_slots() if s.state in (SlotState.READY, SlotState.RUNNING)]
    report.cdi_removed = parts.cdi.reconcile(held)
    for slot in store.list_slots():
        _reconcile_worker(parts, slot, report, restart=slot.id in restart_workers)
    # A release killed between its row and its directory leaves the directory (the worker's
    # files, logs) to no slot: gone at the next start, which is what release would have done.
    try:
        report.worker_dirs_removed = parts.workers.reap(s.id for s in store.list_slots())
    except OSError as err:
        log.warning("stale worker directories not removed", extra={"reason": str(err)})
    parts.logs.prune()
    report.seconds = time.monotonic() - began
    store.add_event("reconcile", report.summary())
    return report


def _account_for_busy_slots(
    parts: SlotParts, store: StateStore, recovery: RecoveryMode, report: ReconcileReport
) -> None:
    """Refuse to start, or rebuild, where the kernel runs slots the database does not name."""
    owned = {o.slot_id: o for o in parts.isolation.owned()}
    evidence = Evidence(busy={o.slot_id: o.pids for o in owned.values() if o.pids}, cgroups=owned.keys())
    known = {s.id for s in store.list_slots()}
    decision = decide(evidence, known, recovery, store.path)
    for slot_id in decision.rebuild:
        _rebuild(parts, store, owned[slot_id], report)
    if decision.discard:
        log.warning("discarding unexplained slots", extra={"slots": list(decision.discard)})


def _rebuild(parts: SlotParts, store: StateStore, owned: OwnedSlot, report: ReconcileReport) -> None:
    """A slot the database lost, back from its manifest, or from its cgroup when it has none."""
    manifest = store.manifests.read(owned.slot_id) if store.manifests else None
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
    with store.transaction():
        store.insert_slot(slot)
        if worker is not None:
            store.put_worker(worker)
        if manifest is not None:
            how += parts.ports.restore(slot.id, manifest)
        how += parts.identity.restore(slot.id, owned.pids, manifest)
        store.add_event("recover", f"slot {slot.name!r} rebuilt {how}", slot.id)
    report.recovered.append(slot.name)
    log.warning("slot recovered", extra={"slot": slot.id, "how": how})


def _build_ledger(
    steps: Sequencer, parts: SlotParts, store: StateStore, report: ReconcileReport
) -> Allocated:
    ledger = Allocated()
    for slot in store.list_slots():
        if not slot.holding or slot.assignment is None:
            continue
        try:
            ledger = ledger.add(slot.assignment)
        except (Conflict, InvalidRequest) as err:
            # Cannot happen through this manager; if the database says so anyway, the later slot yields.
            parts.ledger.set(ledger)
            steps.fail(dataclasses.replace(slot, state=SlotState.FAILED), f"on start: {err}")
            report.failed.append(slot.name)
    return ledger


def _reconcile_slot(
    steps: Sequencer, parts: SlotParts, store: StateStore, slot: Slot, report: ReconcileReport
) -> None:
    live = slot.state in (SlotState.READY, SlotState.RUNNING)
    if slot.state == SlotState.PENDING:
        try:
            steps.finish_pending(slot)
            report.finished_pending.append(slot.name)
        except NodeAgentError:
            report.failed.append(slot.name)
    elif live and parts.isolation.vanished(slot):
        try:
            steps.finish_pending(dataclasses.replace(slot, state=SlotState.PENDING))
            report.recreated.append(slot.name)
            store.add_event("recreate", "its cgroup had vanished; isolation re-applied", slot.id)
        except NodeAgentError:
            report.failed.append(slot.name)
    elif live and parts.isolation.resize_interrupted(slot):
        # A resize commits the new assignment before it changes the kernel and records what the
        # kernel holds after: killed in between, the cgroup still has the old CPUs. Finish it.
        try:
            steps.finish_pending(dataclasses.replace(slot, state=SlotState.PENDING))
            report.resized.append(slot.name)
            store.add_event("resize", "a resize the agent did not finish: isolation re-applied", slot.id)
        except NodeAgentError:
            report.failed.append(slot.name)


def _reconcile_worker(parts: SlotParts, slot: Slot, report: ReconcileReport, *, restart: bool) -> None:
    outcome = parts.workers.reconcile(slot, restart=restart)
    if outcome is Restored.ADOPTED:
        report.workers_adopted.append(slot.name)
    elif outcome in (Restored.EXITED, Restored.EXITED_AND_STARTED):
        report.workers_exited.append(slot.name)
    if outcome in (Restored.STARTED, Restored.EXITED_AND_STARTED):
        report.workers_started.append(slot.name)
