"""The keeper's wire protocol and the agent-side handles, on socketpairs, pipes and tmp files (no root)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime import keeper_protocol as proto
from nodeagent.runtime.process import (
    STATE_FILE,
    Custody,
    ExitRecord,
    ProcessIdentity,
    WorkerProcess,
    WorkerState,
    fd_fired,
    read_state,
    write_state,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def test_a_message_and_its_descriptors_arrive_together(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        proto.send(a, {"op": "armed", "pid": 7}, [r, w])
        body, fds = proto.receive(b)
        assert body == {"op": "armed", "pid": 7}
        assert len(fds) == 2
        os.write(fds[1], b"through the passed descriptor")
        assert os.read(r, 100) == b"through the passed descriptor"
        assert all(not os.get_inheritable(fd) for fd in fds)  # close-on-exec on arrival
        for fd in fds:
            os.close(fd)
    finally:
        os.close(r)
        os.close(w)


def test_messages_keep_their_boundaries(pair):
    a, b = pair
    proto.send(a, {"op": "arm"})
    proto.send(a, {"op": "status"})
    assert proto.receive(b)[0] == {"op": "arm"}
    assert proto.receive(b)[0] == {"op": "status"}


def test_eof_is_none(pair):
    a, b = pair
    a.close()
    assert proto.receive(b) == (None, [])


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"not json", id="not-json"),
        pytest.param(b'["op"]', id="not-an-object"),
        pytest.param(b'{"pid": 1}', id="no-op"),
    ],
)
def test_malformed_messages_are_refused(pair, raw):
    a, b = pair
    a.send(raw)
    with pytest.raises(proto.ProtocolError):
        proto.receive(b)


def test_an_oversized_message_is_refused_before_sending(pair):
    a, _ = pair
    with pytest.raises(proto.ProtocolError, match="over"):
        proto.send(a, {"op": "status", "padding": "x" * proto.MAX_MESSAGE})


# --- the state file ------------------------------------------------------------------------------

CUSTODY = Custody(
    stdout_fifo="/w/run/stdout.fifo",
    stderr_fifo="/w/run/stderr.fifo",
    log_dir="/w/logs",
    log_max_bytes=100,
    log_backups=2,
    cgroup_procs=("/sys/fs/cgroup/pids/s/cgroup.procs",),
    stop_grace_seconds=3.0,
    oom_events="/sys/fs/cgroup/memory/s/memory.oom_control",
    oom_before=1,
)
STATE = WorkerState("s1-1", ProcessIdentity(10, 100), ProcessIdentity(2, 20), 1.5, None, CUSTODY)


def test_state_round_trips_with_custody_and_exit(tmp_path):
    final = WorkerState(**{**STATE.__dict__, "exit": ExitRecord.unknown(oom_kills=1, finished_at=9.0)})
    for state in (STATE, final):
        write_state(tmp_path, state)
        assert read_state(tmp_path) == state
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # no temporary left behind
    body = json.loads((tmp_path / STATE_FILE).read_text())
    assert body["exit"]["description"].startswith("ended after the keeper that started it was gone")
    assert "env" not in json.dumps(body)  # never the worker's environment


def test_a_state_without_custody_still_reads(tmp_path):
    body = {**STATE.to_json(), "custody": None}
    (tmp_path / STATE_FILE).write_text(json.dumps(body))
    state = read_state(tmp_path)
    assert state is not None
    assert state.custody is None


@pytest.mark.parametrize(
    ("record", "text"),
    [
        pytest.param(ExitRecord.lost(1.0), "no keeper watched it", id="lost"),
        pytest.param(
            ExitRecord.unknown(oom_kills=0, finished_at=1.0), "exit status is unknown", id="unknown"
        ),
        pytest.param(ExitRecord.unknown(oom_kills=2, finished_at=1.0), "OOM killer", id="unknown-oom"),
        pytest.param(
            ExitRecord.from_wait_status(3 << 8, oom_kills=0, finished_at=1.0), "status 3", id="exit"
        ),
    ],
)
def test_exit_records_say_what_is_known(record, text):
    assert text in record.describe()
    assert not record.succeeded


# --- the agent's handle ---------------------------------------------------------------------------


class FakeKeeper:
    """What WorkerProcess needs of the keeper client: watch() hands out a fresh notice pipe."""

    def __init__(self, answer: str = "watching") -> None:
        self.answer = answer
        self.calls = 0
        self.writers: list[int] = []

    def watch(self, run_dir: Path, launch_id: str) -> int | None:
        self.calls += 1
        if self.answer == "unreachable":
            raise WorkerError("no keeper")
        if self.answer == "final":
            return None
        r, w = os.pipe2(os.O_CLOEXEC)
        self.writers.append(w)
        return r

    def close(self) -> None:
        for w in self.writers:
            os.close(w)


@pytest.fixture
def notice() -> Iterator[tuple[int, int]]:
    r, w = os.pipe2(os.O_CLOEXEC)
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):
            os.close(fd)


def handle(tmp_path: Path, read_end: int, keeper: FakeKeeper) -> WorkerProcess:
    return WorkerProcess(STATE, tmp_path, -1, os.dup(read_end), keeper)


def test_nothing_to_report_until_the_keeper_closes_the_notice(tmp_path, notice):
    r, w = notice
    keeper = FakeKeeper()
    worker = handle(tmp_path, r, keeper)
    assert worker.poll() is None
    assert worker.exit_fd is not None
    assert not fd_fired(worker.exit_fd)
    record = ExitRecord.from_wait_status(9, oom_kills=0, finished_at=5.0)
    write_state(tmp_path, WorkerState(**{**STATE.__dict__, "exit": record}))
    os.close(w)  # what the keeper does once the record is final
    assert worker.poll() == record
    assert keeper.calls == 0
    worker.close()


def test_a_keeper_death_hands_the_worker_to_the_next_keeper(tmp_path, notice):
    r, w = notice
    keeper = FakeKeeper()
    worker = handle(tmp_path, r, keeper)
    old_fd = worker.exit_fd
    os.close(w)  # the keeper died: its end closed, no record written
    assert worker.poll() is None  # still running, now watched by the new keeper
    assert keeper.calls == 1
    assert worker.exit_fd is not None
    assert not fd_fired(worker.exit_fd)  # the new keeper's notice, not the fired one
    assert old_fd is not None
    worker.close()
    keeper.close()


def test_no_keeper_reachable_means_ask_again_later(tmp_path, notice):
    r, w = notice
    worker = handle(tmp_path, r, FakeKeeper("unreachable"))
    os.close(w)
    assert worker.poll() is None
    assert worker.poll() is None
    worker.close()


def test_a_worker_no_keeper_holds_and_nobody_recorded_is_lost(tmp_path, notice):
    r, w = notice
    worker = handle(tmp_path, r, FakeKeeper("final"))
    os.close(w)
    record = worker.poll(now=42.0)
    assert record is not None
    assert (record.reason, record.finished_at) == ("lost", 42.0)
    worker.close()
