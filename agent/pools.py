"""Warm standby pools (docs/pools.md): N workers of one spec kept started, ready and frozen, so that
an allocate naming the pool gets a serving worker in milliseconds instead of its cold start.

What a standby is, in the kernel and the database: a slot of its own (named
``pool.<pool>.<suffix>``, schema/pool.py) with the pool's memory reserved on a NUMA node, its own
uid, sandbox, ports and (when the pool's slots have one) network namespace, in the burstable class
on the shared pool, without a CPU quota: it starts there at the default weight, never on an
exclusive core. Once its readiness probe passed, :meth:`SlotManager.freeze_standby` records it
``standby`` and freezes its cgroup: no CPU, memory kept. A claim (:meth:`Pools.claim`) places the
slot now, on the standby's NUMA node when placement would choose it, and
:meth:`SlotManager.take_standby` gives the standby that placement (moving it to the guaranteed
class's cgroup when the pool's slots are guaranteed), renames it, thaws it and probes it once.

This module holds the pools' specs and their policy: which standby a claim takes, keeping each
pool at its size in the background (one standby started per pool at a time), replacing standbys
that died frozen or failed to start, and removing what a deleted or shrunk pool no longer needs.
The manager owns every slot, and the memory standbys hold gives way to any allocate that needs it
(SlotManager._plan_making_room: lowest pool priority first).

After an agent restart, frozen standbys are left frozen (start-up supervises only ready and
running slots' workers), standbys still starting are re-adopted like any worker, and the first
:meth:`Pools.tend` checks each frozen one: gone or empty (its worker died while frozen) is dropped
and replaced, thawed (the agent died between the record and the freeze) is frozen again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodeagent.agent.service import AllocateResult
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.errors import Conflict, InvalidRequest, NodeAgentError, NotFound, WorkerError
from nodeagent.runtime.supervisor import Phase
from nodeagent.schema.pool import PoolClaim, PoolSpec, parse_pool_spec, standby_name
from nodeagent.schema.request import SlotRequest, request_to_dict

if TYPE_CHECKING:
    from nodeagent.agent.manager import SlotManager
    from nodeagent.agent.state import StateStore

log = logging.getLogger("nodeagent.pools")

#: A standby whose worker ended in one of these, or was restarted, failed to start: replaced.
_FAILED_PHASES = frozenset({Phase.EXITED, Phase.FAILED, Phase.STOPPED, Phase.CRASHLOOP, Phase.BACKOFF})
#: Standbys of one pool that failed to start in a row before its refill pauses.
MAX_FAILED_STARTS = 3
#: How long a pool whose standbys keep failing (or do not fit) waits before it tries again.
PAUSE_SECONDS = 30.0


@dataclass
class _PoolState:
    """What the loop keeps of a pool between rounds (not stored: derived again after a restart)."""

    spec: PoolSpec
    created_at: float
    failed_starts: int = 0
    paused_until: float = 0.0
    problem: str | None = None
    claims: int = 0
    cold_claims: int = 0
    taken: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class PoolView:
    """A pool as ``GET /v1/pools/{name}`` shows it."""

    spec: PoolSpec
    created_at: float
    standbys: tuple[Slot, ...]
    problem: str | None
    claims: int
    cold_claims: int

    def to_json(self) -> dict[str, Any]:
        frozen = [s for s in self.standbys if s.state == SlotState.STANDBY]
        return {
            "name": self.spec.name,
            "size": self.spec.size,
            "priority": self.spec.priority,
            "slot": self.spec.slot.model_dump(mode="json", exclude_unset=True),
            "created_at": self.created_at,
            "ready": len(frozen),
            "starting": len(self.standbys) - len(frozen),
            "memory_bytes": sum(s.assignment.memory_bytes for s in self.standbys if s.assignment is not None),
            "problem": self.problem,
            "claims": self.claims,
            "cold_claims": self.cold_claims,
            "standbys": [
                {
                    "id": s.id,
                    "name": s.name,
                    "state": str(s.state),
                    "numa_nodes": [] if s.assignment is None else list(s.assignment.numa_nodes),
                    "worker": None if s.worker is None else s.worker.to_json(),
                    "created_at": s.created_at,
                }
                for s in self.standbys
            ],
        }


class Pools:
    """The warm pools of one agent, and the thread that keeps them filled."""

    def __init__(
        self,
        manager: SlotManager,
        store: StateStore,
        *,
        period_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._manager = manager
        self._store = store
        self._period = period_seconds
        self._clock = clock
        self._lock = threading.RLock()
        self._pools: dict[str, _PoolState] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reserving = False  # CPUs are reserved for the next claims (_reserve_ahead)
        manager.attach_pools(self._rank, self._shape)

    # ------------------------------------------------------------------ life cycle

    def load(self) -> None:
        """Read the pools from the state database (after the manager's start-up reconcile)."""
        with self._lock:
            self._pools = {}
            for name, body, created in self._store.list_pools():
                try:
                    spec = parse_pool_spec(body)
                except InvalidRequest as err:
                    log.error(
                        "stored pool unreadable; its standbys go", extra={"pool": name, "reason": str(err)}
                    )
                    continue
                self._pools[name] = _PoolState(spec, created)

    def start(self) -> None:
        """Load the pools and keep them filled from a thread of their own."""
        self.load()
        self._manager.subscribe(self._on_change)
        self._thread = threading.Thread(target=self._run, name="nodeagent-pools", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _on_change(self) -> None:
        """A slot changed: tend now, where there is a pool to tend. With none, the wake would only
        hand the interpreter to this thread three times per allocate and release, for a round that
        finds nothing to do (what a standby of a pool gone leaves, the periodic round drops)."""
        if self._pools or self._reserving:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tend()
            except Exception:  # the loop must outlive one bad round
                log.exception("pool round failed")
            self._wake.wait(self._period)
            self._wake.clear()

    # ------------------------------------------------------------------ the API's calls

    def create(self, spec: PoolSpec) -> tuple[PoolView, bool]:
        """Add a pool; the same spec again is the existing pool (False), another spec of that name
        a Conflict."""
        with self._lock:
            current = self._pools.get(spec.name)
            if current is not None:
                if current.spec != spec:
                    raise Conflict(
                        f"pool {spec.name!r} exists with another spec; change its size with PATCH "
                        f"/v1/pools/{spec.name}, or delete it and create it again"
                    )
                return self._view(current), False
            self._store.check_space()
            self._store.put_pool(spec.name, spec.model_dump(mode="json", exclude_unset=True))
            state = self._pools[spec.name] = _PoolState(spec, self._clock())
            self._store.add_event("pool", f"pool {spec.name!r} created (size {spec.size})")
        self._wake.set()
        return self._view(state), True

    def resize(self, name: str, size: int) -> PoolView:
        with self._lock:
            state = self._get(name)
            spec = parse_pool_spec(state.spec.model_dump(mode="json", exclude_unset=True) | {"size": size})
            self._store.put_pool(name, spec.model_dump(mode="json", exclude_unset=True))
            state.spec = spec
            state.paused_until = 0.0
            self._store.add_event("pool", f"pool {name!r} resized to {size}")
        self._wake.set()
        return self._view(state)

    def delete(self, name: str) -> None:
        """Remove the pool and its standbys (slots already taken from it stay)."""
        with self._lock:
            self._get(name)
            self._store.delete_pool(name)
            del self._pools[name]
            self._store.add_event("pool", f"pool {name!r} deleted")
        for slot in self._manager.standby_slots(name):
            self._manager.drop_standby(slot.id, f"pool {name!r} deleted")

    def views(self) -> list[PoolView]:
        with self._lock:
            states = list(self._pools.values())
        return [self._view(s) for s in states]

    def get(self, name: str) -> PoolView:
        with self._lock:
            return self._view(self._get(name))

    def claim(self, claim: PoolClaim) -> AllocateResult:
        """Allocate slot ``claim.name`` from its pool: a frozen standby, placed and thawed now; with
        ``fallback: cold`` and none ready (or another shape asked for), a new slot whose worker
        starts cold. Idempotent by name like any allocate."""
        with self._lock:
            state = self._get(claim.pool)
            spec = state.spec
        request = spec.request(claim.name)
        mismatch = _shape_mismatch(spec, claim)
        existing = self._manager.find_slot(claim.name)
        if existing is not None:
            # The same claim again (or a name taken otherwise): the manager's idempotency rules.
            return self._manager.allocate(request)
        if mismatch is not None:
            if claim.fallback != "cold":
                raise InvalidRequest(
                    f"{mismatch}; the pool's workers were started for its shape (their thread counts "
                    "are sized for it), so ask for that shape, leave qos and resources out, or send "
                    '"fallback": "cold" to start the pool\'s worker cold in a slot of the shape asked for'
                )
            return self._cold(state, _claimed_shape(request, claim))
        for standby in self._preferred_standbys(spec, request):
            try:
                slot = self._manager.take_standby(standby.id, request)
            except WorkerError as err:
                log.warning("standby not usable; next one", extra={"slot": standby.id, "reason": str(err)})
                continue
            except NotFound:
                continue  # dropped meanwhile (its pool shrank, its worker died)
            with self._lock:
                state.claims += 1
            self._wake.set()
            return AllocateResult(slot, created=True)
        if claim.fallback == "cold":
            return self._cold(state, request)
        starting = len(self._manager.standby_slots(spec.name))
        raise Conflict(
            f"pool {spec.name!r} has no ready standby ({starting} starting, size {spec.size}); retry in a "
            'moment, grow the pool, or send "fallback": "cold" to start its worker in a new slot'
        )

    # ------------------------------------------------------------------ the loop

    def tend(self) -> None:
        """One round: freeze standbys that became ready, replace the dead and failed ones, and start
        or drop standbys until each pool has its size."""
        with self._lock:
            states = dict(self._pools)
        by_pool: dict[str, list[Slot]] = {}
        for slot in self._manager.standby_slots():
            by_pool.setdefault(slot.pool or "", []).append(slot)
        for name, slots in by_pool.items():
            if name not in states:
                for slot in slots:
                    self._manager.drop_standby(slot.id, f"its pool {name!r} no longer exists")
        for name, state in states.items():
            self._tend_pool(state, by_pool.get(name, []))
        self._reserve_ahead(states)

    def _reserve_ahead(self, states: dict[str, _PoolState]) -> None:
        """Keep the host off the exclusive CPUs each guaranteed pool's next claim will take (the
        standby a claim tries first, placed as now; a starting one while none is frozen):
        partitioning the host for a new exclusive CPU was 10-16 ms of a claim's ~45 here. Made
        again every round, so it follows what claims, releases and other allocations change."""
        claims: list[tuple[str, SlotRequest]] = []
        for state in states.values():
            spec = state.spec
            if spec.slot.qos != "guaranteed":
                continue
            # Any standby, starting ones too: the pass is then made while a refill starts, not
            # as its standby freezes, which is when the next claim may come.
            request = spec.request(spec.name)
            standbys = self._preferred_standbys(spec, request) or self._manager.standby_slots(spec.name)
            if standbys:
                claims.append((standbys[0].id, request))
        if claims or self._reserving:
            # (Nothing to reserve and nothing reserved: the manager's lock is not taken for nothing
            # each time a change wakes this loop.)
            self._manager.reserve_for_claims(claims)
            self._reserving = bool(claims)

    def _tend_pool(self, state: _PoolState, slots: list[Slot]) -> None:
        spec = state.spec
        kept: list[Slot] = []
        for slot in slots:
            if self._keep(state, slot):
                kept.append(slot)
        now = self._clock()
        if len(kept) > spec.size:
            # Starting ones first (they cost CPU now), then the newest frozen.
            extra = sorted(kept, key=lambda s: (s.state == SlotState.STANDBY, -s.created_at))[
                : len(kept) - spec.size
            ]
            for slot in extra:
                self._manager.drop_standby(slot.id, f"pool {spec.name!r} shrank to {spec.size}")
            return
        starting = [s for s in kept if s.state != SlotState.STANDBY]
        if len(kept) >= spec.size or starting or now < state.paused_until:
            return  # one standby starts at a time per pool: a refill never floods the shared pool
        name = standby_name(spec.name, secrets.token_hex(3))
        try:
            self._manager.allocate(spec.standby_request(name))
        except NodeAgentError as err:
            self._pause(state, f"cannot start a standby: {err}")
            return
        with self._lock:
            state.problem = None

    def _keep(self, state: _PoolState, slot: Slot) -> bool:
        """Advance one standby; False when it was dropped."""
        if slot.state == SlotState.STANDBY:
            found = self._manager.standby_kernel_state(slot)
            if found in ("gone", "empty"):
                self._manager.drop_standby(
                    slot.id, "its worker died while frozen" if found == "empty" else "its cgroup is gone"
                )
                return False
            if found == "thawed":
                self._manager.refreeze_standby(slot.id)
            return True
        if slot.state not in (SlotState.READY, SlotState.RUNNING):
            return slot.state == SlotState.PENDING
        worker = slot.worker
        if worker is None:
            return True
        if worker.phase is Phase.RUNNING and worker.restarts == 0:
            try:
                self._manager.freeze_standby(slot.id)
            except NodeAgentError as err:
                self._manager.drop_standby(slot.id, f"it could not be frozen: {err}")
                return False
            with self._lock:
                state.failed_starts = 0
            return True
        if worker.phase in _FAILED_PHASES or worker.restarts > 0:
            self._manager.drop_standby(slot.id, f"its worker did not start: {worker.message}")
            with self._lock:
                state.failed_starts += 1
                if state.failed_starts >= MAX_FAILED_STARTS:
                    self._pause(
                        state,
                        f"{state.failed_starts} standbys in a row failed to start; last: {worker.message}",
                    )
            return False
        return True

    def _pause(self, state: _PoolState, problem: str) -> None:
        with self._lock:
            state.problem = problem
            state.paused_until = self._clock() + PAUSE_SECONDS
            state.failed_starts = 0
        self._store.add_event("pool", f"pool {state.spec.name!r} paused {PAUSE_SECONDS:g}s: {problem}")
        log.warning("pool paused", extra={"pool": state.spec.name, "reason": problem})

    # ------------------------------------------------------------------ helpers

    def _cold(self, state: _PoolState, request: SlotRequest) -> AllocateResult:
        result = self._manager.allocate(request)
        with self._lock:
            state.cold_claims += 1
        return result

    def _preferred_standbys(self, spec: PoolSpec, request: SlotRequest) -> list[Slot]:
        """The pool's frozen standbys, those on the NUMA nodes placement would choose first."""
        frozen = [s for s in self._manager.standby_slots(spec.name) if s.state == SlotState.STANDBY]
        try:
            nodes = set(self._manager.preview(request).numa_nodes)
        except NodeAgentError:
            nodes = set()  # placement decides for each standby in turn (its memory given back first)
        frozen.sort(key=lambda s: s.created_at)
        frozen.sort(key=lambda s: not (s.assignment is not None and set(s.assignment.numa_nodes) <= nodes))
        return frozen

    def _get(self, name: str) -> _PoolState:
        state = self._pools.get(name)
        if state is None:
            raise NotFound(f"no pool named {name!r}; list pools with GET /v1/pools")
        return state

    def _view(self, state: _PoolState) -> PoolView:
        return PoolView(
            spec=state.spec,
            created_at=state.created_at,
            standbys=tuple(self._manager.standby_slots(state.spec.name)),
            problem=state.problem,
            claims=state.claims,
            cold_claims=state.cold_claims,
        )

    def _rank(self, pool: str) -> int:
        state = self._pools.get(pool)
        return -1 if state is None else state.spec.priority

    def _shape(self, pool: str) -> float | None:
        state = self._pools.get(pool)
        return None if state is None else state.spec.slot.resources.cpus or None


def _shape_mismatch(spec: PoolSpec, claim: PoolClaim) -> str | None:
    """What a claim asks for that the pool's slots are not; None when it asks for nothing else."""
    if claim.qos is not None and claim.qos != spec.slot.qos:
        return f"qos is {claim.qos!r} but pool {spec.name!r} hands out {spec.slot.qos} slots"
    if claim.resources is not None and claim.resources != spec.slot.resources:
        asked = claim.resources.model_dump(mode="json")
        pool = spec.slot.resources.model_dump(mode="json")
        differ = sorted(k for k in asked if asked[k] != pool.get(k))
        return f"resources differ from pool {spec.name!r}'s slot shape in {', '.join(differ)}"
    return None


def _claimed_shape(request: SlotRequest, claim: PoolClaim) -> SlotRequest:
    """The pool's request with the claim's own qos and resources (a cold fallback of another shape)."""
    body = request_to_dict(request)
    if claim.qos is not None:
        body["qos"] = claim.qos
    if claim.resources is not None:
        body["resources"] = claim.resources.model_dump(mode="json")
    return SlotRequest.model_validate(body | {"worker": request.worker}, strict=False)


__all__ = ["PoolView", "Pools"]
