"""The cgroup v2 (unified) manager: one directory, controllers enabled down from the root."""

from __future__ import annotations

import errno
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from nodeagent.cgroups import bpf, fs
from nodeagent.cgroups.base import CgroupManager, wait_until
from nodeagent.cgroups.detect import V2_CONTROLLERS, CgroupHost
from nodeagent.cgroups.oom import MemoryEventsWatcher, OomWatcher
from nodeagent.cgroups.resources import UNLIMITED, CgroupLimits, CgroupStats, OomEvents
from nodeagent.cgroups.rules import DeviceRule
from nodeagent.cpulist import format_cpulist
from nodeagent.errors import CgroupError, Unsupported


def _limit(value: int) -> str | int:
    return "max" if value == UNLIMITED else value


class V2Manager(CgroupManager):
    version = "v2"

    def __init__(self, host: CgroupHost, relpath: str) -> None:
        super().__init__(relpath)
        if host.v2_mount is None:
            raise Unsupported("this host has no cgroup2 mount; use the v1 manager")
        self._mount = host.v2_mount
        self._wanted = frozenset(V2_CONTROLLERS)
        self._stats_dir: fs.CgroupDir | None = None  #: stats()'s directory, checked once (see V1Manager)
        # On a delegated subtree, the levels above it are not ours to configure: under systemd the
        # unit's delegated cgroup (systemd enabled the controllers above it), for an unprivileged
        # agent its own cgroup.
        self._configure_from = ""
        if host.delegation_root is not None:
            self._configure_from = host.delegation_root.strip("/")
        elif host.delegated and host.own_v2_cgroup:
            self._configure_from = host.own_v2_cgroup.strip("/")

    def paths(self) -> dict[str, Path]:
        return {"unified": fs.resolve(self._mount, self.relpath)}

    def _mounts(self) -> list[Path]:
        return [self._mount]

    def _rel(self, name: str) -> str:
        return fs.join(self.relpath, name)

    def _write(self, name: str, value: str | int) -> None:
        fs.write_file(self._mount, self._rel(name), value)

    def _has_file(self, name: str) -> bool:
        return fs.exists(self._mount, self._rel(name))

    def _require(self, name: str, why: str) -> None:
        if not self._has_file(name):
            raise Unsupported(
                f"{name} is not available for cgroup {self.relpath}: {why}; check that the controller is "
                "in the parent's cgroup.subtree_control"
            )

    def create(self, cpus: frozenset[int] | None = None) -> None:
        parts = PurePosixPath(self.relpath).parts
        for depth in range(len(parts)):
            ancestor = "/".join(parts[:depth])
            if depth and _is_below(ancestor, self._configure_from):
                fs.make_dir(self._mount, ancestor)
            elif depth and not fs.exists(self._mount, ancestor):
                # The delegated cgroup and those above it are made by their owner (systemd) only: one
                # that is missing means the delegation is gone, and a directory made here would be
                # ours in a tree that is not.
                raise CgroupError(
                    f"cannot create cgroup {self.relpath}: {ancestor} does not exist, and it is the "
                    f"delegated cgroup {self._configure_from} or lies above it, which only their owner "
                    "creates"
                )
            if _is_within(ancestor, self._configure_from):
                self._enable_controllers(ancestor)
        fs.make_dir(self._mount, self.relpath)
        if cpus is not None:
            self._write("cpuset.cpus", format_cpulist(cpus))

    def _enable_controllers(self, rel: str) -> None:
        """Enable what the children need in ``rel``'s subtree_control (only the missing ones)."""
        available = set(fs.read_file(self._mount, fs.join(rel, "cgroup.controllers")).split())
        enabled = set(fs.read_file(self._mount, fs.join(rel, "cgroup.subtree_control")).split())
        for controller in sorted((available & self._wanted) - enabled):
            fs.write_file(self._mount, fs.join(rel, "cgroup.subtree_control"), f"+{controller}")

    def set(self, resources: CgroupLimits) -> None:
        r = resources
        if r.cpuset_cpus is not None:
            self._write("cpuset.cpus", format_cpulist(r.cpuset_cpus))
        if r.cpuset_mems is not None:
            self._write("cpuset.mems", format_cpulist(r.cpuset_mems))
        if r.cpu_weight is not None:
            self._write("cpu.weight", r.cpu_weight)
        if r.cpu_quota_us is not None or r.cpu_period_us is not None:
            self._set_cpu_max(r.cpu_quota_us, r.cpu_period_us)
        if r.cpu_idle is not None:
            self._require("cpu.idle", "needs kernel 5.15+")
            self._write("cpu.idle", int(r.cpu_idle))
        for name, value in (
            ("memory.high", r.memory_high),
            ("memory.max", r.memory_max),
            ("memory.swap.max", r.memory_swap_max),
            ("pids.max", r.pids_max),
        ):
            if value is not None:
                self._write(name, _limit(value))
        if r.io_weight is not None:
            self._set_io_weight(r.io_weight)

    def _set_cpu_max(self, quota: int | None, period: int | None) -> None:
        current_quota, current_period = fs.read_file(self._mount, self._rel("cpu.max")).split()
        quota_text = current_quota if quota is None else _limit(quota)
        self._write("cpu.max", f"{quota_text} {current_period if period is None else period}")

    def _set_io_weight(self, weight: int) -> None:
        if self._has_file("io.weight"):
            self._write("io.weight", f"default {weight}")
        elif self._has_file("io.bfq.weight"):
            self._write("io.bfq.weight", f"default {min(weight, 1000)}")
        else:
            raise Unsupported(
                f"no io weight for cgroup {self.relpath}: the kernel needs blk-iocost (io.weight) or the bfq "
                "scheduler (io.bfq.weight), and io in the parent's cgroup.subtree_control"
            )

    def _events(self) -> dict[str, int]:
        return fs.read_keyed(self._mount, self._rel("cgroup.events"))

    def freeze(self, timeout: float = 5.0) -> None:
        self._write("cgroup.freeze", 1)
        wait_until(lambda: self._events().get("frozen") == 1, timeout, f"cgroup {self.relpath} to freeze")

    def thaw(self) -> None:
        self._write("cgroup.freeze", 0)

    def is_frozen(self) -> bool:
        return fs.read_file(self._mount, self._rel("cgroup.freeze")).strip() == "1"

    def kill(self, timeout: float = 5.0) -> None:
        if not self.exists():
            return
        if not self._has_file("cgroup.kill"):  # before kernel 5.14
            self._kill_by_signal(timeout, can_freeze=self._has_file("cgroup.freeze"))
            return
        self._write("cgroup.kill", 1)
        wait_until(
            lambda: not self.subtree_pids(), timeout, f"cgroup {self.relpath} to empty after cgroup.kill"
        )

    def stats(self, *, pids: bool = True, since: CgroupStats | None = None) -> CgroupStats:
        # The directory is checked once, then its files are read by name (see fs.CgroupDir).
        if self._stats_dir is None:
            self._stats_dir = fs.resolve_dir(self._mount, self.relpath)
        directory = self._stats_dir
        cpu = fs.read_keyed(directory, "cpu.stat")  # first: see CgroupStats.ran_since
        usage = _usec_to_ns(cpu.get("usage_usec"))
        current = _optional_int(directory, "memory.current")
        pids_current = _optional_int(directory, "pids.current") if pids else None
        if since is not None and not since.ran_since(usage):
            peak = since.peak_after(current, lambda: _optional_int(directory, "memory.peak"))
            oom = since.oom
        else:
            peak = _optional_int(directory, "memory.peak")
            events = fs.read_optional(directory, "memory.events")
            values = {} if events is None else fs.parse_keyed(events)
            oom = (
                OomEvents(None, None)
                if events is None
                else OomEvents(oom=values.get("oom", 0), oom_kill=values.get("oom_kill", 0))
            )
        return CgroupStats(
            cpu_usage_ns=usage,
            cpu_periods=cpu.get("nr_periods"),
            cpu_throttled_periods=cpu.get("nr_throttled"),
            cpu_throttled_ns=_usec_to_ns(cpu.get("throttled_usec")),
            memory_current=current,
            memory_peak=peak,
            oom=oom,
            pids_current=pids_current,
        )

    def _int(self, name: str) -> int | None:
        return fs.read_int(self._mount, self._rel(name)) if self._has_file(name) else None

    def oom_events(self) -> OomEvents:
        if not self._has_file("memory.events"):
            return OomEvents(None, None)
        values = fs.read_keyed(self._mount, self._rel("memory.events"))
        return OomEvents(oom=values.get("oom", 0), oom_kill=values.get("oom_kill", 0))

    def oom_watcher(self) -> OomWatcher:
        self._require("memory.events", "the memory controller is not enabled for it")
        return MemoryEventsWatcher(self._mount, self.relpath)

    def set_devices(self, rules: Iterable[DeviceRule]) -> None:
        bpf.set_device_filter(fs.resolve(self._mount, self.relpath), rules)

    def delete(self, timeout: float = 5.0) -> None:
        if self.exists():
            try:
                bpf.clear_device_filter(fs.resolve(self._mount, self.relpath))
            except CgroupError as err:
                # Without BPF rights there is nothing of ours attached; rmdir releases programs anyway.
                if err.errno not in (errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSYS, errno.ENOENT):
                    raise
        super().delete(timeout)


def _optional_int(directory: fs.CgroupDir, name: str) -> int | None:
    text = fs.read_optional(directory, name)
    return None if text is None else fs.parse_int(text, directory, name)


def _usec_to_ns(value: int | None) -> int | None:
    return None if value is None else value * 1000


def _is_within(path: str, top: str) -> bool:
    return not top or path == top or path.startswith(top + "/")


def _is_below(path: str, top: str) -> bool:
    return (not top and bool(path)) or path.startswith(top + "/")
