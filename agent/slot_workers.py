"""The slot's worker as a part of the slot (agent/parts.py has the others): what a worker spec
must satisfy before anything is placed, the supervisor each worker gets (its preset resolved
with the slot's ports, its sandbox with the slot's uid and device nodes), the supervision loop
that keeps them, each worker's last status (and the slot's running/ready state that follows it),
and what start-up does with the workers the last agent left.

The worker's kind (a process through the keeper, or a container through podman) is chosen once,
by runtime/worker_kind.py, and answered there; nothing here asks whether a spec is a container.
The manager (agent/manager.py, the sequencer) calls this part under its lock; the supervision
loop's thread takes the same lock before it records a status.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from enum import Enum

from nodeagent.agent.parts import CdiPart, IdentityPart, IsolationPart, PortsPart
from nodeagent.agent.sandbox import SandboxPolicy, check_private_sizes, slot_device_paths
from nodeagent.agent.slot import Slot, SlotState, Worker
from nodeagent.agent.state import StateStore
from nodeagent.agent.translate import slot_description
from nodeagent.errors import Conflict, InsufficientStorage, InvalidRequest, WorkerError
from nodeagent.runtime.limits import RlimitCeilings
from nodeagent.runtime.presets import FindProgram, bind_address, only_argv_resolved, resolve
from nodeagent.runtime.supervision import SupervisionLoop
from nodeagent.runtime.supervisor import ALIVE_PHASES, Phase, Supervisor, WorkerStatus
from nodeagent.runtime.worker_kind import kind_of, slot_kind
from nodeagent.runtime.workers import Readoption, WorkerRuntime
from nodeagent.schema.worker import WorkerSpec

log = logging.getLogger("nodeagent.manager")


class Restored(Enum):
    """What start-up did with a slot's stored worker (:meth:`WorkersPart.reconcile`)."""

    NOTHING = "nothing"
    ADOPTED = "adopted"
    EXITED = "exited"
    STARTED = "started"
    EXITED_AND_STARTED = "exited and started"
    UNSUPERVISED = "unsupervised"


class WorkersPart:
    """Each slot's worker: checked, launched, supervised, stopped, re-adopted at start-up, and its
    directory discarded with the slot. ``lock`` is the manager's: the supervision loop's thread
    takes it before it records a status; ``notify`` tells the manager's subscribers."""

    def __init__(
        self,
        store: StateStore,
        runtime: WorkerRuntime,
        lock: threading.RLock,
        notify: Callable[[], None],
        *,
        isolation: IsolationPart,
        ports: PortsPart,
        identity: IdentityPart,
        cdi: CdiPart,
        sandbox: SandboxPolicy | None,
        find_program: FindProgram | None,
        rlimit_ceilings: RlimitCeilings,
        host_memory: int,
        shared_pool: Callable[[], frozenset[int]],
        tick_seconds: float = 0.5,
    ) -> None:
        self._store = store
        self._runtime = runtime
        self._isolation = isolation
        self._ports = ports
        self._identity = identity
        self._cdi = cdi
        self._sandbox = sandbox
        self._find_program = find_program
        self._rlimit_ceilings = rlimit_ceilings
        self._host_memory = host_memory
        self._shared_pool = shared_pool
        self._status: dict[str, WorkerStatus] = {}
        self._loop = SupervisionLoop(lock, self.record_status, notify, tick_seconds=tick_seconds)
        #: The CPUs a pool's slots get (agent/pools.py), for its standbys' thread counts.
        self.pool_shape: Callable[[str], float | None] | None = None

    # ------------------------------------------------------------------ before anything is placed

    def check(self, spec: WorkerSpec) -> None:
        """Everything the agent alone can say of a worker spec, before anything is placed or built
        (the schema checked the rest at the edge): a preset that lacks a field or a program that is
        not there, rlimits above the agent's own, private mounts larger than the host's memory, a
        sandbox opt-out the policy refuses (or a piece the host lacks), host paths its arguments
        may not name, a container on an agent that writes no CDI specs."""
        resolved = resolve(spec, find=self._find_program)
        self._rlimit_ceilings.check(spec.rlimits)
        check_private_sizes(spec, self._host_memory)
        if self._sandbox is not None:
            self._sandbox.check(spec)
            self._sandbox.check_arguments(resolved)
        self._cdi.check(spec)

    @staticmethod
    def check_runs_in(slot: Slot, spec: WorkerSpec) -> None:
        """Conflict when ``spec``'s kind cannot run in ``slot`` (a container needs a slot made for
        containers: its device cgroup admits the OCI runtime; a process runs in either)."""
        if not kind_of(spec).runs_in(slot_kind(slot.request)):
            raise Conflict(
                f"slot {slot.name!r} was allocated without a container worker, so its device cgroup "
                "does not admit a container runtime below it; allocate a slot whose request has "
                "worker.container"
            )

    # ------------------------------------------------------------------ the supervision loop

    def open(self) -> None:
        self._loop.open()

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        self._loop.close()
        self._runtime.close()

    def tick_all(self) -> None:
        """Advance every supervisor once and record what changed (tests drive this)."""
        self._loop.tick_all()

    def alive(self) -> list[tuple[str, Supervisor]]:
        """The slots whose worker is alive now (starting, running or stopping), with its supervisor."""
        return [(slot_id, sup) for slot_id, sup in self._loop.items() if sup.phase in ALIVE_PHASES]

    def supervise(self, slot_id: str, supervisor: Supervisor, status: WorkerStatus) -> None:
        """Keep ``supervisor`` in the loop, its ``status`` recorded (a standby taken by a claim)."""
        self._loop.add(slot_id, supervisor)
        self.record_status(slot_id, status)

    def unsupervise(self, slot_id: str) -> WorkerStatus | None:
        """Stop supervising the slot's worker (it is frozen, or its slot is gone); its last status."""
        self._loop.remove(slot_id)
        return self._status.pop(slot_id, None)

    def remove(self, slot_id: str) -> Supervisor | None:
        """Take the slot's supervisor out of the loop, to stop its worker outside the lock."""
        return self._loop.remove(slot_id)

    # ------------------------------------------------------------------ workers

    def supervisor(self, slot: Slot, spec: WorkerSpec) -> Supervisor:
        """The supervisor of ``spec`` in ``slot``: the preset resolved with the slot's ports and
        its address, the sandbox with the slot's uid and device nodes; nothing is started."""
        description = slot_description(slot, self._shared_pool())
        shape = self.pool_shape(slot.pool) if slot.pool is not None and self.pool_shape else None
        if shape is not None:
            # A standby starts with the thread counts of the slots its pool hands out.
            description = dataclasses.replace(description, cpu_quota=shape)
        ports = self._ports.reserve(slot.id, spec)
        resolved = resolve(
            spec,
            {p.name: p.port for p in ports},
            find=self._find_program,
            listen_on=bind_address(own_network=slot.network is not None),
        )
        sandbox = None
        uid = self._identity.reserve(slot.id)  # kept while the slot exists (freed with its row)
        if self._sandbox is not None and uid is not None:
            isolated = self._isolation.spec(slot)
            devices = slot_device_paths(isolated.device_paths, isolated.gpu)
            sandbox = self._sandbox.spec_for(resolved, uid=uid, devices=devices)
        supervisor = self._runtime.supervisor(description, slot.applied, resolved, sandbox)
        if only_argv_resolved(spec, resolved):
            # The launch request carries the resolved argv; the rest is the client's spec, which
            # the slot's request and worker row hold already: one spec per slot, not two.
            supervisor.spec = spec
        return supervisor

    def launch(self, slot: Slot, spec: WorkerSpec) -> None:
        """Start ``spec``'s worker in ``slot`` and supervise it (its row is already stored)."""
        supervisor = self.supervisor(slot, spec)
        supervisor.start()
        self._loop.add(slot.id, supervisor)
        try:
            with self._store.transaction(durable=False):
                self.record_status(slot.id, supervisor.status())
                self._store.add_event("worker", f"worker of {slot.name!r}: {supervisor.message}", slot.id)
        except InsufficientStorage as err:
            # The worker runs and the service shows its status from memory; the stored copy only
            # matters after a restart, which derives it again. The operation itself succeeded.
            log.warning("worker status not stored", extra={"slot": slot.id, "reason": str(err)})

    def running_same(self, slot: Slot, spec: WorkerSpec) -> bool:
        """True when ``spec``'s worker already runs in ``slot`` (a retried start); Conflict when
        another one runs there."""
        current = self._loop.get(slot.id)
        if current is None or current.phase not in ALIVE_PHASES:
            return False
        stored = self._store.get_worker(slot.id)
        if stored is not None and stored.spec == spec:
            return True
        raise Conflict(f"slot {slot.name!r} already runs a worker; stop it first")

    def store_wanted(self, slot: Slot, spec: WorkerSpec) -> None:
        """Record ``spec`` as the slot's worker, meant to run, with its ports, in one commit: before
        the launch, since a worker the database does not name would be an orphan after a crash."""
        with self._store.transaction():
            self._ports.reserve(slot.id, spec)
            self._store.put_worker(Worker(slot_id=slot.id, spec=spec, desired="running"))

    def stop(self, slot: Slot, event: tuple[str, str], *, desired_stopped: bool) -> bool:
        """Stop the slot's worker (its stop signal, grace and pre-stop as its spec says), the
        supervisor kept so that a later start or restore finds it; ``desired_stopped``: the
        operator's wish is recorded, so neither its restart policy nor the next agent starts it.
        False when it has no worker alive."""
        supervisor = self._loop.get(slot.id)
        if supervisor is None or (not desired_stopped and supervisor.phase not in ALIVE_PHASES):
            return False
        if desired_stopped:
            self._store.update_worker(slot.id, desired="stopped")
        supervisor.stop()
        self.record_status(slot.id, supervisor.tick())
        self._loop.schedule(slot.id)
        self._store.add_event(event[0], event[1], slot.id)
        return True

    def restore(self, slot: Slot, event: tuple[str, str]) -> bool:
        """Start an evicted worker again; False when it was stopped by the operator meanwhile
        (desired stopped), is already running, or is not supervised."""
        supervisor = self._loop.get(slot.id)
        worker = self._store.get_worker(slot.id)
        if supervisor is None or worker is None or worker.desired != "running":
            return False
        if supervisor.phase in ALIVE_PHASES:
            return False
        supervisor.start()
        self.record_status(slot.id, supervisor.status())
        self._loop.schedule(slot.id)
        self._store.add_event(event[0], event[1], slot.id)
        return True

    @staticmethod
    def stop_and_wait(supervisor: Supervisor) -> None:
        """Graceful stop: drain and pre_stop, the stop signal, the spec's grace period, then the
        cgroup is killed."""
        supervisor.stop()
        spec = supervisor.spec
        hook = spec.pre_stop.timeout_seconds if spec.pre_stop is not None else 0.0
        deadline = time.monotonic() + max(spec.drain_seconds, hook) + spec.stop_grace_seconds + 10
        while supervisor.tick().phase in ALIVE_PHASES and time.monotonic() < deadline:
            time.sleep(0.01)

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        """Resume the worker last launched for the slot into ``supervisor`` (a standby's thawed one)."""
        return self._runtime.readopt(slot_id, supervisor)

    def discard(self, slot: Slot, *, keep_logs: bool, last_word: str | None = None) -> None:
        """Remove the slot's worker directory (its logs kept under its name when ``keep_logs``)."""
        self._runtime.discard(
            slot.id,
            keep_logs_as=slot.name if keep_logs else None,
            last_word=last_word,
            kind=slot_kind(slot.request),
        )

    def reap(self, keep: Iterable[str]) -> list[str]:
        """Remove the worker directories of slots other than ``keep``; their slot ids."""
        return self._runtime.reap(keep)

    # ------------------------------------------------------------------ status

    def status(self, slot: Slot) -> WorkerStatus | None:
        """The worker's status as of now (a restart's countdown included), or as stored when this
        agent has not supervised it."""
        status = self._status.get(slot.id)
        if status is None:
            stored = self._store.get_worker(slot.id)
            return None if stored is None else stored.status
        if status.next_restart_in is not None:
            supervisor = self._loop.get(slot.id)
            if supervisor is not None:
                return supervisor.status()  # the countdown as of now, not as of the last tick
        return status

    def record_status(self, slot_id: str, status: WorkerStatus) -> bool:
        """Persist a worker's new status (and its slot's running/ready state); True when it changed."""
        previous = self._status.get(slot_id)
        self._status[slot_id] = status
        if previous is not None and previous.same_as(status):
            return False
        slot = self._store.get_slot(slot_id)
        if slot is None:
            return False
        # A status is derived again after a restart (re-adoption): not worth waiting for the disk.
        with self._store.transaction(durable=False):
            self._store.update_worker(slot_id, status=status)
            wanted = SlotState.RUNNING if status.phase is Phase.RUNNING else SlotState.READY
            if slot.state in (SlotState.READY, SlotState.RUNNING) and slot.state != wanted:
                self._store.update_slot(dataclasses.replace(slot, state=wanted))
        if previous is None or previous.phase is not status.phase:
            self._store.add_event("worker", f"worker {status.phase}: {status.message}", slot_id)
        return True

    # ------------------------------------------------------------------ start-up

    def reconcile(self, slot: Slot, *, restart: bool = False) -> Restored:
        """What start-up does with the slot's stored worker: a live one is re-adopted, a dead one
        recorded (its restart policy applies), one wanted but never launched is launched, and every
        one is supervised again. ``restart``: the last agent stopped it when it was stopped, so it
        comes back whatever its restart policy says of an exit."""
        worker = self._store.get_worker(slot.id)
        if worker is None or slot.state not in (SlotState.READY, SlotState.RUNNING):
            return Restored.NOTHING
        try:
            supervisor = self.supervisor(slot, worker.spec)
        except (InvalidRequest, WorkerError, Conflict) as err:
            self._store.add_event("worker", f"cannot supervise the stored worker: {err}", slot.id)
            return Restored.UNSUPERVISED
        found = self._runtime.readopt(slot.id, supervisor)
        outcome = {
            Readoption.ADOPTED: Restored.ADOPTED,
            Readoption.EXITED: Restored.EXITED,
            Readoption.NONE: Restored.NOTHING,
        }[found]
        if found is not Readoption.NONE and worker.desired == "stopped":
            supervisor.stop()
        elif found is Readoption.NONE and worker.desired == "running":
            supervisor.start()
            outcome = Restored.STARTED
        elif found is Readoption.EXITED and worker.desired == "running" and restart:
            supervisor.start()
            outcome = Restored.EXITED_AND_STARTED
        self._loop.add(slot.id, supervisor)
        self.record_status(slot.id, supervisor.status())
        return outcome


__all__ = ["Restored", "WorkersPart"]
