"""The cgroup v1 manager: one directory per controller hierarchy, hidden behind one interface."""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from nodeagent.cgroups import fs
from nodeagent.cgroups.base import CgroupManager, wait_until
from nodeagent.cgroups.detect import CgroupHost
from nodeagent.cgroups.oom import EventfdOomWatcher, OomWatcher
from nodeagent.cgroups.resources import UNLIMITED, CgroupLimits, CgroupStats, OomEvents, weight_to_shares
from nodeagent.cgroups.rules import DeviceRule, normalize, parse_devices_list, plan_v1
from nodeagent.cpulist import format_cpulist
from nodeagent.errors import CgroupError, Unsupported

#: memory.limit_in_bytes reads back as this page-rounded LONG_MAX when unlimited.
V1_UNLIMITED_READ = 9223372036854771712


class V1Manager(CgroupManager):
    version = "v1"

    def __init__(self, host: CgroupHost, relpath: str) -> None:
        super().__init__(relpath)
        # The host's own mapping, shared by every manager (one per slot, and per slot per scrape):
        # nothing changes it after detection, and a copy each was ~270 bytes per slot.
        self._mounts_by_controller: Mapping[str, Path] = host.v1_mounts
        #: stats()'s files, their directories checked once per manager: a scrape that keeps its managers
        #: (agent.daemon.SlotStats) reads each slot's files without resolving them again
        self._stats_files: dict[str, fs.CgroupFile] | None = None

    def paths(self) -> dict[str, Path]:
        return {c: fs.resolve(m, self.relpath) for c, m in sorted(self._mounts_by_controller.items())}

    def _mounts(self) -> list[Path]:
        return sorted(set(self._mounts_by_controller.values()))

    def has(self, controller: str) -> bool:
        return controller in self._mounts_by_controller

    def _file(self, controller: str, name: str) -> tuple[Path, str]:
        if controller not in self._mounts_by_controller:
            raise Unsupported(f"the v1 {controller} controller is not mounted; cannot use {name}")
        return self._mounts_by_controller[controller], fs.join(self.relpath, name)

    def _write(self, controller: str, name: str, value: str | int) -> None:
        fs.write_file(*self._file(controller, name), value)

    def _read(self, controller: str, name: str) -> str:
        return fs.read_file(*self._file(controller, name))

    def _has_file(self, controller: str, name: str) -> bool:
        return self.has(controller) and fs.exists(*self._file(controller, name))

    def create(self, cpus: frozenset[int] | None = None) -> None:
        parts = PurePosixPath(self.relpath).parts
        cpuset_mount = self._mounts_by_controller.get("cpuset")
        for mount in self._mounts():
            for depth in range(1, len(parts) + 1):
                rel = "/".join(parts[:depth])
                fs.make_dir(mount, rel)
                if mount != cpuset_mount:
                    continue
                own = cpus is not None and depth == len(parts)
                _inherit_cpuset(mount, rel, cpus=not own)
                if own and cpus is not None:
                    fs.write_file(mount, fs.join(rel, "cpuset.cpus"), format_cpulist(cpus))

    def set(self, resources: CgroupLimits) -> None:
        r = resources
        if r.cpuset_cpus is not None:
            self._write("cpuset", "cpuset.cpus", format_cpulist(r.cpuset_cpus))
        if r.cpuset_mems is not None:
            self._write("cpuset", "cpuset.mems", format_cpulist(r.cpuset_mems))
        if r.cpu_weight is not None:
            self._write("cpu", "cpu.shares", weight_to_shares(r.cpu_weight))
        if r.cpu_period_us is not None:
            self._write("cpu", "cpu.cfs_period_us", r.cpu_period_us)
        if r.cpu_quota_us is not None:
            self._write("cpu", "cpu.cfs_quota_us", r.cpu_quota_us)
        if r.cpu_idle is not None:
            self._require("cpu", "cpu.idle", "needs kernel 5.15+ with fair group scheduling")
            self._write("cpu", "cpu.idle", int(r.cpu_idle))
        self._set_memory(r)
        if r.pids_max is not None:
            self._write("pids", "pids.max", "max" if r.pids_max == UNLIMITED else r.pids_max)
        if r.io_weight is not None:
            self._set_io_weight(r.io_weight)

    def _require(self, controller: str, name: str, why: str) -> None:
        if not self._has_file(controller, name):
            raise Unsupported(f"{name} is not available for cgroup {self.relpath}: {why}")

    def _set_memory(self, r: CgroupLimits) -> None:
        if r.memory_high is not None:
            # v1 has no memory.high; the soft limit is what reclaim aims for under pressure.
            self._write("memory", "memory.soft_limit_in_bytes", r.memory_high)
        if r.memory_swap_max is None:
            if r.memory_max is not None:
                self._write("memory", "memory.limit_in_bytes", r.memory_max)
            return
        self._require(
            "memory", "memory.memsw.limit_in_bytes", "swap accounting is off (boot with swapaccount=1)"
        )
        limit = r.memory_max
        base = limit if limit is not None else _as_limit(self._read("memory", "memory.limit_in_bytes"))
        memsw = UNLIMITED if UNLIMITED in (base, r.memory_swap_max) else base + r.memory_swap_max
        current_memsw = _as_limit(self._read("memory", "memory.memsw.limit_in_bytes"))
        # The kernel keeps memory <= memory+swap at every step, so the order of the writes matters.
        raising = limit is not None and (
            limit == UNLIMITED or (current_memsw != UNLIMITED and limit > current_memsw)
        )
        if raising:
            self._write("memory", "memory.memsw.limit_in_bytes", memsw)
        if limit is not None:
            self._write("memory", "memory.limit_in_bytes", limit)
        if not raising:
            self._write("memory", "memory.memsw.limit_in_bytes", memsw)

    def _set_io_weight(self, weight: int) -> None:
        for name, low in (("blkio.bfq.weight", 1), ("blkio.weight", 10)):
            if self._has_file("blkio", name):
                self._write("blkio", name, max(low, min(1000, weight)))
                return
        raise Unsupported(
            f"no blkio weight file for cgroup {self.relpath}: select the bfq I/O scheduler for the "
            "disks (echo bfq > /sys/block/DEV/queue/scheduler) or leave io_weight unset"
        )

    def freeze(self, timeout: float = 5.0) -> None:
        self._write("freezer", "freezer.state", "FROZEN")
        wait_until(
            lambda: self._read("freezer", "freezer.state").strip() == "FROZEN",
            timeout,
            f"cgroup {self.relpath} to freeze (freezer.state FROZEN)",
        )

    def thaw(self) -> None:
        self._write("freezer", "freezer.state", "THAWED")

    def is_frozen(self) -> bool:
        return self._read("freezer", "freezer.state").strip() != "THAWED"

    def kill(self, timeout: float = 5.0) -> None:
        self._kill_by_signal(timeout, can_freeze=self.has("freezer") and self.exists())

    def stats(self, *, pids: bool = True, since: CgroupStats | None = None) -> CgroupStats:
        # Each hierarchy's directory is checked once (cpu and cpuacct usually share one), and the
        # paths of the six files a scrape reads are kept as strings: a scrape of 500 slots reads
        # 3,000 files, and building their paths again cost as much as reading them (issue 23).
        if self._stats_files is None:
            dirs = self._dirs(("cpu", "cpuacct", "memory", "pids"))
            self._stats_files = {
                name: fs.CgroupFile(str(dirs[controller].path / name))
                for controller, name in _STATS_FILES
                if controller in dirs
            }
        files = self._stats_files
        usage = _int_file(files, "cpuacct.usage")  # first: see CgroupStats.ran_since
        current = _int_file(files, "memory.usage_in_bytes")
        pids_current = _int_file(files, "pids.current") if pids else None
        if since is not None and not since.ran_since(usage):
            peak = since.peak_after(current, lambda: _int_file(files, "memory.max_usage_in_bytes"))
            return CgroupStats(
                usage, since.cpu_periods, since.cpu_throttled_periods, since.cpu_throttled_ns,
                current, peak, since.oom, pids_current,
            )  # fmt: skip
        cpu = _keyed_file(files, "cpu.stat")
        return CgroupStats(
            cpu_usage_ns=usage,
            cpu_periods=cpu.get("nr_periods"),
            cpu_throttled_periods=cpu.get("nr_throttled"),
            cpu_throttled_ns=cpu.get("throttled_time"),
            memory_current=current,
            memory_peak=_int_file(files, "memory.max_usage_in_bytes"),
            oom=OomEvents(oom=None, oom_kill=_keyed_file(files, "memory.oom_control").get("oom_kill")),
            pids_current=pids_current,
        )

    def counts_children_memory(self) -> bool:
        if not self._has_file("memory", "memory.use_hierarchy"):
            return False
        return self._read("memory", "memory.use_hierarchy").strip() == "1"

    def _dirs(self, controllers: Iterable[str]) -> dict[str, fs.CgroupDir]:
        by_mount: dict[Path, fs.CgroupDir] = {}
        for controller in controllers:
            mount = self._mounts_by_controller.get(controller)
            if mount is not None and mount not in by_mount:
                by_mount[mount] = fs.resolve_dir(mount, self.relpath)
        return {
            c: by_mount[m]
            for c in controllers
            if (m := self._mounts_by_controller.get(c)) is not None and m in by_mount
        }

    def _int(self, controller: str, name: str) -> int | None:
        return fs.read_int(*self._file(controller, name)) if self._has_file(controller, name) else None

    def _keyed(self, controller: str, name: str) -> dict[str, int]:
        return fs.read_keyed(*self._file(controller, name)) if self._has_file(controller, name) else {}

    def oom_events(self) -> OomEvents:
        values = self._keyed("memory", "memory.oom_control")
        return OomEvents(oom=None, oom_kill=values.get("oom_kill"))

    def oom_watcher(self) -> OomWatcher:
        return EventfdOomWatcher(*self._file("memory", ""))

    def set_devices(self, rules: Iterable[DeviceRule]) -> None:
        wanted = normalize(rules)
        plan = plan_v1(parse_devices_list(self._read("devices", "devices.list")), wanted)
        for name, value in plan.writes():
            self._write("devices", name, value)
        found = parse_devices_list(self._read("devices", "devices.list"))
        if found != wanted:
            raise CgroupError(
                f"device rules of cgroup {self.relpath} did not take: wanted "
                f"{sorted(map(str, wanted))}, devices.list shows {sorted(map(str, found))}; "
                "a child cannot allow more than its parent allows",
                errno_=errno.EPERM,
            )


#: What :meth:`V1Manager.stats` reads: (controller, file).
_STATS_FILES = (
    ("cpu", "cpu.stat"),
    ("cpuacct", "cpuacct.usage"),
    ("memory", "memory.usage_in_bytes"),
    ("memory", "memory.max_usage_in_bytes"),
    ("memory", "memory.oom_control"),
    ("pids", "pids.current"),
)


def _int_file(files: dict[str, fs.CgroupFile], name: str) -> int | None:
    file = files.get(name)
    text = None if file is None else fs.read_checked(file)
    if text is None or file is None:
        return None
    return fs.parse_int(text, file)


def _keyed_file(files: dict[str, fs.CgroupFile], name: str) -> dict[str, int]:
    file = files.get(name)
    text = None if file is None else fs.read_checked(file)
    return {} if text is None else fs.parse_keyed(text)


def _as_limit(text: str) -> int:
    value = int(text.strip())
    return UNLIMITED if value >= V1_UNLIMITED_READ else value


def _inherit_cpuset(mount: Path, rel: str, *, cpus: bool) -> None:
    """A new v1 cpuset starts empty and refuses tasks until cpus and mems are set: copy the parent's.

    With ``cpus=False`` only the mems are copied: the caller writes the group's own CPUs instead.
    """
    parent = str(PurePosixPath(rel).parent)
    parent = "" if parent == "." else parent
    for name in ("cpuset.cpus", "cpuset.mems") if cpus else ("cpuset.mems",):
        if not fs.read_file(mount, fs.join(rel, name)).strip():
            fs.write_file(mount, fs.join(rel, name), fs.read_file(mount, fs.join(parent, name)).strip())
