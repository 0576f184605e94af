"""Plain data the managers take and give: resource settings, statistics and OOM counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nodeagent.errors import InvalidRequest

#: The value that lifts a limit (v2 writes ``max``, v1 writes ``-1``).
UNLIMITED = -1

CPU_WEIGHT_MIN, CPU_WEIGHT_MAX, CPU_WEIGHT_DEFAULT = 1, 10000, 100
CPU_SHARES_MIN, CPU_SHARES_MAX, CPU_SHARES_DEFAULT = 2, 262144, 1024


@dataclass(frozen=True)
class CgroupLimits:
    """What to set on a cgroup. ``None`` leaves a setting as it is; :data:`UNLIMITED` lifts a limit.

    Units are v2's; the v1 manager converts (``cpu_weight`` to cpu.shares, ``memory_swap_max`` to
    memsw = memory + swap, ``memory_high`` to the soft limit, ``io_weight`` to the blkio weight).
    """

    cpuset_cpus: frozenset[int] | None = None
    cpuset_mems: frozenset[int] | None = None
    cpu_weight: int | None = None  # 1..10000, 100 is the default
    cpu_quota_us: int | None = None  # per period; UNLIMITED for no quota
    cpu_period_us: int | None = None
    cpu_idle: bool | None = None  # SCHED_IDLE for the whole group (kernel 5.15+)
    memory_max: int | None = None  # bytes
    memory_high: int | None = None  # bytes: throttle and reclaim above this
    memory_swap_max: int | None = None  # bytes of swap on top of memory_max
    pids_max: int | None = None
    io_weight: int | None = None  # 1..10000, 100 is the default

    def __post_init__(self) -> None:
        _check_range("cpu_weight", self.cpu_weight, CPU_WEIGHT_MIN, CPU_WEIGHT_MAX)
        _check_range("io_weight", self.io_weight, 1, 10000)
        _check_range("cpu_period_us", self.cpu_period_us, 1000, 1_000_000)
        if self.cpu_quota_us is not None and self.cpu_quota_us != UNLIMITED:
            _check_range("cpu_quota_us", self.cpu_quota_us, 1000, 2**63 - 1)
        for name in ("memory_max", "memory_high", "memory_swap_max", "pids_max"):
            value = getattr(self, name)
            if value is not None and value != UNLIMITED and value < 0:
                raise InvalidRequest(f"{name} must be >= 0 or UNLIMITED (-1), got {value}")
        for name in ("cpuset_cpus", "cpuset_mems"):
            ids = getattr(self, name)
            if ids is not None and any(i < 0 for i in ids):
                raise InvalidRequest(f"{name} must hold non-negative ids, got {sorted(ids)}")


def _check_range(name: str, value: int | None, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{name} must be in {low}..{high}, got {value}")


def weight_to_shares(weight: int) -> int:
    """cgroup v2 cpu.weight to v1 cpu.shares, keeping default at default (100 -> 1024)."""
    return max(CPU_SHARES_MIN, min(CPU_SHARES_MAX, round(weight * CPU_SHARES_DEFAULT / CPU_WEIGHT_DEFAULT)))


def shares_to_weight(shares: int) -> int:
    """The inverse of :func:`weight_to_shares` (1024 -> 100)."""
    return max(CPU_WEIGHT_MIN, min(CPU_WEIGHT_MAX, round(shares * CPU_WEIGHT_DEFAULT / CPU_SHARES_DEFAULT)))


@dataclass(frozen=True)
class OomEvents:
    """OOM counts of a cgroup: ``oom`` times it hit its limit, ``oom_kill`` processes killed.

    v1 has no persistent "oom" counter; there it is None except from a watcher, which counts
    the notifications it received.
    """

    oom: int | None
    oom_kill: int | None


@dataclass(frozen=True)
class CgroupStats:
    """One snapshot of a cgroup's usage. A figure the kernel does not provide is None."""

    cpu_usage_ns: int | None
    cpu_periods: int | None
    cpu_throttled_periods: int | None
    cpu_throttled_ns: int | None
    memory_current: int | None
    memory_peak: int | None
    oom: OomEvents
    pids_current: int | None

    def ran_since(self, cpu_usage_ns: int | None) -> bool:
        """Whether the group used CPU between this snapshot and a later reading of ``cpu_usage_ns``.

        A group that used none ran nothing, so the figures that only move while one of its tasks
        runs have not moved either: throttling (a period counts only once the group used some of
        its quota), OOM events (the charge that hits the limit is made by a task of the group, and
        the victim runs to exit) and, while the memory in use stays at or below it, the peak. A
        reader of many idle groups (the metrics scrape at 500 slots) then reads two files of each,
        not five (issue 23). CPU time reaches the counter at the next tick or switch, so this holds
        for readings more than a tick apart; each snapshot's own CPU time is read before the rest.
        """
        return cpu_usage_ns is None or cpu_usage_ns != self.cpu_usage_ns

    def peak_after(self, memory_current: int | None, read_peak: Callable[[], int | None]) -> int | None:
        """The peak of a group that has not run since this snapshot, given its memory in use now:
        this snapshot's, unless the memory in use is above it (a charge made from outside the
        group, as a shared page swapped back in): then read (``read_peak``)."""
        peak = self.memory_peak
        if memory_current is not None and (peak is None or memory_current > peak):
            return read_peak()
        return peak
