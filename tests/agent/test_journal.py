"""The journal's native protocol: field names, the wire format, and a handler talking to a real socket."""

from __future__ import annotations

import array
import io
import json
import logging
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.journal import (
    JournalHandler,
    encode,
    field_name,
    priority,
    record_fields,
    stream_is_journal,
)


def decode(payload: bytes) -> dict[str, str]:
    """The inverse of the native format, written from its description (not from ``encode``)."""
    fields: dict[str, str] = {}
    rest = payload
    while rest:
        line, sep, after = rest.partition(b"\n")
        assert sep, f"unterminated field in {payload!r}"
        if b"=" in line:
            name, _, value = line.partition(b"=")
            fields[name.decode()] = value.decode()
            rest = after
        else:
            (size,) = struct.unpack("<Q", after[:8])
            value = after[8 : 8 + size]
            assert after[8 + size : 9 + size] == b"\n"
            fields[line.decode()] = value.decode()
            rest = after[9 + size :]
    return fields


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("slot", "SLOT"),
        ("slot-id", "SLOT_ID"),
        ("_private", "PRIVATE"),
        ("2nd", "X2ND"),
        ("é", "X"),
        ("a" * 80, "A" * 64),
    ],
)
def test_field_names_follow_the_journals_rules(key: str, name: str) -> None:
    assert field_name(key) == name


@pytest.mark.parametrize(
    ("level", "expected"),
    [(logging.DEBUG, 7), (logging.INFO, 6), (logging.WARNING, 4), (logging.ERROR, 3), (logging.CRITICAL, 2)],
)
def test_levels_map_onto_syslog_priorities(level: int, expected: int) -> None:
    assert priority(level) == expected


def test_the_wire_format_of_plain_and_multiline_values() -> None:
    payload = encode([("MESSAGE", "hello"), ("EXCEPTION", "a\nb")])
    assert payload == b"MESSAGE=hello\nEXCEPTION\n" + struct.pack("<Q", 3) + b"a\nb\n"
    assert decode(payload) == {"MESSAGE": "hello", "EXCEPTION": "a\nb"}


def test_a_records_extra_fields_become_fields_and_never_replace_the_standard_ones() -> None:
    record = logging.makeLogRecord(
        {"msg": "slot %s ready", "args": ("web",), "levelno": logging.WARNING, "name": "nodeagent.manager"}
    )
    record.slot = "s-1"
    record.report = {"adopted": ["web"]}
    record.priority = "urgent"
    fields = dict(record_fields(record, record.getMessage()))
    assert fields["MESSAGE"] == "slot web ready"
    assert fields["PRIORITY"] == "4"
    assert fields["SYSLOG_IDENTIFIER"] == "nodeagent"
    assert fields["LOGGER"] == "nodeagent.manager"
    assert fields["SLOT"] == "s-1"
    assert json.loads(fields["REPORT"]) == {"adopted": ["web"]}
    assert fields["EXTRA_PRIORITY"] == "urgent"


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "socket"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, path
    sock.close()


def receive(sock: socket.socket) -> bytes:
    """One entry as journald would read it: the datagram, or the memfd passed with it."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_LEN(fds.itemsize))
    for level, kind, cmsg in ancdata:
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            fds.frombytes(cmsg[: len(cmsg) - len(cmsg) % fds.itemsize])
    if not fds:
        return data
    fd = fds[0]
    try:
        assert data == b""
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def test_the_handler_sends_one_entry_per_record(journal: tuple[socket.socket, Path]) -> None:
    sock, path = journal
    handler = JournalHandler(path)
    logger = logging.Logger("nodeagent.test")
    logger.addHandler(handler)
    try:
        logger.info("serving", extra={"startup_seconds": 1.5, "listen": "127.0.0.1:7070"})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        handler.close()
    first = decode(receive(sock))
    assert (first["MESSAGE"], first["PRIORITY"], first["STARTUP_SECONDS"], first["LISTEN"]) == (
        "serving",
        "6",
        "1.5",
        "127.0.0.1:7070",
    )
    second = decode(receive(sock))
    assert second["PRIORITY"] == "3"
    assert second["MESSAGE"].startswith("failed\nTraceback")  # what plain journalctl shows
    assert "ValueError: boom" in second["EXCEPTION"]


def test_an_entry_too_large_for_a_datagram_goes_in_a_sealed_memfd(
    journal: tuple[socket.socket, Path],
) -> None:
    sock, path = journal
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    handler = JournalHandler(path)
    big = "x" * (1 << 19)  # 512 KiB: over the largest datagram a unix socket takes (wmem_max)
    try:
        handler.emit(logging.makeLogRecord({"msg": big, "levelno": logging.INFO}))
    finally:
        handler.close()
    assert decode(receive(sock))["MESSAGE"] == big


def test_without_the_journal_a_record_falls_back_to_a_json_line(tmp_path: Path) -> None:
    out = io.StringIO()
    handler = JournalHandler(tmp_path / "no-such-socket", fallback=out)
    handler.emit(logging.makeLogRecord({"msg": "still here", "levelno": logging.ERROR, "levelname": "ERROR"}))
    handler.close()
    line = json.loads(out.getvalue())
    assert (line["message"], line["level"]) == ("still here", "error")


def test_the_journal_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    target = tmp_path / "stream"
    target.write_text("")
    other = tmp_path / "other"
    other.write_text("")
    with target.open() as stream, other.open() as elsewhere:
        st = os.fstat(stream.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stream_is_journal(env, fds=[elsewhere.fileno(), stream.fileno()])
        assert not stream_is_journal(env, fds=[elsewhere.fileno()])  # inherited, but output goes elsewhere
        assert not stream_is_journal({"JOURNAL_STREAM": "garbage"}, fds=[stream.fileno()])
        assert not stream_is_journal({}, fds=[stream.fileno()])
