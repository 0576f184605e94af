"""Watching a cgroup for OOM events, with one API for v1 and v2.

A watcher has ``fileno()`` so a daemon can put it in its selector: v2 watchers signal ``POLLPRI``
(register ``selectors.EVENT_READ`` is not enough; use ``select.poll``/``epoll`` with POLLPRI),
v1 watchers signal ``POLLIN``; :attr:`OomWatcher.poll_events` says which. ``wait(timeout)`` does the
polling itself and returns the new counts when they changed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import time
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

from nodeagent.cgroups import fs
from nodeagent.cgroups.resources import OomEvents
from nodeagent.errors import CgroupError, translate_os_error


class OomWatcher(ABC):
    """Counts a cgroup's OOM events; wakes its file descriptor when they change."""

    #: The poll(2) events to wait for on :meth:`fileno`.
    poll_events: int

    def __init__(self) -> None:
        self._last: OomEvents | None = None

    @abstractmethod
    def fileno(self) -> int: ...

    @abstractmethod
    def counts(self) -> OomEvents:
        """The counts now (reading them re-arms the notification)."""

    @abstractmethod
    def _consume(self) -> None:
        """Acknowledge a wake-up of the descriptor."""

    @abstractmethod
    def close(self) -> None: ...

    def wait(self, timeout: float | None = None) -> OomEvents | None:
        """Block until the counts differ from the last ones returned; None after ``timeout`` seconds."""
        if self._last is None:
            self._last = self.counts()
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.fileno(), self.poll_events)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = poller.poll(None if remaining is None else remaining * 1000)
            if ready:
                self._consume()
            now = self.counts()
            if now != self._last:
                self._last = now
                return now
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def __enter__(self) -> OomWatcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MemoryEventsWatcher(OomWatcher):
    """cgroup v2: poll memory.events (the kernel raises POLLPRI on every change)."""

    poll_events = select.POLLPRI | select.POLLERR

    def __init__(self, root: Path, relpath: str) -> None:
        super().__init__()
        path = fs.resolve(root, fs.join(relpath, "memory.events"))
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            raise translate_os_error(f"opening {path} to watch OOM events", err, CgroupError) from err
        self._path = path
        self._last = self.counts()

    def fileno(self) -> int:
        return self._fd

    def counts(self) -> OomEvents:
        try:
            text = os.pread(self._fd, 4096, 0).decode()
        except OSError as err:
            raise translate_os_error(f"reading {self._path}", err, CgroupError) from err
        values = fs.parse_keyed(text)
        return OomEvents(oom=values.get("oom", 0), oom_kill=values.get("oom_kill", 0))

    def _consume(self) -> None:
        """Reading (in counts) is what acknowledges kernfs notifications."""

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventfdOomWatcher(OomWatcher):
    """cgroup v1: an eventfd registered on memory.oom_control through cgroup.event_control."""

    poll_events = select.POLLIN

    def __init__(self, root: Path, relpath: str) -> None:
        super().__init__()
        self._root, self._relpath = root, relpath
        self._notified = 0
        self._oom_kill = 0
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            control = fs.resolve(root, fs.join(relpath, "memory.oom_control"))
            try:
                control_fd = os.open(control, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as err:
                raise translate_os_error(f"opening {control} to watch OOM events", err, CgroupError) from err
            try:
                fs.write_file(root, fs.join(relpath, "cgroup.event_control"), f"{self._fd} {control_fd}")
            finally:
                os.close(control_fd)
        except BaseException:
            os.close(self._fd)
            raise
        self._last = self.counts()

    def fileno(self) -> int:
        return self._fd

    def _consume(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._notified += os.eventfd_read(self._fd)

    def counts(self) -> OomEvents:
        try:
            values = fs.read_keyed(self._root, fs.join(self._relpath, "memory.oom_control"))
            self._oom_kill = values.get("oom_kill", self._oom_kill)
        except CgroupError as err:
            # The group was removed (which also fires the eventfd): keep the last counts.
            if err.errno not in (errno.ENOENT, errno.ENODEV):
                raise
        return OomEvents(oom=self._notified, oom_kill=self._oom_kill)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
