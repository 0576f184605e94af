"""The QoS loop: online slots first, best-effort work in what they leave idle (docs/colocation.md).

Every ``period_seconds`` the loop, on a thread of its own:

1. samples the kernel (:class:`~nodeagent.isolation.colocation_kernel.Sampler`): per-CPU busy time,
   node memory, PSI, the online groups and each best-effort slot;
2. decides (:func:`~nodeagent.isolation.colocation.decide`, pure): best-effort's cpuset and quota,
   per-priority quotas, memory throttling, evictions and restores, and the batch capacity;
3. acts: kernel writes through the :class:`~nodeagent.isolation.colocation_kernel.Actuator`,
   evictions and restores through the slot manager (it stops and starts the worker; the slot
   stays). An evicted worker's desired state stays ``running``: the loop starts it again once memory
   has been calm for ``restore_after_seconds`` (and an agent restart starts it at once);
4. records each action once: on the slot (``qos_actions`` in ``GET /v1/slots/{id}``, the newest
   last; ``qos_evicted`` while its worker is out), in ``/metrics``
   (``nodeagent_qos_actions_total{action}``), in the log, and so in the controller's heartbeat
   (the slot summaries and ``capacity.batch``). Evictions and restores are also events of the
   state store and wake the reporter at once.

The manager sees the loop through :class:`~nodeagent.agent.service.QosView`: the batch view in
``capacity()``, the per-slot view, and best-effort admission bounded by batch capacity when
``[qos] best_effort_admission = "batch"``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeagent.agent.nri import is_container_slot
from nodeagent.cpulist import format_cpulist
from nodeagent.errors import NodeAgentError, PlacementError
from nodeagent.isolation.colocation import (
    ACTION_KINDS,
    SLOT_DETAIL_EVERY,
    Action,
    Batch,
    ColocationConfig,
    Decision,
    LoopState,
    Measured,
    decide,
    needs_slot_detail,
)
from nodeagent.isolation.colocation_kernel import Actuator, Sampler, SlotInfo, hold_cpu_quota
from nodeagent.isolation.memory_traffic import LLC_MISSES, MemoryTraffic, probe
from nodeagent.runtime.supervisor import ALIVE_PHASES
from nodeagent.schema.request import MILLI, SlotRequest

if TYPE_CHECKING:
    from nodeagent.agent.config import AgentConfig
    from nodeagent.agent.manager import SlotManager
    from nodeagent.agent.slot import Slot
    from nodeagent.isolation.resctrl import Resctrl

log = logging.getLogger("nodeagent.qos")

#: Actions kept per slot for GET /v1/slots/{id} (and the heartbeat's slot summaries).
RECENT_ACTIONS = 20
#: Best-effort processes are tended at least this often even without a change notice: a worker's
#: own children inherit what tending gives it, but a process put into the slot from outside (a
#: container runtime's, an operator's) does not. At 10 s it was 0.3 % of a core at 500 slots.
REFRESH_SECONDS = 30.0
#: The slot list is read again at least this often even without a change notice: a safety net
#: only, since every change the loop follows (allocate, release, a worker's status) comes with a
#: notice. Listing 500 slots was half of a 30 s refresh's cost (issue 23).
RELIST_SECONDS = 300.0


@dataclass
class _Evicted:
    at: float
    seen_stopped: bool = False


class QosLoop:
    """Samples, decides and acts once per period (``run_once``; ``start`` runs it on a thread)."""

    def __init__(
        self,
        manager: SlotManager,
        sampler: Sampler,
        actuator: Actuator,
        config: ColocationConfig,
        *,
        evict_grace_seconds: float = 5.0,
        admission: str = "allocatable",
        best_effort_overcommit: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.manager = manager
        self.sampler = sampler
        self.actuator = actuator
        self.config = config
        self.evict_grace_seconds = evict_grace_seconds
        self.admission = admission
        self.best_effort_overcommit = best_effort_overcommit
        self._clock = clock
        self._wall = wall
        self._state = LoopState()
        self._online_outside = False  # online slots whose work runs outside their cgroup (NRI)
        self._best_effort_ids: list[str] = []
        self._priorities = 0
        self._infos: list[SlotInfo] = []
        self._dirty = True
        self._listed_at = -RELIST_SECONDS
        self._tended_at = -REFRESH_SECONDS
        self._tended_cpu_ns: int | None = None  # best-effort's CPU time as of the last tending
        self._evicted: dict[str, _Evicted] = {}
        # What API and scrape threads read (recent actions, evictions, counts) while the loop writes.
        self._views_lock = threading.Lock()
        self._recent: dict[str, collections.deque[dict[str, Any]]] = {}
        self._sequence = itertools.count(1)
        self._batch: Batch | None = None
        self._measured: Measured | None = None
        self._measured_at: float | None = None
        self.counts: dict[str, int] = dict.fromkeys(ACTION_KINDS, 0)
        self.errors = 0
        self.busy_seconds = 0.0
        self.periods = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Subscribe to the manager's changes and run a period every ``period_seconds``."""
        if self._thread is not None:
            return
        self.manager.subscribe(self._on_change)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nodeagent-qos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread. Kernel state stays as it is: best-effort keeps its limit while the agent
        is away (its workers outlive the agent), and the next start takes over from there."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(10)
        if self.sampler.traffic is not None:
            self.sampler.traffic.close()  # the cache-miss counters of best-effort's processes

    def _run(self) -> None:
        period = self.config.period_seconds
        deadline = self._clock()
        while not self._stop.is_set():
            self.run_once()
            deadline += period
            now = self._clock()
            deadline = max(deadline, now)  # fell behind (a slow period): go on from now, skip none
            self._stop.wait(max(0.0, deadline - now))

    def _on_change(self) -> None:
        self._dirty = True

    # ------------------------------------------------------------------ one period

    def run_once(self) -> Decision | None:
        """One period: sample, decide, act, record. Errors are logged and counted, never raised."""
        began = time.thread_time()
        try:
            return self._period()
        except NodeAgentError as err:
            self._error(f"period skipped: {err}")
            return None
        finally:
            self.busy_seconds += time.thread_time() - began
            self.periods += 1

    def _period(self) -> Decision:
        now = self._clock()
        changed = self._dirty
        tend_due = changed or now - self._tended_at >= REFRESH_SECONDS
        infos = self._slot_infos()
        priorities = self._priorities
        detail_due = self.periods % SLOT_DETAIL_EVERY == 0
        state = self._state
        sample = self.sampler.sample(
            infos,
            now,
            read_slots=lambda partial: (
                detail_due or needs_slot_detail(self.config, state, partial, priorities=priorities)
            ),
        )
        if self.actuator.resctrl_ready:
            sample = replace(sample, resctrl_group=True)  # its share follows online load
        config = self.config
        if self._online_outside and not config.host_cpu_as_online:
            config = replace(config, host_cpu_as_online=True)
        decision = decide(config, self._state, sample)
        self._state = decision.state
        best_effort = self._best_effort_ids
        for action in decision.actions:
            self._carry_out(action, best_effort)
        if tend_due and (changed or self._best_effort_ran_since_tended(sample.best_effort_cpu_ns)):
            # Children inherit oom_score_adj and the resctrl group from the process they fork
            # from, so a worker's processes need tending when it starts (a change notice), and
            # the periodic tending catches what slipped between.
            self._tended_at = now
            self._tended_cpu_ns = sample.best_effort_cpu_ns
            try:
                self.actuator.tend(best_effort)
            except NodeAgentError as err:
                self._error(f"best-effort processes not tended: {err}")
        self._escalate(now)
        if decision.measured is not None:
            self._measured = decision.measured
            self._measured_at = self._wall()
        if decision.batch is not None:
            self._batch = decision.batch
        return decision

    def _best_effort_ran_since_tended(self, cpu_ns: int | None) -> bool:
        """Whether the best-effort class used CPU since its processes were last tended: the
        periodic tending waits for that, and then comes at the next period. A process put into a
        slot from outside competes for no CPU and allocates nothing until it runs (its memory so
        far was charged where it was); what it keeps until then is its OOM score, as it had it
        outside. At 500 idle best-effort slots, 500 cgroup.procs files every 30 s not read
        (issue 23)."""
        return cpu_ns is None or cpu_ns != self._tended_cpu_ns

    def _slot_infos(self) -> list[SlotInfo]:
        now = self._clock()
        if not self._dirty and now - self._listed_at < RELIST_SECONDS:
            return self._infos
        self._dirty = False
        self._listed_at = now
        slots = self.manager.list_slots()
        # Where the host has resctrl, (re)make best-effort's group: a start's reconcile removes it
        # as an orphan, and a new exclusive slot group rewrites it.
        self.actuator.prepare_resctrl()
        self._infos = [self._info(s) for s in slots if s.holding and s.cgroup is not None]
        # Kept with the list, not counted again each period (500 slots: a period's own cost).
        self._best_effort_ids = [i.slot_id for i in self._infos if i.qos == "best-effort"]
        self._priorities = len({i.priority for i in self._infos if i.qos == "best-effort"})
        # A Kubernetes container placed through NRI runs in the kubelet's cgroup, not its slot's:
        # the burstable class's CPU time does not hold its use, which the loop can then tell from
        # the host's only by counting both as online work.
        self._online_outside = any(s.holding and s.qos == "burstable" and is_container_slot(s) for s in slots)
        return self._infos

    def _info(self, slot: Slot) -> SlotInfo:
        worker = slot.worker
        running = worker is not None and worker.phase in ALIVE_PHASES
        memory = slot.request.resources.memory_bytes
        return SlotInfo(
            slot_id=slot.id,
            qos=slot.qos,
            priority=slot.request.priority,
            started_at=slot.created_at,
            memory_high=memory or None,
            running=running,
            evicted=slot.id in self.evicted,
        )

    def _carry_out(self, action: Action, best_effort: list[str]) -> None:
        try:
            if action.kind == "evict":
                assert action.slot_id is not None
                if not self.manager.evict_worker(action.slot_id, action.reason):
                    self._forget(action)
                    return
                with self._views_lock:
                    self._evicted[action.slot_id] = _Evicted(self._clock())
                self._dirty = True
            elif action.kind == "restore":
                assert action.slot_id is not None
                with self._views_lock:
                    self._evicted.pop(action.slot_id, None)
                self._dirty = True
                if not self.manager.restore_worker(action.slot_id, action.reason):
                    return
            else:
                self.actuator.apply(action)
        except NodeAgentError as err:
            self._error(f"{action.kind} not carried out ({action.reason}): {err}")
            self._forget(action)
            return
        self._record(action, best_effort)

    def _forget(self, action: Action) -> None:
        """The loop's state says an action took effect that did not: make the next period try again."""
        state = self._state
        if action.kind in ("cpu_suppress", "cpu_release"):
            self._state = replace(state, cpu_limit=None)
        elif action.kind == "slot_cpu_quota" and action.slot_id is not None:
            self._state = replace(
                state, slot_quota={k: v for k, v in state.slot_quota.items() if k != action.slot_id}
            )
        elif action.kind == "memory_throttle" and action.slot_id is not None:
            self._state = replace(
                state, throttled={k: v for k, v in state.throttled.items() if k != action.slot_id}
            )
        elif action.kind == "evict" and action.slot_id is not None:
            self._state = replace(
                state, evicted={k: v for k, v in state.evicted.items() if k != action.slot_id}
            )

    def _record(self, action: Action, best_effort: list[str]) -> None:
        entry = {"at": round(self._wall(), 3), "seq": next(self._sequence), **action.to_json()}
        if action.kind == "evict":
            entry["restart"] = (
                f"started again once memory has been calm for {self.config.restore_after_seconds:g}s "
                "and it fits"
            )
        targets = best_effort if action.slot_id is None else [action.slot_id]
        with self._views_lock:
            for slot_id in targets:
                self._recent.setdefault(slot_id, collections.deque(maxlen=RECENT_ACTIONS)).append(entry)
            self.counts[action.kind] += 1
        extra: dict[str, Any] = {"qos_action": action.kind, "slot": action.slot_id}
        if action.cpus is not None:
            extra["cpus"] = format_cpulist(action.cpus)
        if action.quota_cpus is not None:
            extra["quota_cpus"] = action.quota_cpus
        log.info(
            "qos %s%s: %s",
            action.kind,
            f" {action.slot_id}" if action.slot_id else "",
            action.reason,
            extra=extra,
        )

    def _escalate(self, now: float) -> None:
        """An evicted worker still alive after the grace period is killed with its slot's processes
        (memory must come back now, not after the worker's own grace); one started again by the
        operator after it stopped is the operator's."""
        with self._views_lock:
            evictions = list(self._evicted.items())
        for slot_id, evicted in evictions:
            try:
                slot = self.manager.get_slot(slot_id)
            except NodeAgentError:
                self._forget_eviction(slot_id)
                continue
            alive = slot.worker is not None and slot.worker.phase in ALIVE_PHASES
            if not alive:
                evicted.seen_stopped = True
            elif evicted.seen_stopped:
                self._forget_eviction(slot_id)  # started by hand: no longer the loop's
                self._dirty = True
            elif now - evicted.at >= self.evict_grace_seconds and slot.cgroup is not None:
                log.info(
                    "qos evict %s: grace of %gs over; killing its processes",
                    slot_id,
                    self.evict_grace_seconds,
                )
                try:
                    self.actuator.kill(slot.cgroup)
                except NodeAgentError as err:
                    self._error(f"evicted worker of {slot_id} not killed: {err}")

    def _forget_eviction(self, slot_id: str) -> None:
        with self._views_lock:
            self._evicted.pop(slot_id, None)

    def _error(self, message: str) -> None:
        self.errors += 1
        # The same failure every period is logged once, not once a second.
        if message != self._last_error:
            log.warning("qos: %s", message)
            self._last_error = message

    # ------------------------------------------------------------------ the manager's view (QosView)

    def batch(self) -> dict[str, Any] | None:
        batch, measured, limit = self._batch, self._measured, self._state.cpu_limit
        if batch is None:
            return None
        body = batch.to_json()
        body["best_effort_allowed"] = {
            "cpus": None if limit is None else limit.quota,
            "cpuset": None if limit is None else format_cpulist(limit.cpus),
        }
        body["admission"] = self.admission
        body["measured_at"] = self._measured_at
        if measured is not None:
            body["online_pressure"] = {
                k: None if v is None else round(v, 4) for k, v in measured.online_pressure.items()
            }
            # The pool's use by neither class in the last period: not subtracted from batch unless
            # host_cpu_as_online says so (docs/colocation.md).
            body["host_used"] = {"cpus": None if measured.host_cpu is None else round(measured.host_cpu, 3)}
        if self.sampler.traffic is not None:
            # The bandwidth proxy's input (no MBA): null in periods that did not read the slots.
            traffic = None if measured is None else measured.best_effort_traffic
            body["best_effort_memory_traffic"] = {
                "bytes_per_second": None if traffic is None else round(traffic),
                "budget_bytes_per_second": round(self.config.best_effort_bandwidth_mb_per_s * 1e6),
            }
        return body

    def slot_view(self, slot_id: str) -> tuple[tuple[dict[str, Any], ...], bool]:
        with self._views_lock:
            recent = self._recent.get(slot_id)
            # The entries themselves, not copies: _record builds each once and never changes it,
            # and one class-wide action is shared by every best-effort slot's deque; copying 20 per
            # slot was a third of GET /v1/slots at 500 slots (issue 23). Slot.to_json copies them.
            actions = tuple(recent) if recent else ()
            return actions, slot_id in self._evicted

    def admit(self, request: SlotRequest, best_effort_cpus: float, best_effort_memory: int) -> None:
        if self.admission != "batch":
            return
        batch = self._batch
        if batch is None:
            return  # nothing measured yet (the first period after a start): admit as placement does
        cpus = request.resources.cpu_millis / MILLI
        memory = request.resources.memory_bytes
        cap = batch.cpus * self.best_effort_overcommit
        window = f"over the last {batch.window_seconds:.0f}s"
        if cpus and best_effort_cpus + cpus > cap + 1e-9:
            raise PlacementError(
                f"best-effort slot {request.name!r} asks for {cpus:g} CPUs; best-effort slots hold "
                f"{best_effort_cpus:g} and may hold {cap:.2f} now (batch {batch.cpus:.2f} CPUs that online "
                f"slots left idle {window}, x{self.best_effort_overcommit:g} overcommit); ask for less or "
                "retry when online load falls"
            )
        if memory and best_effort_memory + memory > batch.memory_bytes:
            raise PlacementError(
                f"best-effort slot {request.name!r} asks for {memory} bytes of memory; best-effort slots "
                f"hold {best_effort_memory} and batch memory (what online slots left {window}, less the "
                f"throttle margin) is {batch.memory_bytes} now; ask for less or retry when online load falls"
            )

    # ------------------------------------------------------------------ metrics

    def collector(self) -> Collector:
        return _QosCollector(self)

    @property
    def evicted(self) -> frozenset[str]:
        with self._views_lock:
            return frozenset(self._evicted)

    @property
    def measured(self) -> Measured | None:
        return self._measured

    @property
    def state(self) -> LoopState:
        return self._state


class _QosCollector(Collector):
    def __init__(self, loop: QosLoop) -> None:
        self.loop = loop

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        prefix = "nodeagent_qos"
        actions = CounterMetricFamily(
            f"{prefix}_actions", "Actions of the QoS loop, by kind.", labels=("action",)
        )
        with loop._views_lock:
            counts = dict(loop.counts)
        for kind in ACTION_KINDS:
            actions.add_metric((kind,), counts[kind])
        yield actions
        errors = CounterMetricFamily(f"{prefix}_errors", "Periods or actions of the QoS loop that failed.")
        errors.add_metric((), loop.errors)
        yield errors
        busy = CounterMetricFamily(f"{prefix}_loop_cpu_seconds", "CPU time the QoS loop's thread has used.")
        busy.add_metric((), loop.busy_seconds)
        yield busy
        periods = CounterMetricFamily(f"{prefix}_periods", "Periods the QoS loop has run.")
        periods.add_metric((), loop.periods)
        yield periods
        evicted = GaugeMetricFamily(f"{prefix}_evicted_workers", "Best-effort workers evicted now.")
        evicted.add_metric((), len(loop.evicted))
        yield evicted
        limit = loop.state.cpu_limit
        allowed = GaugeMetricFamily(
            f"{prefix}_best_effort_cpus",
            "Best-effort's CPU limit: quota (CPUs) and the CPUs in its cpuset.",
            labels=("kind",),
        )
        if limit is not None:
            allowed.add_metric(("quota",), limit.quota)
            allowed.add_metric(("cpuset",), len(limit.cpus))
        yield allowed
        measured = loop.measured
        if measured is not None:
            usage = GaugeMetricFamily(
                f"{prefix}_pool_cpu_usage",
                "Shared pool CPU use in the last period, by class.",
                labels=("kind",),
            )
            usage.add_metric(("online",), measured.online_cpu)
            usage.add_metric(("best_effort",), measured.best_effort_cpu)
            if measured.host_cpu is not None:
                usage.add_metric(("host",), measured.host_cpu)
            yield usage
            pressure = GaugeMetricFamily(
                f"{prefix}_online_pressure",
                "Share of the last period in which some online task stalled (PSI), by resource.",
                labels=("resource",),
            )
            for resource, value in measured.online_pressure.items():
                if value is not None:
                    pressure.add_metric((resource,), value)
            yield pressure
            if measured.best_effort_traffic is not None:
                traffic = GaugeMetricFamily(
                    f"{prefix}_best_effort_memory_traffic_bytes_per_second",
                    "Best-effort slots' memory traffic in the last period that read them (last-level cache "
                    "misses times the line size; where the host has no MBA).",
                )
                traffic.add_metric((), measured.best_effort_traffic)
                yield traffic
            memory = GaugeMetricFamily(f"{prefix}_node_memory_used_percent", "Node memory in use (percent).")
            memory.add_metric((), measured.memory_used_percent)
            yield memory
        batch = loop._batch
        if batch is not None:
            family = GaugeMetricFamily(
                "nodeagent_batch_capacity",
                "What best-effort work may use now: online slots' unused CPU and memory over the window.",
                labels=("resource",),
            )
            family.add_metric(("cpus",), batch.cpus)
            family.add_metric(("memory_bytes",), batch.memory_bytes)
            yield family


# --------------------------------------------------------------------------- assembly


def build_qos_loop(config: AgentConfig, manager: SlotManager) -> QosLoop | None:
    """The loop for this agent, or None where it has nothing to act on (unisolated) or is off.

    With ``[qos] enabled = false`` a limit left by an earlier run is lifted, so best-effort is not
    held back by a loop that no longer runs.
    """
    from nodeagent.isolation.backend import KernelIsolation  # noqa: PLC0415 - the kernel side only

    backend = manager.isolation
    if not isinstance(backend, KernelIsolation):
        return None
    isolator = backend.isolator
    pods = config.kubernetes.best_effort_cgroups()
    if not config.qos.enabled:
        try:
            isolator.limit_best_effort(None, None)
            hold_cpu_quota(isolator.host, pods, None, isolator.config.qos.cfs_period_us)
        except NodeAgentError as err:
            log.warning("qos: could not lift an earlier best-effort limit: %s", err)
        return None
    topology = manager.topology()
    core_of: Mapping[int, int] = {cpu.id: cpu.core for cpu in topology.cpus}
    sampler = Sampler(
        isolator.host,
        isolator.hierarchy,
        allowed=isolator.pool.allowed,
        core_of=core_of,
        traffic=_memory_traffic(config, isolator.resctrl),
        also_best_effort=pods,
    )
    actuator = Actuator(
        isolator,
        resctrl=isolator.resctrl,
        resctrl_group=isolator.config.resctrl_group("best-effort"),
        l3_share=config.qos.best_effort_l3_share,
        mb_percent=config.qos.best_effort_mb_percent,
        also_best_effort=pods,
    )
    return QosLoop(
        manager,
        sampler,
        actuator,
        config.colocation(),
        evict_grace_seconds=config.qos.evict_grace_seconds,
        admission=config.qos.best_effort_admission,
        best_effort_overcommit=config.placement.best_effort_overcommit,
    )


def _memory_traffic(config: AgentConfig, resctrl: Resctrl | None) -> MemoryTraffic | None:
    """Cache-miss counters for the bandwidth proxy, where the host has no MBA to hold best-effort's
    bandwidth itself and its CPU can count; None elsewhere (``nodeagent doctor`` says which)."""
    if config.qos.best_effort_bandwidth_mb_per_s <= 0:
        return None
    if resctrl is not None:
        try:
            support = resctrl.detect()
        except NodeAgentError:
            support = None
        if support is not None and support.mounted and support.mb is not None:
            return None  # best-effort's resctrl group holds its share
    reason = probe(LLC_MISSES)
    if reason is not None:
        log.info("qos: best-effort memory bandwidth is bounded only by its CPU allowance: %s", reason)
        return None
    log.info("qos: no MBA; best-effort slots' memory traffic counted from cache misses")
    return MemoryTraffic()


__all__ = ["RECENT_ACTIONS", "QosLoop", "build_qos_loop"]
