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
  does not provide are left out rather than reported as zero; a slot that used no CPU since the
  previous scrape has only its CPU time and memory read, the figures that cannot have moved are
  carried: ``CgroupStats.ran_since``);
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

The per-slot families (a few samples for each of hundreds of slots) are written to the text format
here (:class:`SlotFamily`) rather than through prometheus-client's generic exposition, which
checks and escapes every label name of every sample: at 500 slots that path and its sample
objects were half of a scrape (issue 23). The output is the same text, byte for byte (tested
against prometheus-client's); label values are escaped as the format requires and values are
formatted by prometheus-client's own ``floatToGoString``. A slot's two labels are escaped and
joined once per scrape (:class:`SlotLabels`), not once for each of its ten or so samples.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        # Not in the registry: render() reads the service first, so that scrape errors it counts
        # show up in the same scrape, and writes its per-slot families itself.
        self._collector = _ServiceCollector(self)
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
        families, per_slot = self._collector.scrape()
        body = generate_latest(_Families(families)) + "".join(f.text() for f in per_slot).encode()
        return body + generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Families(Collector):
    """Families already built, for prometheus-client's exposition."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class SlotLabels:
    """A slot's ``name`` and ``slot`` label values, escaped, and the two as they appear in a sample
    (``name="..",slot=".."``, the exposition's order): built once per slot and scrape."""

    __slots__ = ("name", "pair", "slot")

    def __init__(self, slot: Slot) -> None:
        self.name = _label_value(slot.name)
        self.slot = _label_value(slot.id)
        self.pair = f'name="{self.name}",slot="{self.slot}"'


class SlotFamily:
    """One family with a sample per slot (labels ``name``, ``slot`` and optionally one more),
    written as prometheus-client's ``generate_latest`` writes it (see the module docstring)."""

    def __init__(
        self, name: str, kind: Literal["counter", "gauge"], documentation: str, extra_label: str | None = None
    ) -> None:
        self.sample_name = f"{name}_total" if kind == "counter" else name
        help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
        self._header = f"# HELP {self.sample_name} {help_text}\n# TYPE {self.sample_name} {kind}\n"
        self._extra = extra_label
        # The exposition sorts a sample's labels by name.
        self._order = tuple(sorted(("name", "slot", *((extra_label,) if extra_label else ()))))
        self._lines: list[str] = []

    def add(self, labels: SlotLabels, value: float, extra: str = "") -> None:
        if self._extra is None:
            self._lines.append(f"{self.sample_name}{{{labels.pair}}} {_go_float(value)}\n")
            return
        values = {"name": labels.name, "slot": labels.slot, self._extra: _label_value(extra)}
        text = ",".join(f'{key}="{values[key]}"' for key in self._order)
        self._lines.append(f"{self.sample_name}{{{text}}} {_go_float(value)}\n")

    def text(self) -> str:
        return self._header + "".join(self._lines)


def _go_float(value: float) -> str:
    # Most per-slot figures are whole numbers that repeat from slot to slot and scrape to scrape
    # (0 restarts, 0 OOM kills, phase 1, the same memory size): their text is remembered. Floats
    # are not: 0.0 and -0.0 are equal keys with different texts.
    if type(value) is int:
        return _go_int(value)
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # the library's, untyped
    return text


@functools.lru_cache(maxsize=1024)
def _go_int(value: int) -> str:
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # the library's, untyped
    return text


def _label_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


class _ServiceCollector:
    """What a scrape reads from the service: families of node-wide figures, and the per-slot ones."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.service: SlotService | None = None
        self.stats_provider: StatsProvider | None = None

    def scrape(self) -> tuple[list[Metric], list[SlotFamily]]:
        service = self.service
        if service is None:
            return [], []
        families = self._section("node", lambda: _node_metrics(service))
        # Capacity first: it reads every slot too, and its copy is gone before the listing below
        # is made, so a scrape holds one copy of the slots at a time (a lower high-water mark).
        families += self._section("capacity", lambda: _capacity_metrics(service.capacity()))
        slots = self._guarded("slots", service.list_slots)
        if slots is None:
            return families, []
        families += _slot_counts(slots)
        labelled = [(slot, SlotLabels(slot)) for slot in slots]
        per_slot = _per_slot_metrics(labelled)
        if self.stats_provider is not None:
            prepare = getattr(self.stats_provider, "prepare", None)
            if callable(prepare):
                prepare(slots)
            per_slot += _usage_metrics(labelled, self.stats_provider, self.metrics.scrape_errors)
        return families, per_slot

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


def _slot_counts(slots: list[Slot]) -> list[Metric]:
    counts = {(str(state), qos): 0 for state in SlotState for qos in QOS_CLASSES}
    phases = {(str(phase), qos): 0 for phase in Phase for qos in QOS_CLASSES}
    for slot in slots:
        key = (str(slot.state), slot.qos)
        counts[key] = counts.get(key, 0) + 1
        if slot.worker is not None:
            phases[(str(slot.worker.phase), slot.qos)] += 1
    by_state = GaugeMetricFamily(f"{PREFIX}_slots", "Slots by state and QoS class.", labels=("state", "qos"))
    for (state, qos), n in sorted(counts.items()):
        by_state.add_metric((state, qos), n)
    by_phase = GaugeMetricFamily(
        f"{PREFIX}_workers", "Workers by phase and QoS class.", labels=("phase", "qos")
    )
    for (phase, qos), n in sorted(phases.items()):
        by_phase.add_metric((phase, qos), n)
    return [by_state, by_phase]


def _per_slot_metrics(slots: list[tuple[Slot, SlotLabels]]) -> list[SlotFamily]:
    worker_phase = SlotFamily(
        f"{PREFIX}_slot_worker_phase",
        "gauge",
        "1 for each slot's worker in its current phase (a crash loop shows here, not in the slot's state).",
        extra_label="phase",
    )
    restarts = SlotFamily(
        f"{PREFIX}_worker_restarts", "counter", "Times the agent restarted a slot's worker."
    )
    seconds = SlotFamily(
        f"{PREFIX}_slot_foreign_cpu_seconds",
        "counter",
        "CPU time spent on a guaranteed slot's CPUs by anything that is not the slot (interrupts included).",
    )
    irq = SlotFamily(
        f"{PREFIX}_slot_foreign_irq_seconds",
        "counter",
        "Of that, time handling hard and soft interrupts on the slot's CPUs.",
    )
    fraction = SlotFamily(
        f"{PREFIX}_slot_foreign_cpu_fraction",
        "gauge",
        "Foreign CPU time as a fraction of the slot's CPU capacity since the agent first measured it.",
    )
    for slot, labels in slots:
        if slot.worker is not None:
            restarts.add(labels, slot.worker.restarts)
            worker_phase.add(labels, 1, str(slot.worker.phase))
        if slot.foreign_cpu is not None:
            seconds.add(labels, slot.foreign_cpu.seconds)
            irq.add(labels, slot.foreign_cpu.irq_seconds)
            fraction.add(labels, slot.foreign_cpu.fraction)
    return [worker_phase, restarts, seconds, irq, fraction]


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


def _usage_metrics(
    slots: list[tuple[Slot, SlotLabels]], provider: StatsProvider, errors: Counter
) -> list[SlotFamily]:
    families = {
        "cpu": SlotFamily(f"{PREFIX}_slot_cpu_usage_seconds", "counter", "CPU time used by the slot."),
        "throttled_periods": SlotFamily(
            f"{PREFIX}_slot_cpu_throttled_periods", "counter", "CFS periods in which the slot was throttled."
        ),
        "throttled": SlotFamily(
            f"{PREFIX}_slot_cpu_throttled_seconds", "counter", "Time the slot spent throttled."
        ),
        "memory": SlotFamily(f"{PREFIX}_slot_memory_bytes", "gauge", "Memory the slot uses now."),
        "peak": SlotFamily(f"{PREFIX}_slot_memory_peak_bytes", "gauge", "Most memory the slot has used."),
        "oom_kills": SlotFamily(
            f"{PREFIX}_slot_oom_kills", "counter", "Processes the kernel's OOM killer killed in the slot."
        ),
    }
    cpu, throttled_periods, throttled = families["cpu"], families["throttled_periods"], families["throttled"]
    memory, peak, oom_kills = families["memory"], families["peak"], families["oom_kills"]
    for slot, labels in slots:
        try:
            stats = provider(slot.id)
        except NodeAgentError as err:
            # A slot released between list_slots and this read has no cgroup any more.
            log.debug("metrics: no cgroup figures for slot %s: %s", slot.id, err)
            errors.labels("slot_stats").inc()
            continue
        if stats is None:
            continue
        for family, value in (
            (cpu, _seconds(stats.cpu_usage_ns)),
            (throttled_periods, stats.cpu_throttled_periods),
            (throttled, _seconds(stats.cpu_throttled_ns)),
            (memory, stats.memory_current),
            (peak, stats.memory_peak),
            (oom_kills, stats.oom.oom_kill),
        ):
            if value is not None:
                family.add(labels, value)
    return list(families.values())


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e9
