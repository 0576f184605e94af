"""The worker log stream: CRI records, partial and long lines, rotation, reading back in time order."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from nodeagent.errors import NotFound
from nodeagent.runtime.logs import (
    MAX_LINE_BYTES,
    MAX_READ_BYTES,
    MAX_RECORD_CONTENT,
    LogLine,
    LogStream,
    RotatingLog,
    read_log,
    records,
    timestamp,
)

T0 = 1_796_000_000_123_456_789  # 2026-11-30T...Z, nanoseconds


def test_timestamp_is_rfc3339_utc_with_nanoseconds():
    assert timestamp(0) == b"1970-01-01T00:00:00.000000000Z"
    assert timestamp(1_000_000_001) == b"1970-01-01T00:00:01.000000001Z"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"one\n", [b"stdout F one"], id="a-line"),
        pytest.param(b"one\ntwo\n", [b"stdout F one", b"stdout F two"], id="two-lines"),
        pytest.param(b"one\npart", [b"stdout F one", b"stdout P part"], id="unfinished-line"),
        pytest.param(b"\n", [b"stdout F "], id="empty-line"),
        pytest.param(b"no newline", [b"stdout P no newline"], id="only-partial"),
    ],
)
def test_records_mark_the_stream_and_whole_or_partial_lines(data, expected):
    out = records("stdout", data, T0).splitlines()
    assert [line.split(b" ", 1)[1] for line in out] == expected
    assert all(line.startswith(timestamp(T0) + b" ") for line in out)


def test_a_long_line_is_cut_into_partial_records(tmp_path):
    line = b"x" * (MAX_RECORD_CONTENT * 2 + 10)
    out = records("stderr", line + b"\n", T0).splitlines()
    assert [r.split(b" ")[2] for r in out] == [b"P", b"P", b"F"]
    assert all(len(r.split(b" ", 3)[3]) <= MAX_RECORD_CONTENT for r in out)
    stream = LogStream(tmp_path)
    stream.write("stderr", line + b"\n", T0)
    stream.close()
    assert read_log(tmp_path, 5) == [LogLine("stderr", line.decode(), timestamp(T0).decode())]


def test_both_streams_read_back_in_time_order_with_partials_joined(tmp_path):
    stream = LogStream(tmp_path)
    stream.write("stdout", b"out 1\nout 2 begins", T0)
    stream.write("stderr", b"err 1\n", T0 + 1)
    stream.write("stdout", b" and ends\nout 3\n", T0 + 2)
    stream.write("stderr", b"still being written", T0 + 3)
    stream.close()
    lines = read_log(tmp_path, 10)
    assert [(line.stream, line.text) for line in lines] == [
        ("stdout", "out 1"),
        ("stderr", "err 1"),
        ("stdout", "out 2 begins and ends"),
        ("stdout", "out 3"),
        ("stderr", "still being written"),
    ]
    assert [line.render() for line in lines][:2] == ["out 1", "[stderr] err 1"]
    assert [line.text for line in read_log(tmp_path, 2)] == ["out 3", "still being written"]


def test_rotation_keeps_whole_records_and_reading_reaches_into_old_files(tmp_path):
    record_bytes = len(records("stdout", b"line 00\n", T0))
    stream = LogStream(tmp_path, max_bytes=2 * record_bytes, backups=2)
    for i in range(12):
        stream.write("stdout" if i % 3 else "stderr", f"line {i:02d}\n".encode(), T0 + i)
    stream.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker.log", "worker.log.1", "worker.log.2"]
    for path in tmp_path.iterdir():
        assert all(len(line.split(b" ", 3)) == 4 for line in path.read_bytes().splitlines()), path
    assert [line.text for line in read_log(tmp_path, 5)] == [f"line {i:02d}" for i in range(7, 12)]
    assert [line.render() for line in read_log(tmp_path, 100)] == [
        f"[stderr] line {i:02d}" if i % 3 == 0 else f"line {i:02d}" for i in range(6, 12)
    ]


def test_a_write_larger_than_a_file_is_split_on_lines(tmp_path):
    log = RotatingLog(tmp_path / "plain.log", max_bytes=16, backups=5)
    log.write(b"aaaa\nbbbb\ncccc\ndddd\n")
    log.close()
    assert all(p.stat().st_size <= 16 for p in tmp_path.iterdir())
    assert (
        b"".join(p.read_bytes() for p in sorted(tmp_path.iterdir(), reverse=True))
        == b"aaaa\nbbbb\ncccc\ndddd\n"
    )


def test_lines_that_are_not_records_read_as_stdout(tmp_path):
    (tmp_path / "worker.log").write_bytes(b"written by hand\n")
    assert read_log(tmp_path, 3) == [LogLine("stdout", "written by hand")]


def test_reading_a_missing_log_says_why(tmp_path):
    with pytest.raises(NotFound, match="has not been started"):
        read_log(tmp_path)
    (tmp_path / "worker.log").write_bytes(b"")
    assert read_log(tmp_path, 0) == []


def test_bad_rotation_settings_are_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="max_bytes"):
        LogStream(tmp_path, max_bytes=0)


def test_one_huge_line_is_read_back_cut_and_in_bounded_memory(tmp_path: Path) -> None:
    # 30 MB in one line (cut into partial records as it is written), then an ordinary line.
    stream = LogStream(tmp_path, max_bytes=64 << 20, backups=1)
    chunk = b"x" * (1 << 20)
    for _ in range(30):
        stream.write("stdout", chunk, ns=1)
    stream.write("stdout", b"\nlast\n", ns=2)
    stream.close()
    tracemalloc.start()
    try:
        lines = read_log(tmp_path, lines=10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines[-1].text == "last"
    huge = lines[-2].text
    assert huge.startswith("x" * MAX_LINE_BYTES)
    assert huge.endswith(" more bytes of this line not shown]")
    assert sum(len(line.text) for line in lines) < MAX_LINE_BYTES + 100
    # What one answer takes in is bounded by MAX_READ_BYTES, not by the line's 30 MB.
    assert peak < 4 * MAX_READ_BYTES


class FakeDisk:
    """os.fstatvfs with a free space the test sets (bytes)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, fd: int) -> os.statvfs_result:
        return os.statvfs_result((4096, 4096, 1 << 20, 0, self.free // 4096, 0, 0, 0, 0, 255))


def test_below_the_reserve_a_log_gives_up_its_rotations_then_drops_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FakeDisk(free=1 << 30)
    monkeypatch.setattr(os, "fstatvfs", disk)
    stream = LogStream(tmp_path, max_bytes=200, backups=2, reserve_bytes=64 << 20)
    for n in range(12):
        stream.write("stdout", b"line %d\n" % n, ns=T0 + n)
    assert (tmp_path / "worker.log.2").exists()
    # The file system falls below the reserve: the oldest rotations go first ...
    disk.free = (64 << 20) + 10
    stream.write("stdout", b"still no room once they are gone\n", ns=T0 + 20)
    assert not (tmp_path / "worker.log.2").exists()
    assert not (tmp_path / "worker.log.1").exists()
    assert stream.dropped > 0
    # ... then the output is dropped, counted, and said once space returns.
    stream.write("stderr", b"lost\n", ns=T0 + 21)
    lost = stream.dropped
    disk.free = 1 << 30
    stream.write("stdout", b"back\n", ns=T0 + 22)
    stream.close()
    assert stream.dropped == 0
    text = [line.render() for line in read_log(tmp_path, 3)]
    assert text[-2] == (
        f"[stderr] [nodeagent] {lost} bytes of this worker's output were dropped: the state file system "
        "was below the agent's reserve ([state] reserve)"
    )
    assert text[-1] == "back"
