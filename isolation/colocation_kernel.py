"""The kernel side of colocation control: the sampler that reads usage and pressure, and the
actuator that carries out the CPU and memory actions on best-effort slots.

The decision itself is :func:`nodeagent.isolation.colocation.decide` (pure). The sampler reads,
per period and on cgroup v1 or v2:

- ``/proc/stat`` (per-CPU busy time), ``/proc/meminfo`` (MemTotal, MemAvailable) and
  ``/proc/pressure/{cpu,memory,io}``, under an injectable proc root;
- the shared pool (the burstable class parent's cpuset);
- the burstable class parent and each guaranteed slot (the online groups): CPU time, memory,
  and on v2 their ``*.pressure`` files;
- the best-effort class parent's CPU time, and each best-effort slot's CPU time and memory;
- best-effort cgroups outside the agent (``also_best_effort``: the kubelet's ``besteffort`` QoS
  cgroup while NRI places pods' containers, whose work runs there and not in their empty slots),
  counted with the class;
- where the loop counts memory traffic (no MBA, cache-miss counters: the bandwidth proxy), each
  running best-effort slot's processes and their counters, in periods that read the slots.

That is about two reads per slot and ten per host: tens of microseconds a period on a quiet host.

The actuator writes best-effort's cpuset limit and class quota through the isolator (which keeps
the limit across its own pool updates), the same quota on each ``also_best_effort`` cgroup (not
the cpuset: NRI gave its containers theirs, and a v1 parent cannot narrow below its children's),
each slot's quota and memory.high (the soft limit on v1), and tends best-effort processes each
period: ``oom_score_adj`` 1000 (the kernel's OOM killer takes
them before any online process), ``SCHED_IDLE`` for their threads where the kernel has no
``cpu.idle`` (before 5.15: the class parent then has only the least weight, which still takes its
share when online work waits) and, where the host has resctrl, their small shared cache and
bandwidth group. Evictions and restores are the agent's (they stop and start workers).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from nodeagent.cgroups import UNLIMITED, CgroupHost, CgroupLimits, Hierarchy, open_manager
from nodeagent.cgroups import fs as cgroupfs
from nodeagent.cgroups.pressure import Pressure, read_cgroup_pressure, read_node_pressure
from nodeagent.cpulist import parse_cpulist
from nodeagent.errors import CgroupError, DiscoveryError, NodeAgentError
from nodeagent.isolation.colocation import BURSTABLE_GROUP, Action, BestEffortSlot, GroupUsage, Sample, Stall
from nodeagent.isolation.isolator import SlotIsolator, class_has_cpu_idle
from nodeagent.isolation.memory_traffic import MemoryTraffic
from nodeagent.isolation.qos import OOM_SCORE_ADJ_BEST_EFFORT, quota_us, sched_idle_supported, set_sched_idle
from nodeagent.isolation.resctrl import Resctrl
from nodeagent.kernelfs import Procfs
from nodeagent.procfmt import IRQ, NICE, SOFTIRQ, STEAL, SYSTEM, USER, meminfo_bytes, parse_cpu_ticks
from nodeagent.procfmt import parse_meminfo as meminfo_fields

log = logging.getLogger(__name__)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: /proc/stat cpuN fields counted as busy: user nice system (idle iowait) irq softirq steal.
_BUSY_FIELDS = (USER, NICE, SYSTEM, IRQ, SOFTIRQ, STEAL)


# --------------------------------------------------------------------------- /proc readers


def parse_proc_stat(text: str) -> dict[int, int]:
    """Cumulative busy time per CPU in nanoseconds from /proc/stat (guest time is already in user;
    steal counts as busy: time the hypervisor took is not ours to give to best-effort)."""
    busy: dict[int, int] = {}
    for cpu, values in parse_cpu_ticks(text).items():
        ticks = sum(values[i] for i in _BUSY_FIELDS if i < len(values))
        busy[cpu] = ticks * (1_000_000_000 // _CLOCK_TICKS)
    return busy


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; ValueError when either is missing."""
    info = meminfo_fields(text)
    total, available = meminfo_bytes(info.get("MemTotal")), meminfo_bytes(info.get("MemAvailable"))
    if total is None or available is None:
        found = sorted(k for k in ("MemTotal", "MemAvailable") if meminfo_bytes(info.get(k)) is not None)
        raise ValueError(f"no MemTotal/MemAvailable in meminfo (found {found})")
    return total, available


# --------------------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class SlotInfo:
    """What the agent knows of a slot that the kernel does not say: its class, and for
    best-effort slots the loop's ordering and whether its worker runs or was evicted."""

    slot_id: str
    qos: str
    priority: int = 0
    started_at: float = 0.0
    memory_high: int | None = None
    running: bool = False
    evicted: bool = False


class Sampler:
    """Reads one :class:`Sample` per call. ``proc_root`` and the cgroup host are injectable."""

    def __init__(
        self,
        host: CgroupHost,
        hierarchy: Hierarchy,
        *,
        allowed: frozenset[int],
        core_of: Mapping[int, int],
        proc_root: Path = Path("/proc"),
        traffic: MemoryTraffic | None = None,
        also_best_effort: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.traffic = traffic
        self.also_best_effort = tuple(also_best_effort)
        self.hierarchy = hierarchy
        self.allowed = allowed
        self.core_of = dict(core_of)
        self.proc_root = proc_root
        self._procfs = Procfs(proc_root)
        self._v2 = host.mode == "v2" and host.v2_mount is not None
        self._cpu_mount: Path | None
        self._memory_mount: Path | None
        self._cpuset_mount: Path | None
        if self._v2:
            self._cpu_mount = self._memory_mount = self._cpuset_mount = host.v2_mount
        else:
            self._cpu_mount = host.v1_mounts.get("cpuacct") or host.v1_mounts.get("cpu")
            self._memory_mount = host.v1_mounts.get("memory")
            self._cpuset_mount = host.v1_mounts.get("cpuset")
        # Each cgroup file (v1) or directory (v2) the sampler reads, checked once and kept while
        # its slot is sampled: the period reads two files of every best-effort slot, and joining
        # and checking their paths again cost more than reading them (issue 23: ~4 % of a core
        # at 500 slots).
        self._files: dict[tuple[str, str], cgroupfs.CgroupFile] = {}
        self._last_files: dict[tuple[str, str], cgroupfs.CgroupFile] = {}
        self._dirs: dict[str, cgroupfs.CgroupDir] = {}
        self._last_dirs: dict[str, cgroupfs.CgroupDir] = {}
        # The best-effort slots as a period that does not read them lists them, kept while the
        # caller hands over the same sequence of slots (the loop keeps its list until a change):
        # building 500 of them every second was a third of an idle agent's CPU (issue 23).
        self._unread_for: Sequence[SlotInfo] | None = None
        self._unread: tuple[BestEffortSlot, ...] = ()
        # The slots as last read, with the class's CPU time and memory in use read just before
        # them and the sequence of slots they were read for (see ``_read_slots``).
        self._read_for: Sequence[SlotInfo] | None = None
        self._read_class: tuple[int | None, int | None] = (None, None)
        self._read: tuple[BestEffortSlot, ...] = ()

    def sample(
        self, slots: Sequence[SlotInfo], now: float, *, read_slots: Callable[[Sample], bool] | bool = True
    ) -> Sample:
        """The node, the online groups and the best-effort class, then each best-effort slot's
        cgroup when ``read_slots`` is true or says so of the sample read so far. A caller whose
        slots changed hands over a new sequence (an unread period reuses what it listed for the
        same sequence object)."""
        # Checked paths of the cgroups read last period; what this period does not read again
        # (released slots) is dropped with the old dictionaries.
        self._last_files, self._files = self._files, {}
        self._last_dirs, self._dirs = self._dirs, {}
        pool = self._pool()
        best_effort_class = self._best_effort_usage()
        base = Sample(
            time=now,
            pool=pool,
            core_of=self.core_of,
            exclusive=self.allowed - pool,
            cpu_busy_ns=self._busy(),
            memory_total=(memory := self._meminfo())[0],
            memory_available=memory[1],
            node_stall=self._node_stall(),
            online=self._online(slots),
            best_effort_cpu_ns=best_effort_class.cpu_ns,
            best_effort=self._unread_slots(slots),
            best_effort_memory_bytes=best_effort_class.memory_bytes,
            slots_read=False,
            traffic_counted=self.traffic is not None,
        )
        if not (read_slots if isinstance(read_slots, bool) else read_slots(base)):
            # The slots' checked paths stay for the next period that reads them.
            self._files = self._last_files | self._files
            self._dirs = self._last_dirs | self._dirs
            return base
        best_effort = self._read_slots(slots, best_effort_class)
        if self.traffic is not None:
            best_effort = self._count_traffic(self.traffic, best_effort)
        return replace(base, best_effort=best_effort, slots_read=True)

    def _count_traffic(
        self, traffic: MemoryTraffic, slots: tuple[BestEffortSlot, ...]
    ) -> tuple[BestEffortSlot, ...]:
        """Each running slot's memory traffic so far; the counters of slots gone or stopped are closed."""
        counted: list[BestEffortSlot] = []
        running: list[str] = []
        for slot in slots:
            if not slot.running or slot.evicted or self._memory_mount is None:
                counted.append(slot)
                continue
            relpath = cgroupfs.join(self.hierarchy.slot_path(slot.slot_id, "best-effort"), "cgroup.procs")
            pids = cgroupfs.read_pids(self._memory_mount, relpath)
            running.append(slot.slot_id)
            counted.append(replace(slot, memory_traffic_bytes=traffic.read(slot.slot_id, pids)))
        traffic.forget(keep=running)
        return tuple(counted)

    def _read_slots(
        self, slots: Sequence[SlotInfo], best_effort_class: GroupUsage
    ) -> tuple[BestEffortSlot, ...]:
        """Each best-effort slot with its cgroup's usage. While the class as a whole has used no CPU
        and its memory in use has not moved since the slots were last read (for the same slots),
        each slot reads as it did then, and is not read again: nothing in the class ran, so no
        slot's CPU time moved, and memory moves without a task of the class running only by
        reclaim or uncharge, which the class's own figure shows (v1's memory controller counts
        children in the parent since Linux 5.11, as v2's always has). At 500 idle best-effort
        slots that is 1,000 files every 30 s not read (issue 23). The class is read before its
        slots, so a slot that runs between the two readings shows in the next class reading."""
        figures = (best_effort_class.cpu_ns, best_effort_class.memory_bytes)
        if slots is self._read_for and figures == self._read_class and None not in figures:
            self._files = self._last_files | self._files  # their checked paths stay, as if read
            self._dirs = self._last_dirs | self._dirs
            return self._read
        read = tuple(self._best_effort(s, read=True) for s in slots if s.qos == "best-effort")
        self._read_for, self._read_class, self._read = slots, figures, read
        return read

    def _unread_slots(self, slots: Sequence[SlotInfo]) -> tuple[BestEffortSlot, ...]:
        if slots is not self._unread_for:
            self._unread = tuple(self._best_effort(s, read=False) for s in slots if s.qos == "best-effort")
            self._unread_for = slots  # held, so that its identity cannot be another list's
        return self._unread

    def group(
        self, relpath: str, *, cpu: bool = True, memory: bool = True, pressure: bool = False
    ) -> GroupUsage:
        """One cgroup's usage; a group that is gone reads as all None."""
        if self._v2:
            return self._group_v2(relpath, cpu=cpu, memory=memory, pressure=pressure)
        return GroupUsage(
            cpu_ns=self._read_int(self._cpu_mount, relpath, "cpuacct.usage") if cpu else None,
            memory_bytes=self._read_int(self._memory_mount, relpath, "memory.usage_in_bytes")
            if memory
            else None,
            stall=None,
        )

    def _group_v2(self, relpath: str, *, cpu: bool, memory: bool, pressure: bool) -> GroupUsage:
        assert self._cpu_mount is not None
        directory = self._dirs.get(relpath) or self._last_dirs.get(relpath)
        if directory is None:
            directory = cgroupfs.resolve_dir(self._cpu_mount, relpath)
        self._dirs[relpath] = directory
        try:
            cpu_ns = None
            if cpu:
                stat = cgroupfs.read_optional(directory, "cpu.stat")
                usage = None if stat is None else cgroupfs.parse_keyed(stat).get("usage_usec")
                cpu_ns = None if usage is None else usage * 1000
            memory_bytes = None
            if memory:
                text = cgroupfs.read_optional(directory, "memory.current")
                memory_bytes = None if text is None else cgroupfs.parse_int(text, directory, "memory.current")
            stall = None
            if pressure:
                values = {r: read_cgroup_pressure(directory, r) for r in ("cpu", "memory", "io")}
                stall = Stall(
                    cpu=_total(values["cpu"]), memory=_total(values["memory"]), io=_total(values["io"])
                )
        except CgroupError as err:
            if err.errno in (errno.ENOENT, errno.ENODEV):
                return GroupUsage()
            raise
        return GroupUsage(cpu_ns=cpu_ns, memory_bytes=memory_bytes, stall=stall)

    def _best_effort_usage(self) -> GroupUsage:
        """The class parent's usage plus that of every ``also_best_effort`` cgroup there is (one
        that is absent adds nothing: the kubelet's appears when it starts)."""
        usage = self.group(self.hierarchy.class_parent("best-effort"))
        for relpath in self.also_best_effort:
            more = self.group(relpath)
            usage = GroupUsage(
                cpu_ns=_plus(usage.cpu_ns, more.cpu_ns),
                memory_bytes=_plus(usage.memory_bytes, more.memory_bytes),
                stall=usage.stall,
            )
        return usage

    def _online(self, slots: Sequence[SlotInfo]) -> dict[str, GroupUsage]:
        online = {BURSTABLE_GROUP: self.group(self.hierarchy.class_parent("burstable"), pressure=self._v2)}
        for slot in slots:
            if slot.qos == "guaranteed":
                relpath = self.hierarchy.slot_path(slot.slot_id, "guaranteed")
                online[slot.slot_id] = self.group(relpath, cpu=False, pressure=self._v2)
        return online

    def _best_effort(self, slot: SlotInfo, *, read: bool) -> BestEffortSlot:
        return BestEffortSlot(
            slot_id=slot.slot_id,
            priority=slot.priority,
            started_at=slot.started_at,
            usage=self.group(self.hierarchy.slot_path(slot.slot_id, "best-effort")) if read else GroupUsage(),
            memory_high=slot.memory_high,
            running=slot.running,
            evicted=slot.evicted,
        )

    def _pool(self) -> frozenset[int]:
        if self._cpuset_mount is None:
            return self.allowed
        relpath = cgroupfs.join(self.hierarchy.class_parent("burstable"), "cpuset.cpus")
        text = cgroupfs.read_optional(self._cpuset_mount, relpath)
        return self.allowed if text is None else parse_cpulist(text)

    def _busy(self) -> dict[int, int]:
        return parse_proc_stat(self._read_proc("stat"))

    def _meminfo(self) -> tuple[int, int]:
        try:
            return parse_meminfo(self._read_proc("meminfo"))
        except ValueError as err:
            raise CgroupError(f"{self.proc_root / 'meminfo'}: {err}") from None

    def _node_stall(self) -> Stall:
        return Stall(
            cpu=_total(read_node_pressure(self.proc_root, "cpu")),
            memory=_total(read_node_pressure(self.proc_root, "memory")),
            io=_total(read_node_pressure(self.proc_root, "io")),
        )

    def _read_proc(self, name: str) -> str:
        try:
            text = self._procfs.read_text(name)
        except DiscoveryError as err:
            raise CgroupError(str(err), errno_=err.errno) from err
        if text is None:
            raise CgroupError(f"reading {self.proc_root / name}: no such file; is procfs mounted there?")
        return text

    def _read_int(self, mount: Path | None, relpath: str, name: str) -> int | None:
        if mount is None:
            return None
        key = (relpath, name)  # one mount per file name (cpuacct, memory)
        file = self._files.get(key) or self._last_files.get(key)
        if file is None:
            file = cgroupfs.resolve_file(mount, cgroupfs.join(relpath, name))
        self._files[key] = file
        text = cgroupfs.read_checked(file)
        if text is None:
            return None
        try:
            return int(text)  # the common case, without building the error's path
        except ValueError:
            return cgroupfs.parse_int(text, mount, cgroupfs.join(relpath, name))


def _plus(total: int | None, more: int | None) -> int | None:
    return total if more is None or total is None else total + more


def _total(pressure: Pressure | None) -> int | None:
    return None if pressure is None else pressure.some.total_us


# --------------------------------------------------------------------------- the actuator


def hold_cpu_quota(host: CgroupHost, relpaths: Iterable[str], quota: int | None, period_us: int) -> None:
    """CFS quota ``quota`` (None: none) on each of ``relpaths`` that exists; a failure is logged
    (the loop tries again next change, the agent runs on)."""
    for relpath in relpaths:
        manager = open_manager(host, relpath)
        try:
            if manager.exists():
                limit = UNLIMITED if quota is None else quota
                manager.set(CgroupLimits(cpu_quota_us=limit, cpu_period_us=period_us))
        except CgroupError as err:
            log.warning("best-effort cgroup %s: CPU quota not set: %s", relpath, err)


#: An L3 share in ways larger than any cache: the shared group then takes the default group's whole
#: lowest run of ways (resctrl.low_ways), which is what best-effort gets while online work is idle.
ALL_WAYS = float(1 << 16)


class Actuator:
    """Carries out the kernel actions (everything but evict and restore) on best-effort slots.

    ``resctrl_group``: the name of best-effort's shared resctrl group, or None to leave resctrl be.
    ``sched_idle``: put best-effort threads under SCHED_IDLE (None: where the best-effort class
    parent has no ``cpu.idle``). ``also_best_effort``: cgroups outside the agent held to the same
    CFS quota as the class (the kubelet's ``besteffort`` pods while NRI places them).
    """

    def __init__(
        self,
        isolator: SlotIsolator,
        *,
        resctrl: Resctrl | None = None,
        resctrl_group: str | None = None,
        l3_share: float | None = None,
        mb_percent: int | None = None,
        proc_root: Path = Path("/proc"),
        sched_idle: bool | None = None,
        also_best_effort: Sequence[str] = (),
    ) -> None:
        self.isolator = isolator
        self.also_best_effort = tuple(also_best_effort)
        self.host = isolator.host
        self.hierarchy = isolator.hierarchy
        if sched_idle is None:
            # What the isolator decided for the slots (their AppliedSlot.sched_idle), carried out here.
            has_cpu_idle = class_has_cpu_idle(self.host, self.hierarchy, "best-effort")
            sched_idle = sched_idle_supported() and not has_cpu_idle
        self._sched_idle = sched_idle
        self._resctrl = resctrl
        self._resctrl_group = resctrl_group
        self._l3_share = l3_share
        self._mb_percent = mb_percent
        self._proc_root = proc_root
        self._tended: set[int] = set()
        self._resctrl_ready = False
        self._resctrl_wide = False  # the group is made with the small share (the loop's start state)

    def apply(self, action: Action) -> None:
        """Write what ``action`` says. A slot that went away meanwhile is not an error."""
        kind = action.kind
        if kind in ("cpu_suppress", "cpu_release"):
            self.isolator.limit_best_effort(action.cpus, action.quota_cpus)
            self._limit_outside(action.quota_cpus)
        elif kind == "slot_cpu_quota":
            # The isolator owns the slot's cgroup: it writes the loop's limit and keeps it at resizes.
            assert action.slot_id is not None
            period = self.isolator.config.qos.cfs_period_us
            quota = None if action.quota_cpus is None else quota_us(action.quota_cpus, period)
            self.isolator.hold_best_effort_slot(action.slot_id, cpu_quota_us=quota)
        elif kind == "memory_throttle":
            assert action.slot_id is not None
            self.isolator.hold_best_effort_slot(action.slot_id, memory_high=action.memory_high)
        elif kind == "memory_unthrottle":
            assert action.slot_id is not None
            self.isolator.hold_best_effort_slot(
                action.slot_id, memory_high=None, own_memory_high=action.memory_high
            )
        elif kind in ("resctrl_narrow", "resctrl_wide"):
            self._resctrl_wide = kind == "resctrl_wide"
            self.prepare_resctrl()
        else:
            raise AssertionError(f"the agent carries out {kind}, not the actuator")

    def kill(self, cgroup: str) -> None:
        """Kill every process of a slot (an evicted worker whose grace is over)."""
        open_manager(self.host, cgroup).kill(timeout=5.0)

    def release(self) -> None:
        """Lift the CPU limit: best-effort gets the whole pool again (the loop itself leaves the
        limit in place when it stops; the next start takes over)."""
        self.isolator.limit_best_effort(None, None)
        self._limit_outside(None)

    def _limit_outside(self, quota_cpus: float | None) -> None:
        """The class's quota on each ``also_best_effort`` cgroup there is (None: lifted). Each gets
        the whole allowance: a quota cannot span two cgroups, and while NRI places the pods the
        class's own slots are empty."""
        period = self.isolator.config.qos.cfs_period_us
        quota = None if quota_cpus is None else quota_us(quota_cpus, period)
        hold_cpu_quota(self.host, self.also_best_effort, quota, period)

    @property
    def resctrl_ready(self) -> bool:
        """Best-effort's shared resctrl group is in place."""
        return self._resctrl_ready

    def prepare_resctrl(self) -> str | None:
        """Create (or mend) best-effort's shared resctrl group with the share the loop last chose
        (the small one at first); None where the host has none."""
        if self._resctrl is None or self._resctrl_group is None:
            return None
        if not (self._resctrl.root / "info").is_dir():
            return None
        wide = self._resctrl_wide
        try:
            if self._resctrl.ensure_shared_group(
                self._resctrl_group,
                l3_share=None if self._l3_share is None else (ALL_WAYS if wide else self._l3_share),
                mb_percent=None if self._mb_percent is None else (100 if wide else self._mb_percent),
            ):
                log.info("best-effort resctrl group %s set up", self._resctrl_group)
        except NodeAgentError as err:
            log.warning("best-effort resctrl group %s not set up: %s", self._resctrl_group, err)
            self._resctrl_ready = False
            return None
        self._resctrl_ready = True
        self._tended.clear()  # a new group holds none of them yet
        return self._resctrl_group

    def tend(self, slot_ids: Iterable[str]) -> int:
        """Best-effort processes not seen before: oom_score_adj 1000, SCHED_IDLE where the kernel
        has no cpu.idle, and into the resctrl group. Returns how many were new."""
        mount = self.host.v2_mount if self.host.mode == "v2" else self.host.v1_mounts.get("memory")
        if mount is None:
            return 0
        seen: set[int] = set()
        for slot_id in slot_ids:
            relpath = self.hierarchy.slot_path(slot_id, "best-effort")
            seen.update(cgroupfs.read_pids(mount, cgroupfs.join(relpath, "cgroup.procs")))
        new = seen - self._tended
        for pid in sorted(new):
            self._tend(pid)
        self._tended = seen
        return len(new)

    def _tend(self, pid: int) -> None:
        # The process may exit between the listing and these writes: that is fine.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            (self._proc_root / str(pid) / "oom_score_adj").write_text(str(OOM_SCORE_ADJ_BEST_EFFORT))
        resctrl = self._resctrl if self._resctrl_ready else None
        group = self._resctrl_group
        if not self._sched_idle and (resctrl is None or group is None):
            return
        try:
            threads = [int(t) for t in os.listdir(self._proc_root / str(pid) / "task")]
        except FileNotFoundError:
            return
        if self._sched_idle:
            # Per thread; threads and children made later inherit it from the thread that makes them.
            for tid in threads:
                try:
                    set_sched_idle(tid)
                except NodeAgentError as err:
                    if getattr(err, "errno", None) != errno.ESRCH:
                        log.warning("best-effort thread %d not put under SCHED_IDLE: %s", tid, err)
        if resctrl is not None and group is not None:
            try:
                resctrl.assign_tasks(group, threads)
            except NodeAgentError as err:
                if getattr(err, "errno", None) not in (errno.ESRCH, errno.ENOENT):
                    log.warning("best-effort pid %d not moved into resctrl group: %s", pid, err)


__all__ = ["Actuator", "Sampler", "SlotInfo", "parse_meminfo", "parse_proc_stat"]
