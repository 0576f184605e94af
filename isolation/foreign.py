"""Foreign CPU time: how much of a guaranteed slot's CPUs went to anything that is not the slot.

What host partitioning cannot move (per-CPU kernel threads, managed interrupts, softirqs raised by
the slot's own traffic) and what it has not moved yet still runs on an exclusive CPU. The kernel
counts every CPU's time by kind in /proc/stat and every cgroup's own CPU time, so for a slot on CPUs
C between two readings::

    busy(C)     = user + nice + system + irq + softirq     (guest time is inside user)
    foreign(C)  = busy(C) - the slot cgroup's own usage    (clamped at 0)

Interrupt time is kept out of task runtime (IRQ_TIME_ACCOUNTING), so the slot's usage never holds
it: irq and softirq time on C is foreign by this definition, and is also given on its own
(``irq_seconds``) because it is what host partitioning cannot always move. Steal time (the
hypervisor running another guest) is not counted: nothing on this host can act on it.

/proc/stat counts in clock ticks (USER_HZ, 100 per second on Linux), so figures are good to about
10 ms per CPU per reading: meaningful over seconds, not over one request.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import Procfs
from nodeagent.procfmt import parse_cpu_ticks

USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTicks:
    """One CPU's counters from /proc/stat, in ticks."""

    busy: int  #: user + nice + system + irq + softirq
    irq: int  #: irq + softirq


def parse_proc_stat(text: str) -> dict[int, CpuTicks]:
    """Per-CPU busy and interrupt ticks from /proc/stat's ``cpuN`` lines."""
    found: dict[int, CpuTicks] = {}
    for cpu, values in parse_cpu_ticks(text).items():
        user, nice, system, _idle, _iowait, irq, softirq = (*values[:7], 0, 0, 0, 0, 0, 0, 0)[:7]
        found[cpu] = CpuTicks(user + nice + system + irq + softirq, irq + softirq)
    return found


def read_proc_stat(proc: Path = Path("/proc")) -> dict[int, CpuTicks]:
    text = Procfs(proc).read_text("stat")
    if text is None:
        raise DiscoveryError(f"reading {proc / 'stat'}: no such file; is procfs mounted at {proc}?")
    return parse_proc_stat(text)


@dataclass(frozen=True)
class ForeignCpu:
    """CPU time spent on a slot's CPUs by anything else, since ``since`` (Unix time)."""

    seconds: float  #: foreign CPU seconds, interrupts included
    fraction: float  #: of the slot's CPU capacity over the period (seconds / (elapsed x CPUs))
    since: float
    irq_seconds: float  #: of which hard and soft interrupt handling
    elapsed: float  #: length of the period in seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 3),
            "fraction": round(self.fraction, 6),
            "since": self.since,
            "irq_seconds": round(self.irq_seconds, 3),
        }


def foreign_seconds(
    before: Mapping[int, CpuTicks],
    after: Mapping[int, CpuTicks],
    cpus: frozenset[int],
    slot_usage_ns: int,
    hz: int = USER_HZ,
) -> tuple[float, float]:
    """(foreign seconds, interrupt seconds) on ``cpus`` between two readings, given the slot's own
    CPU time between them (pure)."""
    busy = sum(after[c].busy - before[c].busy for c in cpus if c in after and c in before)
    irq = sum(after[c].irq - before[c].irq for c in cpus if c in after and c in before)
    return max(0.0, busy / hz - slot_usage_ns / 1e9), irq / hz


@dataclass(frozen=True)
class _Baseline:
    ticks: Mapping[int, CpuTicks]
    usage_ns: int
    cpus: frozenset[int]
    at: float  #: Unix time
    monotonic: float


class ForeignCpuMeter:
    """Foreign CPU time per slot since the meter first saw it (its baseline); a slot whose CPUs
    change (resize) starts a new baseline. /proc/stat is read at most once per ``cache_seconds``."""

    def __init__(
        self,
        proc: Path = Path("/proc"),
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        cache_seconds: float = 0.2,
    ) -> None:
        self.proc = proc
        self._clock = clock
        self._monotonic = monotonic
        self._cache_seconds = cache_seconds
        self._baselines: dict[str, _Baseline] = {}
        self._stat: tuple[float, dict[int, CpuTicks]] | None = None
        self._lock = threading.Lock()

    def measure(self, slot_id: str, cpus: frozenset[int], usage_ns: int) -> ForeignCpu:
        with self._lock:
            now = self._monotonic()
            ticks = self._ticks(now)
            base = self._baselines.get(slot_id)
            if base is None or base.cpus != cpus or usage_ns < base.usage_ns:
                base = self._baselines[slot_id] = _Baseline(ticks, usage_ns, cpus, self._clock(), now)
            seconds, irq = foreign_seconds(base.ticks, ticks, cpus, usage_ns - base.usage_ns)
            elapsed = now - base.monotonic
            capacity = elapsed * len(cpus)
            return ForeignCpu(
                seconds=seconds,
                fraction=min(1.0, seconds / capacity) if capacity > 0 else 0.0,
                since=base.at,
                irq_seconds=irq,
                elapsed=elapsed,
            )

    def forget(self, slot_id: str) -> None:
        """Drop a released slot's baseline."""
        with self._lock:
            self._baselines.pop(slot_id, None)

    def _ticks(self, now: float) -> dict[int, CpuTicks]:
        if self._stat is None or now - self._stat[0] >= self._cache_seconds:
            self._stat = (now, read_proc_stat(self.proc))
        return self._stat[1]


__all__ = [
    "USER_HZ",
    "CpuTicks",
    "ForeignCpu",
    "ForeignCpuMeter",
    "foreign_seconds",
    "parse_proc_stat",
    "read_proc_stat",
]
