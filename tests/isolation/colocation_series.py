"""Building sample series for the colocation decision tests: rates in, cumulative counters out.

A :class:`Series` keeps the kernel's cumulative counters (per-CPU busy time, cgroup CPU time, PSI
totals) and turns "this period online work used 1.2 CPUs on CPU 0" into the next :class:`Sample`,
the way the sampler would have read it. :func:`run` feeds a series through :func:`decide`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nodeagent.isolation.colocation import (
    BURSTABLE_GROUP,
    BestEffortSlot,
    ColocationConfig,
    Decision,
    GroupUsage,
    LoopState,
    Sample,
    Stall,
    decide,
)

GiB = 1 << 30
MiB = 1 << 20
F = frozenset


@dataclass
class Period:
    """One period's activity, as rates (CPUs, or the share of the period stalled)."""

    busy: Mapping[int, float] = field(default_factory=dict)  # per CPU, all work
    best_effort_cpu: float = 0.0  # CPUs the best-effort class used
    #: CPUs the burstable class (the online slots on the pool) used; None: all the pool's use that
    #: is not best-effort's (no host use beside the slots)
    online_cpu: float | None = None
    slot_cpu: Mapping[str, float] = field(default_factory=dict)  # per best-effort slot
    online_stall: Mapping[str, float] | None = None  # resource -> share, per-group PSI (v2)
    node_stall: Mapping[str, float] = field(default_factory=dict)  # resource -> share
    memory_used: int | None = None  # node memory used (bytes); None: as before
    online_memory: int | None = None
    slot_memory: Mapping[str, int] = field(default_factory=dict)
    slot_traffic: Mapping[str, float] = field(default_factory=dict)  # bytes/s, per best-effort slot
    seconds: float = 1.0


@dataclass
class Series:
    pool: frozenset[int] = F({0, 1})
    core_of: Mapping[int, int] | None = None
    exclusive: frozenset[int] = F()
    memory_total: int = 16 * GiB
    memory_used: int = 4 * GiB
    online_memory: int = 1 * GiB
    best_effort: tuple[BestEffortSlot, ...] = ()
    time: float = 100.0
    busy_ns: dict[int, int] = field(default_factory=dict)
    be_ns: int = 0
    online_ns: int = 0
    online_cpu_readable: bool = True  # False: the burstable class's CPU time reads as unknown
    slot_ns: dict[str, int] = field(default_factory=dict)
    slot_memory: dict[str, int] = field(default_factory=dict)
    online_us: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "memory": 0, "io": 0})
    node_us: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "memory": 0, "io": 0})
    per_group_psi: bool = True
    traffic_counted: bool = False  # the sampler counts each best-effort slot's memory traffic
    resctrl_group: bool = False  # best-effort's shared resctrl group is in place
    slot_traffic: dict[str, int] = field(default_factory=dict)  # cumulative bytes

    def sample(self, period: Period | None = None) -> Sample:
        """The next sample after ``period`` (None: the first sample, nothing has happened yet)."""
        if period is not None:
            self.time += period.seconds
            for cpu, share in period.busy.items():
                self.busy_ns[cpu] = self.busy_ns.get(cpu, 0) + round(share * period.seconds * 1e9)
            self.be_ns += round(period.best_effort_cpu * period.seconds * 1e9)
            online = period.online_cpu
            if online is None:
                pool_busy = sum(period.busy.get(cpu, 0.0) for cpu in self.pool)
                online = max(0.0, pool_busy - period.best_effort_cpu)
            self.online_ns += round(online * period.seconds * 1e9)
            for slot, share in period.slot_cpu.items():
                self.slot_ns[slot] = self.slot_ns.get(slot, 0) + round(share * period.seconds * 1e9)
            for resource, share in (period.online_stall or {}).items():
                self.online_us[resource] += round(share * period.seconds * 1e6)
            for resource, share in period.node_stall.items():
                self.node_us[resource] += round(share * period.seconds * 1e6)
            if period.memory_used is not None:
                self.memory_used = period.memory_used
            if period.online_memory is not None:
                self.online_memory = period.online_memory
            self.slot_memory.update(period.slot_memory)
            for slot, rate in period.slot_traffic.items():
                self.slot_traffic[slot] = self.slot_traffic.get(slot, 0) + round(rate * period.seconds)
        cpus = sorted(self.pool | self.exclusive)
        for cpu in cpus:
            self.busy_ns.setdefault(cpu, 0)
        stall = Stall(**self.online_us) if self.per_group_psi else None
        slots = tuple(
            replace(
                s,
                usage=GroupUsage(
                    cpu_ns=self.slot_ns.get(s.slot_id, 0),
                    memory_bytes=self.slot_memory.get(s.slot_id, 64 * MiB),
                    stall=None,
                ),
                memory_traffic_bytes=self.slot_traffic.get(s.slot_id, 0) if self.traffic_counted else None,
            )
            for s in self.best_effort
        )
        return Sample(
            time=self.time,
            pool=self.pool,
            core_of=self.core_of if self.core_of is not None else {cpu: cpu for cpu in cpus},
            exclusive=self.exclusive,
            cpu_busy_ns=dict(self.busy_ns),
            memory_total=self.memory_total,
            memory_available=self.memory_total - self.memory_used,
            node_stall=Stall(**self.node_us),
            online={
                BURSTABLE_GROUP: GroupUsage(
                    cpu_ns=self.online_ns if self.online_cpu_readable else None,
                    memory_bytes=self.online_memory,
                    stall=stall,
                )
            },
            best_effort_cpu_ns=self.be_ns,
            best_effort=slots,
            traffic_counted=self.traffic_counted,
            resctrl_group=self.resctrl_group,
        )


def run(
    config: ColocationConfig, series: Series, periods: Iterable[Period], state: LoopState | None = None
) -> list[Decision]:
    """The first sample, then one per period; every decision in order (the first one included)."""
    decisions = [decide(config, state or LoopState(), series.sample())]
    for period in periods:
        decisions.append(decide(config, decisions[-1].state, series.sample(period)))
    return decisions


def load(online: float, best_effort: float, *, pool: Iterable[int] = (0, 1), host: float = 0.0) -> Period:
    """A period with ``online`` CPUs of the online slots' work, then ``host`` CPUs of the host's
    other work, filling the pool from its low end, and best-effort's ``best_effort`` CPUs filling
    it from the high end (what fits)."""
    cpus = sorted(pool)
    busy = dict.fromkeys(cpus, 0.0)
    for amount, order in ((online + host, cpus), (best_effort, list(reversed(cpus)))):
        rest = amount
        for cpu in order:
            take = min(rest, 1.0 - busy[cpu])
            busy[cpu] += take
            rest -= take
    return Period(busy=busy, best_effort_cpu=best_effort, online_cpu=online)


def sample_from_json(body: Mapping[str, Any]) -> Sample:
    """A sample as bench/colocation.py --record writes it (dataclasses as objects, int keys as text)."""

    def stall(value: Mapping[str, Any] | None) -> Stall | None:
        return None if value is None else Stall(**value)

    def usage(value: Mapping[str, Any]) -> GroupUsage:
        return GroupUsage(value["cpu_ns"], value["memory_bytes"], stall(value["stall"]))

    return Sample(
        time=body["time"],
        pool=frozenset(body["pool"]),
        core_of={int(k): v for k, v in body["core_of"].items()},
        exclusive=frozenset(body["exclusive"]),
        cpu_busy_ns={int(k): v for k, v in body["cpu_busy_ns"].items()},
        memory_total=body["memory_total"],
        memory_available=body["memory_available"],
        node_stall=Stall(**body["node_stall"]),
        online={name: usage(value) for name, value in body["online"].items()},
        best_effort_cpu_ns=body["best_effort_cpu_ns"],
        best_effort=tuple(
            BestEffortSlot(
                s["slot_id"],
                s["priority"],
                s["started_at"],
                usage(s["usage"]),
                s["memory_high"],
                s["running"],
                s["evicted"],
            )
            for s in body["best_effort"]
        ),
    )


def recorded(name: str) -> list[Sample]:
    """A series recorded on a real host (tests/isolation/data/<name>.json)."""
    path = Path(__file__).parent / "data" / f"{name}.json"
    return [sample_from_json(body) for body in json.loads(path.read_text())]
