"""The colocation loop's data (pure): its configuration, the samples it reads and the decisions it
returns. The decision itself is :mod:`nodeagent.isolation.colocation` (see its docstring for the
rules); the sampler and actuator are :mod:`nodeagent.isolation.colocation_kernel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from nodeagent.errors import ConfigError

ActionKind = Literal[
    "cpu_suppress",
    "cpu_release",
    "slot_cpu_quota",
    "memory_throttle",
    "memory_unthrottle",
    "evict",
    "restore",
    "resctrl_narrow",
    "resctrl_wide",
]
ACTION_KINDS: tuple[ActionKind, ...] = get_args(ActionKind)
PressureResource = Literal["cpu", "memory", "io"]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ColocationConfig:
    """The loop's thresholds ([qos] in the agent's configuration; docs/configuration.md)."""

    period_seconds: float = 1.0
    cpu_margin: float = 0.1
    cpu_release_periods: int = 3
    cpu_pressure_threshold: float = 0.1
    io_pressure_threshold: float = 0.2
    min_cpus: float = 0.01
    smt_busy_threshold: float = 0.1
    memory_throttle_percent: float = 80.0
    memory_evict_percent: float = 90.0
    memory_evict_target_percent: float = 85.0
    memory_pressure_threshold: float = 0.1
    restore_after_seconds: float = 60.0
    batch_window_seconds: float = 300.0
    #: Whether the host's other CPU use (processes outside the agent's slots) counts as online
    #: work. Off: best-effort may use what the online slots leave, and other tenants compete with
    #: it through the scheduler (best-effort runs at idle priority); on: what everything leaves.
    host_cpu_as_online: bool = False
    #: Where the host cannot cap memory bandwidth itself (no resctrl MBA) but counts cache misses:
    #: the memory traffic best-effort work may cause while online work runs, in MB/s; a slot that
    #: would cause more at its CPU allowance gets its CPU quota cut so that it cannot (0: off).
    best_effort_bandwidth_mb_per_s: float = 1000.0

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("period_seconds", 0.05 <= self.period_seconds <= 60, "seconds in [0.05, 60]"),
            ("cpu_margin", 0 <= self.cpu_margin < 1, "a fraction in [0, 1)"),
            ("cpu_release_periods", self.cpu_release_periods >= 1, "a whole number of at least 1"),
            ("cpu_pressure_threshold", 0 < self.cpu_pressure_threshold <= 1, "a fraction in (0, 1]"),
            ("io_pressure_threshold", 0 < self.io_pressure_threshold <= 1, "a fraction in (0, 1]"),
            ("min_cpus", 0.001 <= self.min_cpus <= 1, "CPUs in [0.001, 1]"),
            ("smt_busy_threshold", 0 < self.smt_busy_threshold <= 1, "a fraction in (0, 1]"),
            ("memory_throttle_percent", 0 < self.memory_throttle_percent <= 100, "a percentage in (0, 100]"),
            ("memory_evict_percent", 0 < self.memory_evict_percent <= 100, "a percentage in (0, 100]"),
            (
                "memory_evict_target_percent",
                0 < self.memory_evict_target_percent < self.memory_evict_percent,
                "a percentage above 0 and below memory_evict_percent",
            ),
            ("memory_pressure_threshold", 0 < self.memory_pressure_threshold <= 1, "a fraction in (0, 1]"),
            ("restore_after_seconds", self.restore_after_seconds >= 0, "seconds, at least 0"),
            ("batch_window_seconds", self.batch_window_seconds > 0, "seconds above 0"),
            (
                "best_effort_bandwidth_mb_per_s",
                self.best_effort_bandwidth_mb_per_s >= 0,
                "MB/s, at least 0 (0 turns the bandwidth proxy off)",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"qos.{name} is {getattr(self, name)!r}; expected {expected}")
        if self.memory_throttle_percent > self.memory_evict_percent:
            raise ConfigError(
                f"qos.memory_throttle_percent ({self.memory_throttle_percent}) is above "
                f"qos.memory_evict_percent ({self.memory_evict_percent}); best-effort memory is throttled "
                "before it is evicted, so keep the throttle threshold at or below the eviction threshold"
            )


# --------------------------------------------------------------------------- samples (in)


@dataclass(frozen=True)
class Stall:
    """Cumulative PSI "some" stall time of one group (microseconds, the files' ``total=``); None
    where the kernel does not give it."""

    cpu: int | None = None
    memory: int | None = None
    io: int | None = None


@dataclass(frozen=True)
class GroupUsage:
    """One cgroup's cumulative CPU time and current memory; ``stall`` None: no per-group PSI (v1)."""

    cpu_ns: int | None = None
    memory_bytes: int | None = None
    stall: Stall | None = None


@dataclass(frozen=True)
class BestEffortSlot:
    """A best-effort slot as the loop sees it.

    ``started_at``: when its worker (else the slot) started, in seconds on any clock that is the
    same for every slot of one sample (the youngest has the largest). ``memory_high``: the slot's
    own memory.high (its memory request), None for none. ``running``: it has a live worker the
    loop may evict. ``evicted``: the agent has its worker stopped on the loop's behalf.
    ``memory_traffic_bytes``: its processes' cumulative memory traffic (last-level cache misses
    times the line size), None where it is not counted (:attr:`Sample.traffic_counted`).
    """

    slot_id: str
    priority: int = 0
    started_at: float = 0.0
    usage: GroupUsage = field(default_factory=GroupUsage)
    memory_high: int | None = None
    running: bool = True
    evicted: bool = False
    memory_traffic_bytes: int | None = None


#: The key of the burstable class (every burstable slot together) in :attr:`Sample.online`; the
#: other keys are guaranteed slots' ids.
BURSTABLE_GROUP = "burstable"


@dataclass(frozen=True)
class Sample:
    """What the sampler read in one period.

    ``time``: monotonic seconds. ``pool``: the shared pool's CPUs now. ``core_of``: physical core
    of each CPU (pool and exclusive ones); hyperthread siblings share a core. ``cpu_busy_ns``:
    cumulative non-idle time per CPU (``/proc/stat``, steal included: CPU the host took is not idle
    for us). ``online``: the online groups (the burstable class, each guaranteed slot).
    ``best_effort_cpu_ns``: the best-effort class's cumulative CPU time; ``best_effort_memory_bytes``
    its memory now. ``slots_read``: whether each best-effort slot's cgroup was read this period
    (:func:`~nodeagent.isolation.colocation.needs_slot_detail`); when not, ``best_effort`` still
    lists every slot, with an empty ``usage``. ``traffic_counted``: the sampler counts best-effort
    slots' memory traffic (the host has cache-miss counters and no resctrl MBA); a period that
    reads the slots then gives each its ``memory_traffic_bytes``. ``resctrl_group``: best-effort's
    shared resctrl group is in place (its cache and bandwidth share follows online load).
    """

    time: float
    pool: frozenset[int]
    core_of: Mapping[int, int]
    exclusive: frozenset[int]
    cpu_busy_ns: Mapping[int, int]
    memory_total: int
    memory_available: int
    node_stall: Stall
    online: Mapping[str, GroupUsage]
    best_effort_cpu_ns: int | None
    best_effort: tuple[BestEffortSlot, ...] = ()
    best_effort_memory_bytes: int | None = None
    slots_read: bool = True
    traffic_counted: bool = False
    resctrl_group: bool = False


# --------------------------------------------------------------------------- decisions (out)


@dataclass(frozen=True)
class Action:
    """One change the loop makes. ``slot_id`` None: the best-effort class as a whole.

    ``cpus`` and ``quota_cpus``: best-effort's cpuset and quota (cpu_suppress, cpu_release), or a
    slot's quota (slot_cpu_quota; None lifts it). ``memory_high``: the value written
    (memory_throttle; memory_unthrottle restores the slot's own, None for none). ``memory_bytes``:
    the slot's memory when evicted or restored.
    """

    kind: ActionKind
    slot_id: str | None
    reason: str
    cpus: frozenset[int] | None = None
    quota_cpus: float | None = None
    memory_high: int | None = None
    memory_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"action": self.kind, "slot_id": self.slot_id, "reason": self.reason}
        if self.cpus is not None:
            body["cpus"] = sorted(self.cpus)
        if self.kind in ("cpu_suppress", "cpu_release", "slot_cpu_quota"):
            body["quota_cpus"] = self.quota_cpus
        if self.kind in ("memory_throttle", "memory_unthrottle"):
            body["memory_high"] = self.memory_high
        if self.memory_bytes is not None:
            body["memory_bytes"] = self.memory_bytes
        return body


@dataclass(frozen=True)
class Measured:
    """What one period measured. CPU figures are in CPUs; pressure is the share of the period in
    which some online task stalled (None: not measured). ``online_cpu``: what the loop counted as
    online use of the pool (the online slots', and the host's other use too where
    ``host_cpu_as_online`` is set or the slots' own use could not be read); ``host_cpu``: the pool
    CPU that neither online nor best-effort slots used (other tenants, system daemons, the agent
    itself, the hypervisor's steal), None where the online slots' use could not be read.
    ``best_effort_traffic``: best-effort slots' memory traffic in bytes/s (see
    :attr:`BestEffortSlot.memory_traffic_bytes`), None where not measured this period."""

    period_seconds: float
    pool_cpus: int
    pool_busy: float
    online_cpu: float
    best_effort_cpu: float
    memory_used_percent: float
    online_pressure: Mapping[PressureResource, float | None]
    allowed_cpus: float
    host_cpu: float | None = None
    #: Best-effort slots' memory traffic in bytes/s (the slots read in both samples); None where
    #: it is not counted or the slots were not read.
    best_effort_traffic: float | None = None


@dataclass(frozen=True)
class Batch:
    """What best-effort work may use now: CPU and memory online slots hold but did not use over the
    window (its peak), minus the margins. ``window_seconds``: how much of the window is measured."""

    cpus: float
    memory_bytes: int
    window_seconds: float
    online_cpu_peak: float
    online_memory_peak: int
    best_effort_cpu: float
    best_effort_memory: int

    def to_json(self) -> dict[str, Any]:
        return {
            "cpus": round(self.cpus, 3),
            "memory_bytes": self.memory_bytes,
            "window_seconds": round(self.window_seconds, 1),
            "online_used_peak": {
                "cpus": round(self.online_cpu_peak, 3),
                "memory_bytes": self.online_memory_peak,
            },
            "best_effort_used": {
                "cpus": round(self.best_effort_cpu, 3),
                "memory_bytes": self.best_effort_memory,
            },
        }


@dataclass(frozen=True)
class CpuLimit:
    """Best-effort's cpuset and quota (CPUs) as last decided."""

    cpus: frozenset[int]
    quota: float


@dataclass(frozen=True)
class Eviction:
    at: float
    memory_bytes: int
    reason: str


@dataclass(frozen=True)
class WindowPoint:
    time: float
    online_cpu: float
    online_memory: int


@dataclass(frozen=True)
class LoopState:
    """What the loop carries from one period to the next (start with ``LoopState()``)."""

    previous: Sample | None = None
    recent_online_cpu: tuple[float, ...] = ()
    recent_pressure: tuple[str | None, ...] = ()
    window: tuple[WindowPoint, ...] = ()
    cpu_limit: CpuLimit | None = None
    slot_quota: Mapping[str, float] = field(default_factory=dict)
    #: Best-effort slots whose CPU quota is cut for their memory traffic, and the cut (CPUs).
    bandwidth_capped: Mapping[str, float] = field(default_factory=dict)
    #: Best-effort's resctrl group holds the default group's whole cache and bandwidth (online
    #: work idle) rather than its small share (the group is made with the small share).
    resctrl_wide: bool = False
    throttled: Mapping[str, int] = field(default_factory=dict)
    evicted: Mapping[str, Eviction] = field(default_factory=dict)
    calm_since: float | None = None
    last_restore: float | None = None


@dataclass(frozen=True)
class Decision:
    state: LoopState
    actions: tuple[Action, ...]
    measured: Measured | None
    batch: Batch | None
