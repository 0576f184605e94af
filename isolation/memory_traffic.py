"""Each best-effort slot's cumulative memory traffic, estimated from last-level-cache misses.

On hosts without Intel RDT memory-bandwidth monitoring, the colocation loop still needs to tell a
memory-bandwidth hog from a CPU-bound neighbour: LLC misses × 64 bytes (one cache line each) is the
proxy. It is read with perf_event_open(2) in per-thread mode (pid = tid, cpu = -1) with ``inherit``:
threads and processes that a counted thread creates later are counted in its counter (a read of the
parent fd sums the live children; an exited child's count is folded into the parent), so only the
threads present when a lineage is first seen need a counter of their own.

Hand-written over ctypes because no maintained PyPI binding for perf_event_open exists: the
kernel's own ``perf`` Python binding (tools/perf/python) is built with the kernel tree, not
published, and the PyPI ``pyperf`` is an unrelated benchmark runner. Only counting mode is used
(no sampling, no ring buffer), which is a 128-byte struct, one syscall and a 24-byte read.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.kernelfs import Procfs
from nodeagent.libc import check, libc

log = logging.getLogger(__name__)

# include/uapi/linux/perf_event.h
PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_HW_CACHE_MISSES = 3
PERF_COUNT_SW_TASK_CLOCK = 1
PERF_FORMAT_TOTAL_TIME_ENABLED = 1
PERF_FORMAT_TOTAL_TIME_RUNNING = 2
PERF_FLAG_FD_CLOEXEC = 8
_ATTR_INHERIT = 1 << 1
_ATTR_EXCLUDE_HV = 1 << 6  # kernel time is kept: a hog's page-ins and copies are its traffic too

#: perf_event_open's number per ``os.uname().machine`` (arch syscall tables; asm-generic for arm64/riscv).
SYSCALL_NUMBERS = {"x86_64": 298, "aarch64": 241, "ppc64le": 319, "s390x": 331, "riscv64": 241}
#: errnos meaning the event cannot be counted on this host at all (no PMU, or not this event).
_NO_PMU = frozenset({errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV})
_DENIED = frozenset({errno.EACCES, errno.EPERM})
#: How far up the parent chain a new process is traced to a counted ancestor (bounds /proc reads).
MAX_ANCESTRY = 32


@dataclass(frozen=True)
class PerfEvent:
    type: int
    config: int
    name: str


LLC_MISSES = PerfEvent(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_MISSES, "cache-misses")
#: Software event (nanoseconds on CPU); counts on any host, so the tests use it.
TASK_CLOCK = PerfEvent(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK, "task-clock")


class _Attr(ctypes.Structure):
    """The leading fields of ``struct perf_event_attr``; the rest (zero) pads it to 128 bytes."""

    _fields_ = (
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),  # the bitfield: disabled, inherit, ..., exclude_hv, ...
        ("_rest", ctypes.c_uint8 * 80),
    )


assert ctypes.sizeof(_Attr) == 128


def open_counter(event: PerfEvent, tid: int) -> int:
    """Open a counting, inherited ``event`` on thread ``tid`` (0: the caller); OSError on failure."""
    machine = os.uname().machine
    number = SYSCALL_NUMBERS.get(machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"no perf_event_open syscall number known for machine {machine!r}")
    attr = _Attr(
        type=event.type,
        size=ctypes.sizeof(_Attr),
        config=event.config,
        read_format=PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING,
        flags=_ATTR_INHERIT | _ATTR_EXCLUDE_HV,
    )
    # No argtypes on the shared handle's syscall (other modules call it with other arguments):
    # each argument carries its C type.
    fd = libc.syscall(
        ctypes.c_long(number),
        ctypes.byref(attr),
        ctypes.c_int(tid),
        ctypes.c_int(-1),  # any CPU: the counter follows the thread
        ctypes.c_int(-1),  # no group
        ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )
    return check(int(fd), f"perf_event_open({event.name}, tid {tid})")


def read_counter(fd: int) -> tuple[int, int, int]:
    """(value, time enabled, time running) of a counter opened by :func:`open_counter`."""
    value, enabled, running = struct.unpack("=QQQ", os.read(fd, 24))
    return value, enabled, running


_syscall_open = open_counter
_syscall_read = read_counter


def scaled(value: int, enabled: int, running: int) -> int:
    """The count estimated over the whole enabled time: with more events than hardware counters
    the kernel multiplexes, and a counter that ran part of the time is scaled up by the kernel's
    own ratio; one that never ran has counted nothing."""
    if running <= 0:
        return 0
    if running < enabled:
        return value * enabled // running
    return value


def explain(event: PerfEvent, err: OSError, proc_root: Path = Path("/proc")) -> str:
    """Why ``event`` cannot be counted, for a log line or a status field."""
    reason = f"perf_event_open({event.name}): {err.strerror or err}"
    if err.errno in _NO_PMU:
        return f"{reason} (no hardware PMU: the host or hypervisor exposes no CPU performance counters)"
    if err.errno in _DENIED:
        paranoid = Procfs(proc_root).read_text("sys/kernel/perf_event_paranoid")
        return f"{reason} (not allowed: needs root or CAP_PERFMON (kernel.perf_event_paranoid={paranoid}))"
    if err.errno == errno.ENOSYS and os.uname().machine in SYSCALL_NUMBERS:
        return f"{reason} (kernel built without perf events)"
    return reason


def probe(event: PerfEvent = LLC_MISSES) -> str | None:
    """None when ``event`` can be counted here (tried on the calling thread), else why not."""
    try:
        os.close(open_counter(event, 0))
    except OSError as err:
        return explain(event, err)
    return None


def _boot_ticks() -> int:
    """Now in /proc/PID/stat's start-time unit: clock ticks since boot (suspend included)."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // (1_000_000_000 // os.sysconf("SC_CLK_TCK"))


@dataclass
class _Slot:
    #: every pid seen in the slot and still there -> the pid whose counters count it (itself for a
    #: pid with counters of its own: a root), None where it is not counted
    cover: dict[int, int | None] = field(default_factory=dict)
    fds: dict[int, list[int]] = field(default_factory=dict)  # root -> one fd per thread it had
    opened: dict[int, int] = field(default_factory=dict)  # root -> _boot_ticks() before its opens
    retired: int = 0  # events of counters closed since (their processes left)
    counted: bool = False  # a counter was ever open: 0 is then a measurement, not "unknown"
    last: int = 0
    warned: bool = False


class MemoryTraffic:
    """Cumulative memory traffic per slot, in bytes (``bytes_per_event`` per counted event).

    ``open_counter(event, tid) -> fd`` and ``read_counter(fd) -> (value, enabled, running)``
    default to the system calls; a test passes fakes and a fake ``proc_root``. One fd is held per
    thread that existed when its process was first seen (later ones are inherited), so the
    agent's RLIMIT_NOFILE needs room for the best-effort slots' first threads.
    """

    def __init__(
        self,
        *,
        event: PerfEvent = LLC_MISSES,
        bytes_per_event: int = 64,
        proc_root: Path = Path("/proc"),
        open_counter: Callable[[PerfEvent, int], int] | None = None,
        read_counter: Callable[[int], tuple[int, int, int]] | None = None,
    ) -> None:
        self.event = event
        self.bytes_per_event = bytes_per_event
        self.proc_root = Path(proc_root)
        self._procfs = Procfs(self.proc_root)
        self._open = open_counter or _syscall_open
        self._read = read_counter or _syscall_read
        self._slots: dict[str, _Slot] = {}
        #: Why the event cannot be counted on this host at all; once set, nothing is opened again.
        self.unavailable: str | None = None

    def read(self, slot_id: str, pids: Iterable[int]) -> int | None:
        """The slot's traffic so far given its processes now; None when nothing is measured."""
        slot = self._slots.setdefault(slot_id, _Slot())
        current = set(pids)
        # Set differences only: a period with no new and no gone pids reads nothing from /proc.
        for pid in slot.cover.keys() - current:
            self._leave(slot_id, slot, pid, current)
        for pid in sorted(current - slot.cover.keys()):
            if self.unavailable is None:
                self._place(slot_id, slot, pid)
        if not slot.counted:
            return None
        total = slot.retired + sum(self._value(fd) for fds in slot.fds.values() for fd in fds)
        # Scaled (multiplexed) estimates can dip between reads; a cumulative figure must not.
        slot.last = max(slot.last, total * self.bytes_per_event)
        return slot.last

    def forget(self, keep: Iterable[str]) -> None:
        """Close the counters of every slot not in ``keep``."""
        kept = set(keep)
        for slot_id in [s for s in self._slots if s not in kept]:
            for fds in self._slots.pop(slot_id).fds.values():
                _close_all(fds)

    def close(self) -> None:
        self.forget(())

    def open_counters(self) -> int:
        return sum(len(fds) for slot in self._slots.values() for fds in slot.fds.values())

    def _value(self, fd: int) -> int:
        return scaled(*self._read(fd))

    def _leave(self, slot_id: str, slot: _Slot, pid: int, current: set[int]) -> None:
        """``pid`` left the slot: a root's counters are read one last time and closed."""
        if slot.cover.pop(pid) != pid:
            return  # inherited or uncounted: nothing of its own to close
        fds = slot.fds.pop(pid)
        slot.retired += sum(self._value(fd) for fd in fds)
        del slot.opened[pid]
        _close_all(fds)  # this also ends the inherited counters of its descendants...
        orphans = sorted(p for p, root in slot.cover.items() if root == pid and p in current)
        for orphan in orphans:  # ...so those still in the slot get counters of their own
            del slot.cover[orphan]
        for orphan in orphans:
            self._open_root(slot_id, slot, orphan)

    def _place(self, slot_id: str, slot: _Slot, pid: int) -> None:
        """Count a pid new to the slot: by inheritance when a counted ancestor created it (or its
        line) after that ancestor's counters were opened, else with counters of its own."""
        child = pid
        for _ in range(MAX_ANCESTRY):
            stat = self._procfs.read_text(f"{child}/stat")
            if stat is None:
                if child == pid:
                    return  # it already ended
                break
            # comm may hold spaces and ')': the fields after its last ')' are state, ppid, ...
            fields = stat.rpartition(")")[2].split()
            parent, start = int(fields[1]), int(fields[19])
            if parent in slot.cover:
                root = slot.cover[parent]
                # A child of a root itself may have been forked between the caller's listing and
                # the root's open, which inheritance missed: only a start after the open (in clock
                # ticks; the same tick counts as before) proves it is inherited.
                if root is None or root != parent or start > slot.opened[parent]:
                    slot.cover[pid] = root
                    return
                break
            if parent <= 1:
                break
            child = parent
        self._open_root(slot_id, slot, pid)

    def _open_root(self, slot_id: str, slot: _Slot, pid: int) -> None:
        """Open a counter on each of ``pid``'s threads. One that cannot be counted is remembered as
        uncounted, so that a failing pid is not tried again every period, and logged once a slot."""
        threads = self._procfs.listdir(f"{pid}/task")
        if threads is None:
            return  # it ended
        opened_at = _boot_ticks()
        fds: list[int] = []
        for tid in threads:
            try:
                fds.append(self._open(self.event, int(tid)))
            except OSError as err:
                if err.errno == errno.ESRCH:
                    continue  # the thread ended after the listing
                _close_all(fds)
                slot.cover[pid] = None
                reason = explain(self.event, err, self.proc_root)
                if err.errno in _NO_PMU or err.errno == errno.ENOSYS:
                    self.unavailable = reason  # the same for every pid: stop trying
                if not slot.warned:
                    slot.warned = True
                    log.warning("slot %s: memory traffic of pid %d is not counted: %s", slot_id, pid, reason)
                return
        slot.cover[pid] = pid if fds else None
        if fds:
            slot.fds[pid] = fds
            slot.opened[pid] = opened_at
            slot.counted = True


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


__all__ = [
    "LLC_MISSES",
    "MAX_ANCESTRY",
    "SYSCALL_NUMBERS",
    "TASK_CLOCK",
    "MemoryTraffic",
    "PerfEvent",
    "explain",
    "open_counter",
    "probe",
    "read_counter",
    "scaled",
]
