"""The manager interface both cgroup versions implement, and the steps they share."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path

from nodeagent.cgroups import fs
from nodeagent.cgroups.oom import OomWatcher
from nodeagent.cgroups.resources import CgroupLimits, CgroupStats, OomEvents
from nodeagent.cgroups.rules import DeviceRule
from nodeagent.errors import CgroupError


class CgroupManager(ABC):
    """One cgroup (in v1: the same relative path in every controller hierarchy).

    ``relpath`` is relative to the cgroup mount(s), e.g. ``"nodeagent.slice/burstable/web"``.
    """

    version: str

    def __init__(self, relpath: str) -> None:
        fs.check_relative(relpath)  # reject absolute paths and '..' early
        self.relpath = relpath.strip("/")
        if not self.relpath:
            # Killing or deleting "everything under the root" is never what a caller means.
            raise CgroupError("a cgroup manager needs a path below the cgroup root, got the root itself")

    @abstractmethod
    def paths(self) -> dict[str, Path]:
        """Directory per controller (v1) or ``{"unified": dir}`` (v2)."""

    @abstractmethod
    def _mounts(self) -> list[Path]:
        """The distinct mounts the group lives in."""

    def procs_files(self) -> list[Path]:
        """Every cgroup.procs a new process must be written into to join this group."""
        return [fs.resolve(mount, fs.join(self.relpath, "cgroup.procs")) for mount in self._mounts()]

    def exists(self) -> bool:
        return all(fs.exists(mount, self.relpath) for mount in self._mounts())

    @abstractmethod
    def create(self, cpus: frozenset[int] | None = None) -> None:
        """Create the group and its missing ancestors; already existing is fine.

        ``cpus``: the group's own cpuset CPUs, written as it is made. Without them a v1 group copies
        its parent's CPUs so that it can take tasks at once; an exclusive slot passes its CPUs, so
        that it never appears, even for an instant a crash could freeze, to hold CPUs it was not
        given (the agent reads exclusive CPUs back from the slots' cpusets when it restarts).
        """

    @abstractmethod
    def set(self, resources: CgroupLimits) -> None:
        """Apply every non-None field of ``resources``."""

    def add_pid(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group."""
        for mount in self._mounts():
            try:
                fs.write_file(mount, fs.join(self.relpath, "cgroup.procs"), pid)
            except CgroupError as err:
                if err.errno == errno.ENOSPC:  # the kernel's answer for a cpuset without CPUs or mems
                    raise CgroupError(
                        f"cannot move pid {pid} into {self.relpath}: its cpuset has no CPUs or memory "
                        "nodes yet; set cpuset_cpus and cpuset_mems first",
                        errno_=err.errno,
                    ) from err
                raise

    def procs(self) -> list[int]:
        """Processes directly in the group (not in child groups)."""
        found: set[int] = set()
        for mount in self._mounts():
            found.update(fs.read_pids(mount, fs.join(self.relpath, "cgroup.procs")))
        return sorted(found)

    def children(self) -> list[str]:
        """Names of the child groups (in v1, the union over hierarchies)."""
        names: set[str] = set()
        for mount in self._mounts():
            names.update(fs.child_dirs(mount, self.relpath))
        return sorted(names)

    def subtree_pids(self) -> list[int]:
        found: set[int] = set()
        for mount in self._mounts():
            found.update(_subtree_pids(mount, self.relpath))
        return sorted(found)

    @abstractmethod
    def freeze(self, timeout: float = 5.0) -> None:
        """Freeze every process in the group; returns once the kernel reports it frozen."""

    @abstractmethod
    def thaw(self) -> None: ...

    @abstractmethod
    def is_frozen(self) -> bool:
        """Whether the group is frozen (asked to freeze and done, or on its way)."""

    @abstractmethod
    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything in the group and its children; returns once it is empty."""

    @abstractmethod
    def stats(self, *, pids: bool = True, since: CgroupStats | None = None) -> CgroupStats:
        """The group's usage now. ``pids=False`` leaves pids.current unread (``pids_current`` None):
        one file fewer per group for a caller that does not show it (the metrics scrape).

        ``since``, this group's previous snapshot: when the group used no CPU since, the figures
        that cannot have moved are taken from it instead of read (see CgroupStats.ran_since)."""

    def counts_children_memory(self) -> bool:
        """Whether the group's memory in use includes its children's (always on v2; on v1 where
        ``memory.use_hierarchy`` is 1, which Linux 5.11 made the only setting)."""
        return True

    @abstractmethod
    def oom_events(self) -> OomEvents: ...

    @abstractmethod
    def oom_watcher(self) -> OomWatcher: ...

    @abstractmethod
    def set_devices(self, rules: Iterable[DeviceRule]) -> None:
        """Make ``rules`` the group's device allow-list (everything else is denied)."""

    def delete(self, timeout: float = 5.0) -> None:
        """Remove the group and its child groups, waiting up to ``timeout`` for them to drain.

        Processes are not killed (use :meth:`kill` first); a group that is already gone is fine.
        """
        deadline = time.monotonic() + timeout
        for mount in self._mounts():
            _remove_tree(mount, self.relpath, deadline)

    def _kill_by_signal(self, timeout: float, can_freeze: bool) -> None:
        """Freeze, SIGKILL every pid, thaw; repeat until empty (forks racing the kill are caught)."""
        deadline = time.monotonic() + timeout
        while pids := self.subtree_pids():
            if time.monotonic() > deadline:
                raise CgroupError(
                    f"could not empty cgroup {self.relpath} within {timeout}s; still there: {pids[:20]}",
                    errno_=errno.ETIMEDOUT,
                )
            if can_freeze:
                self._try_freeze(min(1.0, max(0.0, deadline - time.monotonic())))
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if can_freeze:
                self.thaw()
            time.sleep(0.005)

    def _try_freeze(self, timeout: float) -> None:
        # A task stuck in uninterruptible sleep can keep the group FREEZING; kill anyway.
        try:
            self.freeze(timeout)
        except CgroupError as err:
            if err.errno != errno.ETIMEDOUT:
                raise


def _subtree_pids(mount: Path, relpath: str) -> list[int]:
    pids = fs.read_pids(mount, fs.join(relpath, "cgroup.procs"))
    for child in fs.child_dirs(mount, relpath):
        pids += _subtree_pids(mount, fs.join(relpath, child))
    return pids


def _remove_tree(mount: Path, relpath: str, deadline: float) -> None:
    for child in fs.child_dirs(mount, relpath):
        _remove_tree(mount, fs.join(relpath, child), deadline)
    while True:
        try:
            fs.remove_dir(mount, relpath)
            return
        except CgroupError as err:
            # A group whose last task just died stays busy until the kernel finishes the exit.
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.005)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until it holds; CgroupError(ETIMEDOUT) naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not check():
        if time.monotonic() > deadline:
            raise CgroupError(f"timed out after {timeout}s waiting for {what}", errno_=errno.ETIMEDOUT)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
