"""Prometheus metrics of the agent, on a private registry (never the process-global one).

Slot counts, capacity and per-slot usage are computed at scrape time from the service (a custom
collector), so there is no second copy of the state to keep in sync. What only the agent's own
code knows as it happens (API latency, reporter failures) lives in ordinary instruments that the
API middleware and the reporter update.

Series (all prefixed ``nodeagent_``):

- ``slots{state, qos}``: slots by state and QoS class (every combination, zeros included);
- ``capacity{resource, kind}`` and ``numa_capacity{numa, resource, kind}``: kind is one of
  total / reserved / allocatable / allocated / free;
- ``slot_cpu_usage_seconds_total``, ``slot_cpu_throttled_periods_total``,
  ``slot_cpu_throttled_seconds_total``, ``slot_memory_bytes``, ``slot_memory_peak_bytes``,
  ``slot_oom_kills_total``, each ``{slot, name}``, from the ``stats_provider`` (figures the kernel
  does not provide are left out rather than reported as zero);
- ``worker_restarts_total{slot, name}``;
- ``slot_foreign_cpu_seconds_total{slot, name}``, ``slot_foreign_irq_seconds_total{slot, name}`` and
  ``slot_foreign_cpu_fraction{slot, name}``: guaranteed slots' CPU time taken by anything else
  (docs/host-partitioning.md), counted from the agent's first look at the slot;
- ``standby{resource}``: warm pools' standby workers: ``slots``, ``frozen`` and ``memory_bytes``
  (their memory is reserved; their CPU is zero; they are not counted in ``slots{state, qos}``);
- ``host_partitioning_active``, ``host_confined_items{kind}``, ``host_immovable_items``: whether the
  rest of the host is kept off exclusive CPUs now, what is held confined, what cannot move;
- ``ready``, ``agent_info{version, node_id, cgroup_mode}``, ``degraded_features``;
- ``api_request_duration_seconds{method, route, status}`` (route is the path template);
- ``api_connections_rejected_total{reason}``: API connections the agent cut (``total`` / ``peer``:
  over ``[api] max_connections`` / ``max_connections_per_peer``; ``idle``: no request within
  ``[api] header_timeout_s``), and ``api_accept_errors_total`` (``EMFILE`` and the like);
- ``reporter_failures_total``, ``reporter_last_success_timestamp_seconds``;
- ``scrape_errors_total{section}``: parts of a scrape that failed and were left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from nodeagent.agent.service import SlotService
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.cgroups.resources import CgroupStats
from nodeagent.errors import NodeAgentError
from nodeagent.runtime.supervisor import Phase
from nodeagent.schema.request import QOS_CLASSES

log = logging.getLogger(__name__)

PREFIX = "nodeagent"
CAPACITY_KINDS = ("total", "reserved", "allocatable", "allocated", "free")
#: API latency buckets: the agent answers most calls in about a millisecond; allocations that
#: create kernel objects and launch workers take tens to hundreds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

T = TypeVar("T")

#: Slot id -> its cgroup's current figures, or None when the slot has no cgroup (yet). A provider
#: may also have a ``prepare(slots)`` method: each scrape then hands it the slots it has just listed
#: before asking for figures, so it need not look each slot up again.
StatsProvider = Callable[[str], CgroupStats | None]


class Metrics:
    """The agent's metrics. ``render()`` is the body of GET /metrics.

    ``service`` and ``stats_provider`` may be attached later (``attach``), because the daemon
    builds the metrics before the slot manager that feeds them.
    """

    def __init__(
        self, service: SlotService | None = None, *, stats_provider: StatsProvider | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Registered first so that scrape errors it counts show up in the same scrape.
        self._collector = _ServiceCollector(self)
        self.registry.register(self._collector)
        self.api_request_duration = Histogram(
            f"{PREFIX}_api_request_duration_seconds",
            "Time to answer an API request, by method, route template and status.",
            ("method", "route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reporter_failures = Counter(
            f"{PREFIX}_reporter_failures",
            "Reports to the controller that failed (each retry counts).",
            registry=self.registry,
        )
        self.reporter_last_success = Gauge(
            f"{PREFIX}_reporter_last_success_timestamp_seconds",
            "Unix time of the last report the controller accepted (0: none yet).",
            registry=self.registry,
        )
        self.api_connections_rejected = Counter(
            f"{PREFIX}_api_connections_rejected",
            "API connections cut by the connection limits, by reason (total, peer, idle).",
            ("reason",),
            registry=self.registry,
        )
        self.api_accept_errors = Counter(
            f"{PREFIX}_api_accept_errors",
            "Times the API's listening sockets could not accept (out of descriptors, memory).",
            registry=self.registry,
        )
        self.scrape_errors = Counter(
            f"{PREFIX}_scrape_errors",
            "Parts of a scrape that failed and were left out, by section.",
            ("section",),
            registry=self.registry,
        )
        self.attach(service, stats_provider=stats_provider)

    def attach(self, service: SlotService | None, *, stats_provider: StatsProvider | None = None) -> None:
        """Read slots and capacity from ``service`` (and cgroup figures from ``stats_provider``)."""
        self._collector.service = service
        self._collector.stats_provider = stats_provider

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.api_request_duration.labels(method, route, str(status)).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ServiceCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.service: SlotService | None = None
        self.stats_provider: StatsProvider | None = None

    def describe(self) -> list[Metric]:
        # Series depend on the live state: describing nothing keeps registration free of a scrape.
        return []

    def collect(self) -> Iterator[Metric]:
        service = self.service
        if service is None:
            return
        yield from self._section("node", lambda: _node_metrics(service))
        # Capacity first: it reads every slot too, and its copy is gone before the listing below
        # is made, so a scrape holds one copy of the slots at a time (a lower high-water mark).
        capacity = self._section("capacity", lambda: _capacity_metrics(service.capacity()))
        slots = self._guarded("slots", service.list_slots)
        if slots is not None:
            yield from _slot_metrics(slots)
        yield from capacity
        if slots is not None and self.stats_provider is not None:
            prepare = getattr(self.stats_provider, "prepare", None)
            if callable(prepare):
                prepare(slots)
            yield from _usage_metrics(slots, self.stats_provider, self.metrics.scrape_errors)

    def _section(self, name: str, build: Callable[[], list[Metric]]) -> list[Metric]:
        return self._guarded(name, build) or []

    def _guarded(self, name: str, build: Callable[[], T]) -> T | None:
        # One failing part (say, the manager is mid-restart) must not blank the whole scrape.
        try:
            return build()
        except NodeAgentError as err:
            log.warning("metrics: %s left out of this scrape: %s", name, err)
            self.metrics.scrape_errors.labels(name).inc()
            return None


def _node_metrics(service: SlotService) -> list[Metric]:
    node = service.node()
    info = GaugeMetricFamily(
        f"{PREFIX}_agent_info",
        "The agent's version and node identity.",
        labels=("version", "node_id", "cgroup_mode"),
    )
    info.add_metric((node.agent_version, node.node_id, node.cgroup_mode), 1)
    ready = GaugeMetricFamily(f"{PREFIX}_ready", "1 once start-up reconciliation is done.")
    ready.add_metric((), 1 if service.ready() else 0)
    degraded = GaugeMetricFamily(
        f"{PREFIX}_degraded_features", "Isolation features this agent cannot provide on this host."
    )
    degraded.add_metric((), len(node.degraded))
    return [info, ready, degraded, *_host_metrics(node.host_partitioning)]


def _host_metrics(status: Mapping[str, Any] | None) -> list[Metric]:
    if status is None or status.get("mode") == "off":
        return []
    active = GaugeMetricFamily(
        f"{PREFIX}_host_partitioning_active",
        "1 while the rest of the host is kept off exclusive CPUs (some are held), else 0.",
    )
    active.add_metric((), 1 if status.get("active") else 0)
    confined = GaugeMetricFamily(
        f"{PREFIX}_host_confined_items",
        "Tasks, cgroups, interrupts and workqueue masks held off exclusive CPUs, by kind.",
        labels=("kind",),
    )
    immovable = GaugeMetricFamily(
        f"{PREFIX}_host_immovable_items",
        "Kernel threads, interrupts and tasks that stay on exclusive CPUs (per-CPU, managed, pinned).",
    )
    last = status.get("last")
    if isinstance(last, Mapping):
        for kind, n in _items(last.get("confined")):
            confined.add_metric((kind,), float(n))
        immovable.add_metric((), float(len(last.get("immovable") or ())))
    return [active, confined, immovable]


def _slot_metrics(slots: list[Slot]) -> list[Metric]:
    counts = {(str(state), qos): 0 for state in SlotState for qos in QOS_CLASSES}
    restarts = CounterMetricFamily(
        f"{PREFIX}_worker_restarts", "Times the agent restarted a slot's worker.", labels=("slot", "name")
    )
    phases = {(str(phase), qos): 0 for phase in Phase for qos in QOS_CLASSES}
    worker_phase = GaugeMetricFamily(
        f"{PREFIX}_slot_worker_phase",
        "1 for each slot's worker in its current phase (a crash loop shows here, not in the slot's state).",
        labels=("slot", "name", "phase"),
    )
    for slot in slots:
        key = (str(slot.state), slot.qos)
        counts[key] = counts.get(key, 0) + 1
        if slot.worker is not None:
            restarts.add_metric((slot.id, slot.name), slot.worker.restarts)
            phases[(str(slot.worker.phase), slot.qos)] += 1
            worker_phase.add_metric((slot.id, slot.name, str(slot.worker.phase)), 1)
    by_state = GaugeMetricFamily(f"{PREFIX}_slots", "Slots by state and QoS class.", labels=("state", "qos"))
    for (state, qos), n in sorted(counts.items()):
        by_state.add_metric((state, qos), n)
    by_phase = GaugeMetricFamily(
        f"{PREFIX}_workers", "Workers by phase and QoS class.", labels=("phase", "qos")
    )
    for (phase, qos), n in sorted(phases.items()):
        by_phase.add_metric((phase, qos), n)
    return [by_state, by_phase, worker_phase, restarts, *_foreign_metrics(slots)]


def _foreign_metrics(slots: list[Slot]) -> list[Metric]:
    labels = ("slot", "name")
    seconds = CounterMetricFamily(
        f"{PREFIX}_slot_foreign_cpu_seconds",
        "CPU time spent on a guaranteed slot's CPUs by anything that is not the slot (interrupts included).",
        labels=labels,
    )
    irq = CounterMetricFamily(
        f"{PREFIX}_slot_foreign_irq_seconds",
        "Of that, time handling hard and soft interrupts on the slot's CPUs.",
        labels=labels,
    )
    fraction = GaugeMetricFamily(
        f"{PREFIX}_slot_foreign_cpu_fraction",
        "Foreign CPU time as a fraction of the slot's CPU capacity since the agent first measured it.",
        labels=labels,
    )
    for slot in slots:
        if slot.foreign_cpu is not None:
            key = (slot.id, slot.name)
            seconds.add_metric(key, slot.foreign_cpu.seconds)
            irq.add_metric(key, slot.foreign_cpu.irq_seconds)
            fraction.add_metric(key, slot.foreign_cpu.fraction)
    return [seconds, irq, fraction]


def _capacity_metrics(capacity: Mapping[str, Any]) -> list[Metric]:
    host = GaugeMetricFamily(
        f"{PREFIX}_capacity",
        "Host-wide capacity per resource (memory in bytes, CPUs and devices in units).",
        labels=("resource", "kind"),
    )
    for resource, figures in _items(capacity.get("resources")):
        for kind, value in _kinds(figures):
            host.add_metric((resource, kind), value)
    numa = GaugeMetricFamily(
        f"{PREFIX}_numa_capacity", "Capacity per NUMA node and resource.", labels=("numa", "resource", "kind")
    )
    for node, resources in _items(capacity.get("by_numa")):
        for resource, figures in _items(resources):
            for kind, value in _kinds(figures):
                numa.add_metric((node, resource, kind), value)
    qos = GaugeMetricFamily(
        f"{PREFIX}_qos_allocated",
        "What each QoS class holds: slots, CPUs (exclusive, or shared-pool quota) and memory bytes.",
        labels=("qos", "resource"),
    )
    for name, figures in _items(capacity.get("by_qos")):
        for resource, value in _items(figures):
            if isinstance(value, int | float) and not isinstance(value, bool):
                qos.add_metric((name, resource), float(value))
    standby = GaugeMetricFamily(
        f"{PREFIX}_standby",
        "Warm pools' standby workers (docs/pools.md): slots, how many are frozen, memory bytes they hold.",
        labels=("resource",),
    )
    for resource, value in _items(capacity.get("standby")):
        if isinstance(value, int | float) and not isinstance(value, bool):
            standby.add_metric((resource,), float(value))
    return [host, numa, qos, standby]


def _items(obj: Any) -> list[tuple[str, Any]]:
    return [(str(k), v) for k, v in obj.items()] if isinstance(obj, Mapping) else []


def _kinds(figures: Any) -> list[tuple[str, float]]:
    if not isinstance(figures, Mapping):
        return []
    return [
        (kind, float(figures[kind]))
        for kind in CAPACITY_KINDS
        if isinstance(figures.get(kind), int | float) and not isinstance(figures.get(kind), bool)
    ]


def _usage_metrics(slots: list[Slot], provider: StatsProvider, errors: Counter) -> list[Metric]:
    labels = ("slot", "name")
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "cpu": CounterMetricFamily(
            f"{PREFIX}_slot_cpu_usage_seconds", "CPU time used by the slot.", labels=labels
        ),
        "throttled_periods": CounterMetricFamily(
            f"{PREFIX}_slot_cpu_throttled_periods",
            "CFS periods in which the slot was throttled.",
            labels=labels,
        ),
        "throttled": CounterMetricFamily(
            f"{PREFIX}_slot_cpu_throttled_seconds", "Time the slot spent throttled.", labels=labels
        ),
        "memory": GaugeMetricFamily(
            f"{PREFIX}_slot_memory_bytes", "Memory the slot uses now.", labels=labels
        ),
        "peak": GaugeMetricFamily(
            f"{PREFIX}_slot_memory_peak_bytes", "Most memory the slot has used.", labels=labels
        ),
        "oom_kills": CounterMetricFamily(
            f"{PREFIX}_slot_oom_kills", "Processes the kernel's OOM killer killed in the slot.", labels=labels
        ),
    }
    for slot in slots:
        try:
            stats = provider(slot.id)
        except NodeAgentError as err:
            # A slot released between list_slots and this read has no cgroup any more.
            log.debug("metrics: no cgroup figures for slot %s: %s", slot.id, err)
            errors.labels("slot_stats").inc()
            continue
        if stats is None:
            continue
        key = (slot.id, slot.name)
        for family, value in (
            ("cpu", _seconds(stats.cpu_usage_ns)),
            ("throttled_periods", stats.cpu_throttled_periods),
            ("throttled", _seconds(stats.cpu_throttled_ns)),
            ("memory", stats.memory_current),
            ("peak", stats.memory_peak),
            ("oom_kills", stats.oom.oom_kill),
        ):
            if value is not None:
                families[family].add_metric(key, value)
    return list(families.values())


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9
