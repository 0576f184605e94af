"""Log records into systemd's journal through its native protocol, as structured entries.

Why native rather than JSON lines on stdout: the journal stores a stdout line as one MESSAGE at the
unit's default priority, so ``journalctl -p err`` would never show the agent's errors, the JSON could
only be searched as text, and ``journalctl -u nodeagent`` would print raw JSON. Sent natively, each
record is an entry with MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, CODE_FILE/LINE/FUNC and one field per
key of the record's ``extra`` (``slot`` becomes SLOT=...), so ``journalctl -u nodeagent SLOT=<id>``
and ``journalctl -o json`` work on the agent's own fields.

When: systemd sets ``$JOURNAL_STREAM`` to "DEVICE:INODE" of the stream it connected to the journal
(systemd.exec(5)); the agent switches to the native protocol only when its stdout or stderr is still
that very stream (not when it inherited the variable and writes elsewhere). Otherwise logs stay JSON
lines on stdout.

The protocol (systemd's JOURNAL_NATIVE_PROTOCOL notes): one datagram per entry to
``/run/systemd/journal/socket``; a field is ``NAME=value\\n``, or, when the value holds a newline,
``NAME\\n`` + its length as 64-bit little endian + the value + ``\\n``. An entry too large for a
datagram goes in a sealed memfd passed with SCM_RIGHTS. Field names are upper-case letters, digits and
underscores, not starting with an underscore (those are the journal's own trusted fields).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TextIO

JOURNAL_SOCKET = Path("/run/systemd/journal/socket")
IDENTIFIER = "nodeagent"

#: logging levels onto syslog priorities (sd-daemon(3)): DEBUG 7, INFO 6, WARNING 4, ERROR 3, CRITICAL 2.
_PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
_STANDARD_RECORD_KEYS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "color_message"}
#: Fields the handler sets itself; a record's extra of the same name is sent as EXTRA_<NAME>.
_OWN_FIELDS = frozenset(
    {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "CODE_FILE", "CODE_LINE", "CODE_FUNC", "LOGGER", "EXCEPTION"}
)
_NOT_NAME = re.compile(r"[^A-Z0-9_]")
_MAX_NAME = 64
_FORMATTER = logging.Formatter()


def priority(levelno: int) -> int:
    for level, value in _PRIORITIES:
        if levelno >= level:
            return value
    return 7


def field_name(key: str) -> str:
    """A journal field name for an ``extra`` key: upper case, other characters as ``_``, no leading
    underscore or digit (``slot-id`` -> ``SLOT_ID``, ``_x`` -> ``X``, ``2nd`` -> ``X2ND``)."""
    name = _NOT_NAME.sub("_", key.upper()).lstrip("_")
    if not name or name[0].isdigit():
        name = "X" + name
    return name[:_MAX_NAME]


def encode(fields: Iterable[tuple[str, str]]) -> bytes:
    """The datagram for ``fields`` in the journal's native format."""
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def record_fields(record: logging.LogRecord, message: str) -> list[tuple[str, str]]:
    """The journal fields of ``record``: the standard ones, then one per ``extra`` key."""
    fields = [
        ("MESSAGE", message),
        ("PRIORITY", str(priority(record.levelno))),
        ("SYSLOG_IDENTIFIER", IDENTIFIER),
        ("LOGGER", str(record.name)),
    ]
    # Where the call was: absent from records made by hand (logging.makeLogRecord).
    code = (("CODE_FILE", record.pathname), ("CODE_LINE", record.lineno), ("CODE_FUNC", record.funcName))
    fields += [(name, str(value)) for name, value in code if value]
    for key, value in vars(record).items():
        if key in _STANDARD_RECORD_KEYS:
            continue
        name = field_name(key)
        if name in _OWN_FIELDS:
            name = f"EXTRA_{name}"
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        fields.append((name, text))
    return fields


class JournalHandler(logging.Handler):
    """Sends each record to the journal as an entry of fields (see the module docstring).

    A record that cannot be sent (no journal socket, the journal restarting) is written to
    ``fallback`` (stdout: the unit's stream, which the journal reads too) as a JSON line, so nothing is
    lost silently.
    """

    def __init__(self, path: Path = JOURNAL_SOCKET, fallback: TextIO | None = None) -> None:
        super().__init__()
        self.path = path
        self.fallback = fallback
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                # journalctl prints MESSAGE only: the traceback belongs in it, and in a field of its own.
                trace = _FORMATTER.formatException(record.exc_info)
                message = f"{message}\n{trace}"
                fields = [*record_fields(record, message), ("EXCEPTION", trace)]
            else:
                fields = record_fields(record, message)
            self.send(encode(fields))
        except OSError as err:
            self._fall_back(record, err)
        except Exception:  # noqa: BLE001 - a logging call must never raise into the agent
            self.handleError(record)

    def send(self, payload: bytes) -> None:
        try:
            self._sock.sendto(payload, str(self.path))
        except OSError as err:
            if err.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                raise
            self._send_memfd(payload)

    def _send_memfd(self, payload: bytes) -> None:
        """An entry over the datagram limit: written to a sealed memfd whose descriptor is sent instead."""
        fd = os.memfd_create("nodeagent-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, payload)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            self._sock.sendmsg(
                [], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))], 0, str(self.path)
            )
        finally:
            os.close(fd)

    def _fall_back(self, record: logging.LogRecord, err: OSError) -> None:
        if self.fallback is None:
            self.handleError(record)
            return
        body = {"message": record.getMessage(), "level": record.levelname.lower(), "journal_error": str(err)}
        with contextlib.suppress(Exception):
            self.fallback.write(json.dumps(body, default=str) + "\n")
            self.fallback.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        super().close()


def stream_is_journal(environ: Mapping[str, str] | None = None, fds: Iterable[int] = (1, 2)) -> bool:
    """Whether stdout or stderr is the stream systemd connected to the journal (``$JOURNAL_STREAM``)."""
    raw = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = raw.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (int(device), int(inode)):
            return True
    return False


def journal_handler(environ: Mapping[str, str] | None = None) -> JournalHandler | None:
    """A JournalHandler when the agent's output goes to the journal and its socket is there, else None."""
    if not stream_is_journal(environ) or not JOURNAL_SOCKET.exists():
        return None
    return JournalHandler(fallback=sys.stdout)


__all__ = [
    "IDENTIFIER",
    "JOURNAL_SOCKET",
    "JournalHandler",
    "encode",
    "field_name",
    "journal_handler",
    "priority",
    "record_fields",
    "stream_is_journal",
]
