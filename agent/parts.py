"""Parts of a slot that the manager sequences, one resource each, kubelet-cm style: what a slot
holds of it is reserved when the slot's worker needs it, shown in the slot's view, restored by
start-up reconciliation and freed with the slot. Each part owns its resource's rules and talks to
the state store itself; the manager (agent/manager.py) and start-up (agent/reconcile.py) call
these methods, never the store's tables of the resource.

- :class:`PortsPart`: the host ports a slot's worker listens on (runtime/ports.py), kept while the
  slot exists, published as the slot's endpoints.
- :class:`IdentityPart`: the slot's own uid for its sandboxed workers (``[sandbox] uid_range``),
  kept while the slot exists and quarantined after it; given back to a slot rebuilt after a lost
  database, or its worker ended.
- :class:`CdiPart`: the slot's CDI spec (agent/slot_cdi.py), written, removed and reconciled.
- :class:`LedgerPart`: what the slots hold of the host (placement's ledger), and the host
  partitioning that follows its exclusive CPUs.
- :class:`IsolationPart`: the slot's kernel objects (cgroups, cpuset, device rules, network)
  through the isolator, the one writer of a slot's cgroup; what start-up asks of them.
- The slot's worker is agent/slot_workers.py's :class:`~nodeagent.agent.slot_workers.WorkersPart`.
  :class:`SlotParts` holds them all, for the manager (the sequencer) and start-up.

Ports and uids go with the slot's row (the store deletes them with it), so releasing needs no
step here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodeagent.agent.sandbox import SandboxPolicy, taken_by_host
from nodeagent.agent.slot import Slot
from nodeagent.agent.slot_cdi import SlotCdiSpecs, check_container, try_cdi
from nodeagent.agent.state import StateStore, ports_from_record
from nodeagent.agent.translate import isolation_spec
from nodeagent.devices.topology import Topology
from nodeagent.errors import Conflict, NodeAgentError, Unsupported
from nodeagent.isolation.backend import IsolationBackend, OwnedSlot
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.isolation.partitioning import HostPartitioning
from nodeagent.isolation.qos import QosClassName
from nodeagent.isolation.slot_spec import SlotIsolationSpec
from nodeagent.kernelfs import Procfs
from nodeagent.placement import Allocated
from nodeagent.runtime.ports import Endpoint, SlotPort
from nodeagent.runtime.presets import wanted_ports
from nodeagent.schema.request import QOS_CLASSES
from nodeagent.schema.worker import WorkerSpec

if TYPE_CHECKING:
    from nodeagent.agent.slot_workers import WorkersPart
    from nodeagent.agent.worker_logs import WorkerLogs

log = logging.getLogger("nodeagent.manager")


class PortsPart:
    """The host ports of each slot's worker: the named ports of its spec (its preset's and its own),
    assigned from ``port_range`` where ``in_use`` says nothing outside the slots listens."""

    def __init__(self, store: StateStore, port_range: tuple[int, int], in_use: Callable[[int], bool]) -> None:
        self._store = store
        self._range = port_range
        self._in_use = in_use

    def reserve(self, slot_id: str, spec: WorkerSpec) -> list[SlotPort]:
        """The slot's ports for ``spec``, recorded; those it holds already are kept. Conflict when a
        port asked for is taken."""
        first, last = self._range
        return self._store.assign_ports(slot_id, wanted_ports(spec), first, last, self._in_use)

    def restore(self, slot_id: str, manifest: Mapping[str, Any]) -> str:
        """Give a slot rebuilt from its manifest the ports its worker listens on; what to add to
        the recovery's event ("" when they were restored)."""
        try:
            self._store.restore_ports(slot_id, ports_from_record(manifest))
        except (Conflict, KeyError, TypeError, ValueError) as err:
            return f"; its ports could not be restored ({err})"  # new ones at its next start
        return ""

    def view(self, slot: Slot) -> tuple[Endpoint, ...]:
        """Where the slot's worker serves: its own address when it has a network namespace, else
        the host's loopback."""
        network = slot.network
        address = str(network.slot_address) if network is not None else "127.0.0.1"
        return tuple(Endpoint(p.name, p.protocol, address, p.port) for p in self._store.slot_ports(slot.id))


class IdentityPart:
    """Each slot's own uid for its sandboxed workers, while the sandbox is active."""

    def __init__(self, store: StateStore, policy: SandboxPolicy | None, proc: Procfs | None = None) -> None:
        self._store = store
        self._policy = policy
        self._proc = proc or Procfs()

    @property
    def active(self) -> bool:
        return self._policy is not None and self._policy.active

    def reserve(self, slot_id: str) -> int | None:
        """The slot's uid, chosen now from the range (not one the host uses, not one resting after
        its slot's release) and kept in the database while the slot exists; None without a sandbox."""
        if self._policy is None or not self.active:
            return None
        config = self._policy.config
        return self._store.sandbox_uid(
            slot_id, *config.uid_bounds(), taken_by_host, config.uid_quarantine_seconds
        )

    def view(self, slot: Slot) -> int | None:
        return self._store.get_sandbox_uid(slot.id) if self.active else None

    def restore(self, slot_id: str, pids: Sequence[int], manifest: Mapping[str, Any] | None) -> str:
        """Give a rebuilt slot back the uid its worker runs as: the kernel's word (the uid of
        ``pids``, the processes in its cgroup) first, its manifest's second. A worker whose uid
        cannot be restored (another slot holds it, or it lies outside [sandbox] uid_range) is
        ended, so that the slot's next worker starts under a uid of its own instead of sharing one
        with another slot. Returns what to add to the recovery's event."""
        if self._policy is None or not self.active:
            return ""
        first, last = self._policy.config.uid_bounds()
        running = {uid for pid in pids if (uid := process_uid(pid, self._proc)) is not None}
        recorded = manifest.get("sandbox_uid") if manifest is not None else None
        candidates = sorted(running) or ([recorded] if isinstance(recorded, int) else [])
        if not candidates:
            return ""
        uid = candidates[0]
        problem = None
        if len(candidates) > 1:
            problem = f"its processes run as several uids ({', '.join(map(str, candidates))})"
        elif not first <= uid <= last:
            problem = f"uid {uid} lies outside [sandbox] uid_range {first}-{last}"
        else:
            try:
                self._store.restore_sandbox_uid(slot_id, uid)
            except Conflict as err:
                problem = str(err)
        if problem is None:
            return f"; its workers keep uid {uid}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return f"; its uid could not be restored ({problem}): its worker was ended and starts anew"


def process_uid(pid: int, proc: Procfs | None = None) -> int | None:
    """The real uid of a running process (None once it is gone)."""
    status = (proc or Procfs()).read_text(f"{pid}/status")
    for line in (status or "").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


class CdiPart:
    """Each slot's CDI spec (agent/slot_cdi.py), for container workers and runtimes outside the
    agent: written when the slot is ready and whenever what it says changes (resize, a new
    worker), removed with the slot, made to match the slots held at start. Without specs
    (``specs`` None) every step does nothing and a container worker is refused."""

    def __init__(
        self,
        specs: SlotCdiSpecs | None,
        store: StateStore,
        topology: Topology,
        shared_pool: Callable[[], frozenset[int]],
    ) -> None:
        self._specs = specs
        self._store = store
        self._topology = topology
        self._shared_pool = shared_pool

    def check(self, spec: WorkerSpec | None) -> None:
        """Unsupported when ``spec`` is a container worker and this agent writes no specs."""
        check_container(self._specs, spec)

    def apply(self, slot: Slot, worker: WorkerSpec | None = None) -> None:
        """(Re)write the slot's spec; ``worker``: its worker's spec, whose env may override the
        slot's wiring (default: the worker recorded, else the request's). A failure is logged."""
        if self._specs is None or slot.assignment is None:
            return
        if worker is None:
            stored = self._store.get_worker(slot.id)
            worker = stored.spec if stored is not None else slot.request.worker
        env = dict(worker.env) if worker is not None else {}
        try_cdi("written", slot.id, self._specs.write, slot, self._topology, self._shared_pool(), env)

    def release(self, slot_id: str) -> None:
        if self._specs is not None:
            try_cdi("removed", slot_id, self._specs.remove, slot_id)

    def reconcile(self, held: Sequence[Slot]) -> list[str]:
        """No spec of a slot the agent does not hold survives a start; every held one is written
        again (its devices or the agent's rules may have changed while it was down). Returns the
        slot ids whose specs were removed."""
        if self._specs is None:
            return []
        removed: list[str] = []
        try:
            removed = self._specs.remove_stale(s.id for s in held)
        except (NodeAgentError, OSError) as err:
            log.warning("stale CDI specs not removed", extra={"reason": str(err)})
        for slot in held:
            self.apply(slot)
        try_cdi("written", "-", self._specs.write_device_specs, self._topology)
        return removed

    def view(self, slot: Slot) -> dict[str, Any]:
        """The slot's spec as written (``nodeagent slots cdi NAME``)."""
        if self._specs is None:
            raise Unsupported(
                "this agent writes no CDI specs ([cdi] enabled = false, or slots are not isolated here)"
            )
        return self._specs.written(slot)


class LedgerPart:
    """What the slots hold of the host (placement's ledger), and the host partitioning that follows
    its exclusive CPUs: every change of what slots hold goes through :meth:`set`, and the host is
    confined or put back when the exclusive CPUs change. Allocate and resize change the ledger
    before isolation gives a slot its CPUs, release after the slot is gone, so the host is confined
    before a worker can run there and put back only once nothing runs there. Start-up
    (agent/reconcile.py) holds the host still (:meth:`hold_host`) until it knows which exclusive
    CPUs the slots hold, then makes the host match them in one pass (:meth:`follow`)."""

    def __init__(self, host: HostPartitioning | None) -> None:
        self._host = host
        self._held = Allocated()
        self._reserved: frozenset[int] = frozenset()
        self._predict: Callable[[Allocated], frozenset[int]] | None = None
        self._following = False
        # Passes over the host are serialised here and each makes the host match the ledger and
        # reservation as they are when it runs, so a pass made outside the manager's lock (a
        # reservation's) can never put back what a later allocation confined.
        self._host_lock = threading.Lock()
        self._partitioned: frozenset[int] | None = None  # what the last pass confined

    @property
    def held(self) -> Allocated:
        return self._held

    @property
    def reserved(self) -> frozenset[int]:
        """CPUs the host is kept off ahead of the claims that will take them (:meth:`predict`)."""
        return self._reserved

    def set(self, ledger: Allocated) -> None:
        """What the slots hold now; the reservation is predicted again and the host follows at
        once, in one pass (the caller holds the manager's lock)."""
        self._held = ledger
        if self._predict is not None:
            self._reserved = self._predict(ledger) - ledger.cpus
        if self._held.cpus | self._reserved != self._partitioned:
            self.sync_host()

    def predict(self, reserve: Callable[[Allocated], frozenset[int]] | None) -> bool:
        """Keep the host off ``reserve(held)`` too, CPUs no slot holds yet: the exclusive CPUs the
        next claims of warm pools will take, predicted again at every :meth:`set`. A claim then
        finds the host already confined and makes no partitioning pass of its own (10-16 ms of a
        claim on this machine kind, issue 25). The reservation holds nothing in the ledger:
        placement may give the CPUs to anyone. Returns whether the host must follow
        (:meth:`sync_host`, which the caller may run outside its lock)."""
        self._predict = reserve
        self._reserved = frozenset() if reserve is None else reserve(self._held) - self._held.cpus
        return self._held.cpus | self._reserved != self._partitioned

    def sync_host(self) -> None:
        """Make the host match what slots hold and what is reserved, as they are now."""
        if self._host is None or not self._following:
            return
        with self._host_lock:
            wanted = self._held.cpus | self._reserved
            if wanted != self._partitioned:
                self._host.partition(wanted)
                self._partitioned = wanted

    def hold_host(self) -> None:
        self._following = False

    def follow(self) -> None:
        """From now on the host follows the ledger; made to match it now."""
        self._following = True
        if self._host is not None:
            with self._host_lock:
                wanted = self._held.cpus | self._reserved
                self._host.partition(wanted)
                self._partitioned = wanted


class IsolationPart:
    """Each slot's kernel objects (its cgroups, cpuset, memory, device rules and network namespace)
    through the isolation backend, which is the one writer of a slot's cgroup (the QoS loop's
    limits go through the same isolator). What isolation builds for a slot is derived from the
    slot once per change and remembered with its assignment, so the worker's device nodes need no
    second derivation."""

    def __init__(self, backend: IsolationBackend, topology: Topology) -> None:
        self._backend = backend
        self._topology = topology
        #: slot id -> the spec last built for it, and the assignment it was built from
        self._specs: dict[str, tuple[object, SlotIsolationSpec]] = {}

    @property
    def backend(self) -> IsolationBackend:
        return self._backend

    @property
    def isolates(self) -> bool:
        return self._backend.isolates

    def spec(self, slot: Slot) -> SlotIsolationSpec:
        """What isolation builds for ``slot`` (its assignment's devices resolved to their nodes)."""
        # What the spec is built from: the assignment, the request (resources, class, worker
        # kind) and whether the slot is a pool's standby.
        source = (slot.assignment, slot.request, slot.pool)
        known = self._specs.get(slot.id)
        if known is not None and known[0] == source:
            return known[1]
        spec = isolation_spec(slot, self._topology)
        self._specs[slot.id] = (source, spec)
        return spec

    def apply(self, slot: Slot) -> AppliedSlot | None:
        """Build (or bring up to date: apply is idempotent) the slot's kernel objects. A slot whose
        recorded class differs from its request's is a claim on a warm pool that the agent died in:
        its processes still sit in the standby's cgroup (or were moved but not recorded), so they
        are moved into the class's cgroup and thawed."""
        spec = self.spec(slot)
        before = slot.applied
        if before is not None and before.qos != spec.qos and before.qos in QOS_CLASSES:
            applied = self._backend.change_class(spec, before.qos)
            self._backend.thaw(slot.id, spec.qos)
            return applied
        return self._backend.apply(spec)

    def take(self, slot: Slot, from_qos: QosClassName) -> AppliedSlot | None:
        """A frozen standby made the slot ``slot`` says: moved from its class's cgroup into its
        own class's and thawed."""
        applied = self._backend.change_class(self.spec(slot), from_qos)
        self._backend.thaw(slot.id, slot.qos)
        return applied

    def release(self, slot_id: str) -> None:
        """Remove the slot's kernel objects (its processes killed); the remembered spec goes too."""
        self._backend.release(slot_id)
        self._specs.pop(slot_id, None)

    def vanished(self, slot: Slot) -> bool:
        """Whether a ready or running slot's cgroup is gone (removed behind the agent's back)."""
        if not self.isolates:
            return False
        return slot.applied is None or not self._backend.exists(slot.applied)

    def resize_interrupted(self, slot: Slot) -> bool:
        """Whether the stored kernel state is older than the stored assignment: an exclusive slot's
        CPUs (or an online slot's memory limit) differ between the two. A resize commits the new
        assignment before it changes the kernel, so an agent killed in between leaves this."""
        applied, assignment = slot.applied, slot.assignment
        if not self.isolates or applied is None or assignment is None:
            return False
        if assignment.exclusive and applied.cpus != frozenset(assignment.cpus):
            return True
        # Guaranteed and burstable slots are limited at their assignment (best-effort at a multiple).
        online = slot.request.qos != "best-effort"
        return online and applied.memory_max is not None and applied.memory_max != assignment.memory_bytes

    def owned(self) -> list[OwnedSlot]:
        """The slots the kernel holds under the agent's prefixes, with their processes."""
        return self._backend.owned_slots()

    def remove_orphans(self, keep: Collection[str]) -> list[str]:
        """Remove kernel objects of slots other than ``keep``; their slot ids."""
        for gone in set(self._specs) - set(keep):
            del self._specs[gone]
        return self._backend.remove_orphans(keep)

    def prepare(self) -> None:
        """Set up the shared parents (class cgroups, the firewall table) before slots are applied."""
        self._backend.prepare()


@dataclass(frozen=True)
class SlotParts:
    """The parts of a slot, in the order the sequencer builds them (and the reverse order it
    takes them down): what the slots hold, their kernel objects, ports, uid, CDI spec, worker, and
    the worker's output."""

    ledger: LedgerPart
    isolation: IsolationPart
    ports: PortsPart
    identity: IdentityPart
    cdi: CdiPart
    workers: WorkersPart
    logs: WorkerLogs


__all__ = [
    "CdiPart",
    "IdentityPart",
    "IsolationPart",
    "LedgerPart",
    "PortsPart",
    "SlotParts",
    "process_uid",
]
