"""Per-QoS-class cgroup parameters, as plain data.

The three classes of the design:

- ``guaranteed``: exclusive whole cores (the cpuset does the isolation, so no CFS quota: a quota
  on exclusive cores only adds throttling stalls to tail latency), memory limit = request, no
  swap, the lowest OOM score.
- ``burstable``: the shared pool with a CFS quota of the requested (fractional) CPUs and a weight
  in proportion, memory limit = request.
- ``best-effort``: the shared pool at the minimal weight, in an idle group (``cpu.idle``, kernel
  5.15+) or, where the kernel lacks it, with its processes under ``SCHED_IDLE``; memory.high as a
  soft limit (reclaim pressure, no OOM kill) with an optional harder memory.max cap above it.

This module decides numbers only; the cgroup managers write them. Weights are given on both
scales: cgroup v2 ``cpu.weight`` (1..10000, default 100) and v1 ``cpu.shares`` (2..262144,
default 1024), converted linearly so that one CPU's worth is the kernel's default on both
(as systemd converts CPUShares to CPUWeight).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, get_args

# The knobs' ranges and the shares <-> weight conversion are the cgroup layer's (one definition).
from nodeagent.cgroups.resources import (
    CPU_SHARES_DEFAULT,
    CPU_SHARES_MAX,
    CPU_SHARES_MIN,
    CPU_WEIGHT_MIN,
    shares_to_weight,
)
from nodeagent.errors import InvalidRequest, Unsupported, translate_os_error

QosClassName = Literal["guaranteed", "burstable", "best-effort"]
QOS_CLASSES: tuple[QosClassName, ...] = get_args(QosClassName)

IO_WEIGHT_MIN, IO_WEIGHT_MAX = 1, 10_000
BLKIO_WEIGHT_MIN, BLKIO_WEIGHT_MAX = 10, 1000
# The kernel refuses cpu.max / cfs_quota_us quotas below 1 ms and periods outside 1 ms..1 s.
CFS_QUOTA_MIN_US = 1000
CFS_PERIOD_MIN_US, CFS_PERIOD_MAX_US = 1000, 1_000_000
OOM_SCORE_ADJ_GUARANTEED, OOM_SCORE_ADJ_BEST_EFFORT = -997, 1000


@dataclass(frozen=True)
class QosDefaults:
    """Tunables behind the class parameters; every field has a sensible default."""

    cfs_period_us: int = 100_000
    pids_max: int = 4096
    # v2 io.weight per class (v1 blkio.weight is derived).
    io_weight_guaranteed: int = 200
    io_weight_burstable: int = 100
    io_weight_best_effort: int = 1
    # memory.max for best-effort as a multiple of its memory.high; None leaves it unlimited.
    best_effort_memory_max_factor: float | None = 2.0
    # Online classes run without swap: a page-in in the request path is a latency spike.
    disable_swap_for_online: bool = True
    # Quota a suppressed best-effort slot is cut to while online slots need the CPU.
    suppressed_cpus: float = 0.01

    def __post_init__(self) -> None:
        if not CFS_PERIOD_MIN_US <= self.cfs_period_us <= CFS_PERIOD_MAX_US:
            raise InvalidRequest(
                f"cfs_period_us {self.cfs_period_us} is outside the kernel's range "
                f"{CFS_PERIOD_MIN_US}..{CFS_PERIOD_MAX_US}"
            )
        if self.pids_max < 1:
            raise InvalidRequest(f"pids_max must be at least 1, got {self.pids_max}")
        for name in ("io_weight_guaranteed", "io_weight_burstable", "io_weight_best_effort"):
            value = getattr(self, name)
            if not IO_WEIGHT_MIN <= value <= IO_WEIGHT_MAX:
                raise InvalidRequest(f"{name} {value} is outside {IO_WEIGHT_MIN}..{IO_WEIGHT_MAX}")
        if self.best_effort_memory_max_factor is not None and self.best_effort_memory_max_factor < 1:
            raise InvalidRequest(
                f"best_effort_memory_max_factor must be at least 1 (memory.max >= memory.high), "
                f"got {self.best_effort_memory_max_factor}"
            )
        if self.suppressed_cpus <= 0:
            raise InvalidRequest(f"suppressed_cpus must be positive, got {self.suppressed_cpus}")


@dataclass(frozen=True)
class QosParameters:
    """What to write for one slot. None means "no limit" (v2 "max", v1 -1) or "leave unset"."""

    qos: QosClassName
    cpu_weight: int  # v2 cpu.weight
    cpu_shares: int  # v1 cpu.shares
    cpu_quota_us: int | None  # v2 cpu.max first field, v1 cpu.cfs_quota_us
    cpu_period_us: int
    cpu_idle: bool  # write cpu.idle = 1
    sched_idle: bool  # put the slot's processes under SCHED_IDLE (no cpu.idle here)
    memory_max: int | None  # v2 memory.max, v1 memory.limit_in_bytes
    memory_high: int | None  # v2 memory.high, v1 memory.soft_limit_in_bytes
    memory_swap_max: int | None  # v2 memory.swap.max; on v1 memsw limit = memory_max + this
    pids_max: int
    io_weight: int  # v2 io.weight
    blkio_weight: int  # v1 blkio.weight
    oom_score_adj: int


def qos_parameters(
    qos: str,
    *,
    cpus: float | None,
    memory_bytes: int | None,
    cpu_idle_available: bool,
    machine_memory_bytes: int | None = None,
    defaults: QosDefaults = QosDefaults(),
) -> QosParameters:
    """The cgroup parameters for a slot of class ``qos`` asking for ``cpus`` and ``memory_bytes``.

    ``cpu_idle_available`` says whether the slot's cgroup has ``cpu.idle`` (see
    :func:`cpu_idle_supported`); ``machine_memory_bytes`` refines a burstable slot's OOM score.
    Raises InvalidRequest when the request does not fit its class.
    """
    qos_class = _qos_class(qos)
    _check_request(qos_class, cpus, memory_bytes)
    if qos_class == "guaranteed":
        return _guaranteed(cpus or 0, memory_bytes or 0, defaults)
    if qos_class == "burstable":
        return _burstable(cpus, memory_bytes or 0, machine_memory_bytes, defaults)
    return _best_effort(memory_bytes, cpu_idle_available, defaults)


def suppressed(params: QosParameters, defaults: QosDefaults = QosDefaults()) -> QosParameters:
    """A best-effort slot's parameters while online slots need the CPU: its quota cut to a sliver."""
    if params.qos != "best-effort":
        raise InvalidRequest(f"only best-effort slots are suppressed, not {params.qos}")
    quota = max(CFS_QUOTA_MIN_US, round(defaults.suppressed_cpus * params.cpu_period_us))
    return replace(params, cpu_quota_us=quota)


def cpus_to_shares(cpus: float) -> int:
    """CPU shares for a CPU count: 1024 per CPU, within the kernel's range."""
    return _clamp(round(cpus * CPU_SHARES_DEFAULT), CPU_SHARES_MIN, CPU_SHARES_MAX)


def quota_us(cpus: float, period_us: int) -> int:
    """CFS quota for ``cpus`` CPUs per ``period_us`` (0.5 CPU at 100 ms -> 50 ms), at least 1 ms."""
    return max(CFS_QUOTA_MIN_US, round(cpus * period_us))


def io_weight_to_blkio(weight: int) -> int:
    """v2 io.weight to v1 blkio.weight, keeping default to default (100 -> 500)."""
    return _clamp(weight * 5, BLKIO_WEIGHT_MIN, BLKIO_WEIGHT_MAX)


def cpu_idle_supported(cpu_cgroup_dir: Path) -> bool:
    """Whether the kernel offers ``cpu.idle`` (5.15+) in this cpu-controller cgroup directory."""
    return (cpu_cgroup_dir / "cpu.idle").is_file()


def sched_idle_supported() -> bool:
    """Whether this platform has the SCHED_IDLE policy (Linux does; os exposes it there)."""
    return hasattr(os, "SCHED_IDLE")


def set_sched_idle(pid: int) -> None:
    """Put ``pid`` under SCHED_IDLE: it runs only when nothing else wants the CPU."""
    if not sched_idle_supported():
        raise Unsupported("SCHED_IDLE is not available on this platform; best-effort runs at minimal weight")
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except OSError as err:
        raise translate_os_error(f"set SCHED_IDLE on pid {pid}", err) from err


def _qos_class(qos: str) -> QosClassName:
    for name in QOS_CLASSES:
        if qos == name:
            return name
    raise InvalidRequest(f"unknown QoS class {qos!r}; use one of {', '.join(QOS_CLASSES)}")


def _check_request(qos: QosClassName, cpus: float | None, memory_bytes: int | None) -> None:
    if cpus is not None and cpus < 0:
        raise InvalidRequest(f"{qos} slot asks for {cpus} CPUs; a CPU count cannot be negative")
    if memory_bytes is not None and memory_bytes < 0:
        raise InvalidRequest(f"{qos} slot asks for {memory_bytes} bytes of memory; cannot be negative")
    if qos == "guaranteed" and (cpus is None or cpus < 1 or cpus != int(cpus)):
        raise InvalidRequest(
            f"guaranteed slot asks for {cpus} CPUs; guaranteed slots get exclusive whole CPUs, "
            "so ask for a positive integer or use the burstable class"
        )
    if qos in ("guaranteed", "burstable") and not memory_bytes:
        raise InvalidRequest(
            f"{qos} slot asks for no memory; its memory limit is its request, so give resources.memory"
        )
    if qos == "burstable" and cpus is not None and cpus == 0:
        raise InvalidRequest("burstable slot asks for 0 CPUs; give a positive (fractional) count")


def _guaranteed(cpus: float, memory_bytes: int, d: QosDefaults) -> QosParameters:
    shares = cpus_to_shares(cpus)
    return QosParameters(
        qos="guaranteed",
        cpu_weight=shares_to_weight(shares),
        cpu_shares=shares,
        cpu_quota_us=None,
        cpu_period_us=d.cfs_period_us,
        cpu_idle=False,
        sched_idle=False,
        memory_max=memory_bytes,
        memory_high=None,
        memory_swap_max=0 if d.disable_swap_for_online else None,
        pids_max=d.pids_max,
        io_weight=d.io_weight_guaranteed,
        blkio_weight=io_weight_to_blkio(d.io_weight_guaranteed),
        oom_score_adj=OOM_SCORE_ADJ_GUARANTEED,
    )


def _burstable(
    cpus: float | None, memory_bytes: int, machine_memory_bytes: int | None, d: QosDefaults
) -> QosParameters:
    shares = cpus_to_shares(cpus) if cpus else CPU_SHARES_DEFAULT
    return QosParameters(
        qos="burstable",
        cpu_weight=shares_to_weight(shares),
        cpu_shares=shares,
        cpu_quota_us=quota_us(cpus, d.cfs_period_us) if cpus else None,
        cpu_period_us=d.cfs_period_us,
        cpu_idle=False,
        sched_idle=False,
        memory_max=memory_bytes,
        memory_high=None,
        memory_swap_max=0 if d.disable_swap_for_online else None,
        pids_max=d.pids_max,
        io_weight=d.io_weight_burstable,
        blkio_weight=io_weight_to_blkio(d.io_weight_burstable),
        oom_score_adj=_burstable_oom_score(memory_bytes, machine_memory_bytes),
    )


def _best_effort(memory_bytes: int | None, cpu_idle_available: bool, d: QosDefaults) -> QosParameters:
    factor = d.best_effort_memory_max_factor
    memory_max = round(memory_bytes * factor) if memory_bytes and factor is not None else None
    return QosParameters(
        qos="best-effort",
        cpu_weight=CPU_WEIGHT_MIN,
        cpu_shares=CPU_SHARES_MIN,
        cpu_quota_us=None,
        cpu_period_us=d.cfs_period_us,
        cpu_idle=cpu_idle_available,
        sched_idle=not cpu_idle_available,
        memory_max=memory_max,
        memory_high=memory_bytes or None,
        memory_swap_max=None,
        pids_max=d.pids_max,
        io_weight=d.io_weight_best_effort,
        blkio_weight=io_weight_to_blkio(d.io_weight_best_effort),
        oom_score_adj=OOM_SCORE_ADJ_BEST_EFFORT,
    )


def _burstable_oom_score(memory_bytes: int, machine_memory_bytes: int | None) -> int:
    # Kubernetes' rule: the more of the machine a burstable slot reserved, the later it is killed;
    # always after best-effort (1000) and before guaranteed (-997).
    if not machine_memory_bytes:
        return 500
    return _clamp(1000 - (1000 * memory_bytes) // machine_memory_bytes, 2, 999)


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))
