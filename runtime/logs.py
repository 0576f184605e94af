"""A worker's output: one time-ordered log stream with rotation, and reading its last lines back.

The keeper writes stdout and stderr into one file, ``<log_dir>/worker.log``, one record per line in
the CRI logging format that Kubernetes' container runtimes write (containerd, CRI-O), so tools
that read container logs read ours::

    2026-12-03T08:00:36.123456789Z stdout F a whole line
    2026-12-03T08:00:36.123501000Z stderr P the start of a line that had not ended yet, ...
    2026-12-03T08:00:36.130000000Z stderr F ... and its end

``F`` ends a line; ``P`` is part of a line whose rest follows in a later record of the same stream.
The keeper writes what it reads at once (a line cut by a pipe read becomes ``P`` + ``F``) and holds
nothing back, so a keeper that dies loses no output it had read. Records from the two streams are
in the order the keeper read them: exact within a stream, as close as two pipes allow between them.

Rotation renames ``worker.log`` to ``worker.log.1`` (and ``.1`` to ``.2`` ...), keeping ``backups``
old files, so the newest records are always in ``worker.log``; a record never straddles two files.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import NotFound

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUPS = 3
LOG_FILE = "worker.log"
STREAMS = ("stdout", "stderr")
#: Longest content of one record; a longer line is cut into partial records (containerd: 16 KiB).
MAX_RECORD_CONTENT = 16 * 1024
#: The most of the log files one read takes in (the newest records first): what an answer and the
#: agent's memory for it are bounded by, whatever the lines asked for and however long they are.
MAX_READ_BYTES = 4 * 1024 * 1024
#: The longest line an answer shows; the rest of a longer one is cut and said so.
MAX_LINE_BYTES = 64 * 1024
_FULL = b"F"
_PARTIAL = b"P"


def log_path(log_dir: Path) -> Path:
    return log_dir / LOG_FILE


def timestamp(ns: int) -> bytes:
    """RFC 3339 UTC with nanoseconds, as CRI log records carry it."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    return b"%s.%09dZ" % (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)).encode(), fraction)


def records(stream: str, data: bytes, ns: int) -> bytes:
    """``data`` as read from one stream, as CRI records stamped ``ns`` (one stamp per read: what
    one read returned arrived together)."""
    head = timestamp(ns) + b" " + stream.encode() + b" "
    out: list[bytes] = []
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: a line that has not ended (b"" when data ended one)
    for line in lines:
        _cut(out, head, line, _FULL)
    if tail:
        _cut(out, head, tail, _PARTIAL)
    return b"".join(out)


def _cut(out: list[bytes], head: bytes, line: bytes, tag: bytes) -> None:
    while len(line) > MAX_RECORD_CONTENT:
        out.append(head + _PARTIAL + b" " + line[:MAX_RECORD_CONTENT] + b"\n")
        line = line[MAX_RECORD_CONTENT:]
    out.append(head + tag + b" " + line + b"\n")


def _dropped_note(lost: int, ns: int) -> bytes:
    return records(
        "stderr",
        b"[nodeagent] %d bytes of this worker's output were dropped: the state file system was below "
        b"the agent's reserve ([state] reserve)\n" % lost,
        ns,
    )


class RotatingLog:
    """Append-only byte sink that starts a new file once the current one would pass ``max_bytes``.

    With ``reserve_bytes``, never the one that fills its file system: a write that would leave less
    than that free there first removes this log's own oldest rotations (the budget of
    ``max_bytes`` x (1 + ``backups``) shrinks to what is free), then is dropped; ``dropped`` counts
    what was lost, and the next write that fits says so in the log."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        *,
        reserve_bytes: int = 0,
    ) -> None:
        if max_bytes < 1 or backups < 0 or reserve_bytes < 0:
            raise ValueError(
                f"max_bytes must be >= 1, backups and reserve_bytes >= 0, got {max_bytes}, {backups} "
                f"and {reserve_bytes}"
            )
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.reserve_bytes = reserve_bytes
        #: Bytes dropped since the last write that fitted (said in the log then).
        self.dropped = 0
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes leave the reserve free, after giving up old rotations."""
        if not self.reserve_bytes:
            return True
        for index in range(self.backups, 0, -1):
            stat = os.fstatvfs(self._fd)
            if stat.f_bavail * stat.f_frsize - size >= self.reserve_bytes:
                return True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.with_name(f"{self.path.name}.{index}"))
        stat = os.fstatvfs(self._fd)
        return stat.f_bavail * stat.f_frsize - size >= self.reserve_bytes

    def append(self, data: bytes, note: Callable[[int], bytes]) -> None:
        """``write(data)`` unless the file system is below the reserve (then ``data`` is counted as
        dropped); the first write that fits after a drop is preceded by ``note(dropped)``."""
        if not self._room_for(len(data)):
            self.dropped += len(data)
            return
        if self.dropped:
            said, self.dropped = note(self.dropped), 0
            self.write(said)
        self.write(data)

    def _open(self) -> int:
        # The agent's alone (it reads them for the API), whatever the umask.
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

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
        # End a file on a line boundary so no line (no record) straddles two files.
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


class LogStream:
    """A worker's stdout and stderr, written as records into one rotating file (``reserve_bytes``:
    see RotatingLog)."""

    def __init__(
        self,
        log_dir: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        *,
        reserve_bytes: int = 0,
    ) -> None:
        self._log = RotatingLog(log_path(log_dir), max_bytes, backups, reserve_bytes=reserve_bytes)

    @property
    def dropped(self) -> int:
        return self._log.dropped

    def write(self, stream: str, data: bytes, ns: int | None = None) -> None:
        when = time.time_ns() if ns is None else ns
        self._log.append(records(stream, data, when), lambda lost: _dropped_note(lost, when))

    def close(self) -> None:
        self._log.close()


# --- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogLine:
    stream: str
    text: str
    #: The record's timestamp as written (RFC 3339); "" for a line that was not a record.
    time: str = ""

    def render(self) -> str:
        """As the API shows it: stdout as is, stderr (and the agent's own word) marked."""
        return self.text if self.stream == "stdout" else f"[{self.stream}] {self.text}"

    def to_json(self) -> dict[str, str]:
        return {"time": self.time, "stream": self.stream, "text": self.text}


def _parse(record: bytes) -> tuple[str, str, bytes, bytes]:
    """(time, stream, tag, content); a line that is not a record counts as a whole stdout line."""
    parts = record.split(b" ", 3)
    if len(parts) >= 3 and parts[1] in (b"stdout", b"stderr") and parts[2] in (_FULL, _PARTIAL):
        content = parts[3] if len(parts) > 3 else b""
        return parts[0].decode("ascii", "replace"), parts[1].decode(), parts[2], content
    return "", "stdout", _FULL, record


def _read_tail(path: Path, lines: int, budget: int, block: int = 64 * 1024) -> tuple[list[bytes], int]:
    """The last ``lines`` lines of one file, read backwards in blocks (log files can be large),
    taking in at most ``budget`` bytes; and the bytes taken."""
    with path.open("rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        blocks: list[bytes] = []
        newlines = 0
        pos = end
        while pos > 0 and newlines <= lines and end - pos < budget:
            step = min(block, pos, budget - (end - pos))
            pos -= step
            handle.seek(pos)
            chunk = handle.read(step)
            newlines += chunk.count(b"\n")
            blocks.append(chunk)
    data = b"".join(reversed(blocks))
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    if pos > 0:
        parts = parts[1:]  # the first piece may be the end of a longer line
    return (parts[-lines:] if lines else []), end - pos


def _shown(held: bytes, cut: int) -> str:
    text = held.decode("utf-8", "replace")
    return f"{text} [{cut} more bytes of this line not shown]" if cut else text


def read_log(
    log_dir: Path, lines: int = 100, backups: int = DEFAULT_BACKUPS, *, complete_only: bool = False
) -> list[LogLine]:
    """The last ``lines`` lines the worker wrote, both streams in time order, reaching into rotated
    files if needed; partial records are joined into their line. ``complete_only``: leave out lines
    still being written (a follower shows them once they end, stamped with their start).

    Bounded whatever the worker wrote: at most MAX_READ_BYTES of the newest records are taken in
    (fewer lines than asked when they are long), and a line longer than MAX_LINE_BYTES is shown
    cut, saying how much was left out."""
    current = log_path(log_dir)
    if not current.exists():
        raise NotFound(f"no worker log at {current}: the worker has not been started in this slot")
    if lines <= 0:
        return []
    # A line may take several records (partials); read a margin and cut after assembling.
    wanted = lines * 2 + 16
    raw: list[bytes] = []
    budget = MAX_READ_BYTES
    files = [current] + [current.with_name(f"{current.name}.{i}") for i in range(1, backups + 1)]
    for path in files:
        if len(raw) >= wanted or budget <= 0 or not path.exists():
            break
        found, taken = _read_tail(path, wanted - len(raw), budget)
        raw = found + raw
        budget -= taken
    out: list[LogLine] = []
    # stream -> (the line's start time, what is held of it, bytes of it cut)
    pending: dict[str, tuple[str, bytes, int]] = {}
    for record in raw:
        when, stream, tag, content = _parse(record)
        started, held, cut = pending.pop(stream, (when, b"", 0))
        room = MAX_LINE_BYTES - len(held)
        if len(content) > room:
            held, cut = held + content[: max(room, 0)], cut + len(content) - max(room, 0)
        else:
            held += content
        if tag == _PARTIAL:
            pending[stream] = (started, held, cut)
        else:
            out.append(LogLine(stream, _shown(held, cut), started))
    if not complete_only:
        for stream, (started, held, cut) in pending.items():  # lines still being written
            out.append(LogLine(stream, _shown(held, cut), started))
    return out[-lines:]
