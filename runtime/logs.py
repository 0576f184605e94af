"""Per-slot log files with size-based rotation, and reading their last lines back.

The keeper writes a worker's stdout and stderr through ``RotatingLog``; the API and CLI read them
with ``tail``. Rotation renames ``name`` to ``name.1`` (and ``name.1`` to ``name.2`` ...), keeping
``backups`` old files, so the newest lines are always in ``name``.
"""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.errors import NotFound

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUPS = 3
STREAMS = ("stdout", "stderr")


def log_path(log_dir: Path, stream: str) -> Path:
    return log_dir / f"{stream}.log"


class RotatingLog:
    """Append-only byte sink that starts a new file once the current one would pass ``max_bytes``."""

    def __init__(
        self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS
    ) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"max_bytes must be >= 1 and backups >= 0, got {max_bytes} and {backups}")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)

    def write(self, data: bytes) -> None:
        while data:
            room = self.max_bytes - self._size
            if room <= 0:
                self.rotate()
                continue
            chunk = self._split_point(data, room)
            if chunk == 0:
                self.rotate()
                continue
            os.write(self._fd, data[:chunk])
            self._size += chunk
            data = data[chunk:]

    def _split_point(self, data: bytes, room: int) -> int:
        if len(data) <= room:
            return len(data)
        # Prefer to end a file on a line boundary so no line straddles two files.
        newline = data.rfind(b"\n", 0, room)
        if newline >= 0:
            return newline + 1
        return room if self._size == 0 else 0

    def rotate(self) -> None:
        os.close(self._fd)
        if self.backups == 0:
            os.truncate(self.path, 0)
        else:
            for index in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fd = self._open()
        self._size = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_tail(path: Path, lines: int, block: int = 64 * 1024) -> list[bytes]:
    """The last ``lines`` lines of one file, read backwards in blocks (log files can be large)."""
    with path.open("rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        data = b""
        pos = end
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(block, pos)
            pos -= step
            handle.seek(pos)
            data = handle.read(step) + data
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    if pos > 0:
        parts = parts[1:]  # the first piece may be the end of a longer line
    return parts[-lines:] if lines else []


def tail(
    log_dir: Path, stream: str = "stdout", lines: int = 100, backups: int = DEFAULT_BACKUPS
) -> list[str]:
    """The last ``lines`` lines a worker wrote to ``stream``, reaching into rotated files if needed."""
    if stream not in STREAMS:
        raise NotFound(f"no log stream {stream!r}; use one of {', '.join(STREAMS)}")
    current = log_path(log_dir, stream)
    if not current.exists():
        raise NotFound(f"no {stream} log at {current}: the worker has not been started in this slot")
    collected: list[bytes] = []
    files = [current] + [current.with_name(f"{current.name}.{i}") for i in range(1, backups + 1)]
    for path in files:
        if len(collected) >= lines or not path.exists():
            break
        collected = _read_tail(path, lines - len(collected)) + collected
    return [line.decode("utf-8", "replace") for line in collected[-lines:]] if lines else []
