"""Room the agent holds on the state file system for itself: a file of a few MiB, allocated while
there is space, given up the moment a write of the agent's own would otherwise find none.

The reserve (``[state] reserve``) keeps the agent's own writers (slot logs, allocations) off the
last free space; something else on the host (a process outside every slot, a worker with the
sandbox off) may still fill the file system. Then this file is what lets the agent open its
database again after a restart (SQLite recreates its WAL and shared-memory files on open) and
commit a release: it is removed just before the agent writes, when almost nothing is free, and
made again once the file system has the reserve and the file's size free.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("nodeagent.state")

BALLAST_NAME = "ballast"
#: A release, the WAL up to its limit (state.WAL_SIZE_LIMIT) and a restart's files fit in this.
BALLAST_BYTES = 8 * 1024 * 1024


class Ballast:
    """The ballast file in ``directory`` (the state directory)."""

    def __init__(self, directory: Path, size: int = BALLAST_BYTES) -> None:
        self.path = directory / BALLAST_NAME
        self.size = size

    def held(self) -> bool:
        return self.path.exists()

    def spare_room(self) -> None:
        """Give the file up when less than half its size is free: the write about to happen (and
        the ones after it) get the room."""
        free = _free(self.path.parent)
        if free is not None and free < self.size // 2 and self.held():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            log.warning(
                "the state file system is full: the agent gave up its ballast (%d MiB) to keep its "
                "records; free space in %s",
                self.size >> 20,
                self.path.parent,
            )

    def restore(self, reserve: int) -> None:
        """Make the file again (0600, its blocks allocated) when the file system has ``reserve``
        and the file's size free; nothing when it cannot."""
        if self.held():
            return
        free = _free(self.path.parent)
        if free is None or free < reserve + self.size:
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return  # another agent's start made it, or the directory is not writable: no ballast
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as err:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            log.warning("no ballast in %s: %s", self.path.parent, err)
            return
        os.close(fd)


def _free(directory: Path) -> int | None:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


__all__ = ["BALLAST_BYTES", "BALLAST_NAME", "Ballast"]
