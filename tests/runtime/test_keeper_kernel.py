"""The host keeper on the real kernel: what survives an agent or a keeper death, trees ended after the
main process exits, the subreaper, one keeper per directory, the handshake, and its footprint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime import keeper_protocol as proto
from nodeagent.runtime.adopt import adopt
from nodeagent.runtime.keeper_client import KeeperClient, keeper_identity, stop_keeper
from nodeagent.runtime.logs import read_log
from nodeagent.runtime.process import (
    ORPHAN_GRACE_SECONDS,
    ExitRecord,
    ProcessIdentity,
    WorkerProcess,
    WorkerState,
    fd_fired,
    process_start_time,
    read_state,
    write_state,
)
from tests.runtime.conftest import (
    current_keeper,
    kill,
    make_request,
    stop_test_keeper,
    wait_for_exit,
    wait_gone,
    wait_until,
)
from tests.runtime.slotcg import V1Slot

#: What the keeper must never load: each costs megabytes in a process that runs for months.
HEAVY = (
    "pydantic",
    "fastapi",
    "starlette",
    "uvicorn",
    "numpy",
    "psutil",
    "pyroute2",
    "httpx",
    "click",
    "pyudev",
    "prometheus_client",
    "sqlite3",
    "asyncio",
    "threading",
)


def proc_field(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {key}")


def test_the_keeper_loads_only_what_it_needs():
    script = "import json, sys; import nodeagent.runtime.keeper; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    loaded = json.loads(done.stdout)
    assert not {name.split(".")[0] for name in loaded} & set(HEAVY)
    layers = (
        "nodeagent.agent",
        "nodeagent.isolation",
        "nodeagent.cgroups",
        "nodeagent.devices",
        "nodeagent.schema",
    )
    assert [name for name in loaded if name.startswith(layers)] == []


@pytest.mark.root
def test_a_new_agent_reattaches_to_the_running_keeper(tmp_path, slot: V1Slot, keeper: KeeperClient):
    req = make_request(tmp_path, slot, ["sleep", "300"])
    worker = keeper.launch(req)
    first = current_keeper(tmp_path / "keeper")
    # One small single-threaded process.
    assert proc_field(first.pid, "Threads") == "1"
    assert int(proc_field(first.pid, "VmRSS").split()[0]) < 40 * 1024
    keeper.close()  # the agent goes away; the keeper and the worker stay
    worker.close()

    second = KeeperClient(tmp_path / "keeper")
    try:
        assert second.connect() == first  # the same keeper: none was started
        found = adopt(Path(req.run_dir), second)
        assert found.process is not None
        assert found.process.identity == worker.identity
        assert found.process.exit_fd is not None
        assert not fd_fired(found.process.exit_fd)
        found.process.send_signal(signal.SIGTERM)
        # The notice fires once the record is final: poll has it at once, no waiting on files.
        wait_until("the notice", lambda: fd_fired(found.process.exit_fd))  # type: ignore[union-attr, arg-type]
        record = found.process.poll()
        assert record is not None
        assert (record.signal, record.reason) == (signal.SIGTERM, "signaled")
        found.process.close()
    finally:
        stop_test_keeper(tmp_path / "keeper", second)


@pytest.mark.root
def test_an_exit_while_no_agent_is_connected_is_recorded_durably(tmp_path, slot, keeper: KeeperClient):
    req = make_request(tmp_path, slot, ["sh", "-c", "sleep 0.3; exit 9"])
    keeper.launch(req).close()
    keeper.close()
    record = wait_for_exit(Path(req.run_dir))  # written with no agent connected
    assert (record.code, record.reason) == (9, "exited")
    state = read_state(Path(req.run_dir))
    assert state is not None
    assert state.keeper == current_keeper(tmp_path / "keeper")
    # Custody ends with the record: its link goes right after the record is written.
    wait_until("the custody link to go", lambda: not list((tmp_path / "keeper" / "workers").iterdir()), 5)


@pytest.mark.root
def test_a_killed_keeper_leaves_workers_running_loses_no_output_and_is_replaced(
    tmp_path, slot, keeper: KeeperClient, kill_workers
):
    # One numbered line every 10 ms: a gap in the log would show output lost across the death.
    script = 'i=0; while [ $i -lt 100000 ]; do echo "line $i"; i=$((i+1)); sleep 0.01; done'
    req = make_request(tmp_path, slot, ["sh", "-c", script], stop_grace_seconds=1)
    worker = keeper.launch(req)
    kill_workers.append(worker.identity)
    log_dir = Path(req.log_dir)
    wait_until("output", lambda: (log_dir / "worker.log").exists() and len(read_log(log_dir, 10)) >= 10)
    old = current_keeper(tmp_path / "keeper")
    os.kill(old.pid, signal.SIGKILL)  # the keeper this test started
    assert wait_gone(old)
    killed_at = time.monotonic()

    # The agent's side notices and starts a new keeper, which re-adopts the worker.
    new = wait_until("a new keeper", lambda: (k := keeper_identity(tmp_path / "keeper")) != old and k)
    assert process_start_time(worker.pid) == worker.identity.start_time  # untouched
    assert slot.pids() == [worker.pid] or worker.pid in slot.pids()
    status = keeper.status()
    assert status["pid"] == new.pid
    custody = [w for w in status["workers"] if w["pid"] == worker.pid]  # type: ignore[union-attr]
    assert custody == [
        {
            "pid": worker.pid,
            "start_time": worker.identity.start_time,
            "launch_id": req.launch_id,
            "run_dir": str(Path(req.run_dir).resolve()),
            "child": False,
            "finishing": False,
            "final": False,
        }
    ]
    # No line lost: what the worker wrote while no keeper read waited in its FIFO.
    wait_until("output after the death", lambda: time.monotonic() - killed_at > 0.5)
    # More than 40 lines in all (on a loaded host the worker's sleeps stretch: wait for them).
    wait_until("40 lines", lambda: len(read_log(log_dir, 100_000)) > 40, 30)
    numbers = [int(line.text.split()[1]) for line in read_log(log_dir, 100_000)]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert len(numbers) > 40

    # The agent's handle had its notice fire; it now holds the new keeper's.
    assert worker.poll() is None
    assert worker.exit_fd is not None
    worker.send_signal(signal.SIGTERM)
    record = wait_until("the exit record", worker.poll)
    # The new keeper saw when it ended (pidfd) but, not its parent, not how.
    assert record.reason == "unknown"
    assert abs(record.finished_at - time.time()) < 5
    assert slot.pids() == []
    worker.close()


@pytest.mark.root
@pytest.mark.parametrize(
    "ignores_term",
    [pytest.param(False, id="helpers-obey-sigterm"), pytest.param(True, id="helpers-ignore-sigterm")],
)
def test_when_the_main_process_exits_nothing_of_its_tree_runs_on(tmp_path, slot, keeper, ignores_term):
    helper = "trap '' TERM; sleep 300" if ignores_term else "exec sleep 300"
    script = f'sh -c "{helper}" & sh -c "{helper}" & sleep 0.3; exit 4'
    req = make_request(tmp_path, slot, ["sh", "-c", script], stop_grace_seconds=0.5)
    keeper.launch(req).close()
    wait_until("the helpers", lambda: len(slot.pids()) >= 3)
    keeper.close()  # and with no agent connected
    record = wait_for_exit(Path(req.run_dir))
    assert (record.code, record.reason) == (4, "exited")
    assert slot.pids() == []  # already when the record is final
    recorded_after = (Path(req.run_dir) / "worker.json").stat().st_mtime - record.finished_at
    if ignores_term:
        assert recorded_after >= 0.5  # SIGKILL came after the grace period
    else:
        assert recorded_after < 0.5  # SIGTERM was enough


@pytest.mark.root
def test_helpers_of_a_main_process_that_ended_on_its_own_get_an_orphans_grace(tmp_path, slot, keeper):
    """A server that crashed left helpers that ignore SIGTERM: its restart must not wait for its
    whole stop grace (30 s here) before they are killed, only for ORPHAN_GRACE_SECONDS."""
    script = "sh -c \"trap '' TERM; sleep 300\" & sleep 0.3; exit 3"
    req = make_request(tmp_path, slot, ["sh", "-c", script], stop_grace_seconds=30)
    keeper.launch(req).close()
    record = wait_for_exit(Path(req.run_dir), timeout=ORPHAN_GRACE_SECONDS + 20)
    assert (record.code, record.reason) == (3, "exited")
    assert slot.pids() == []
    recorded_after = (Path(req.run_dir) / "worker.json").stat().st_mtime - record.finished_at
    assert ORPHAN_GRACE_SECONDS <= recorded_after < 30  # killed after the orphan's grace, not the stop's


@pytest.mark.root
def test_helpers_of_a_worker_asked_to_stop_get_the_whole_stop_grace(tmp_path, slot, keeper):
    """Asked to stop (through its handle), the main process exits at once; its helper, still
    draining (it ignores SIGTERM), is killed only when the stop grace is over."""
    grace = ORPHAN_GRACE_SECONDS + 1.5
    script = "sh -c \"trap '' TERM; sleep 300\" & trap 'exit 0' TERM; sleep 300 & wait"
    req = make_request(tmp_path, slot, ["sh", "-c", script], stop_grace_seconds=grace)
    worker = keeper.launch(req)
    wait_until("the helper", lambda: len(slot.pids()) >= 3)
    worker.send_signal(signal.SIGTERM)
    record = wait_for_exit(Path(req.run_dir), timeout=grace + 20)
    worker.close()
    assert slot.pids() == []
    recorded_after = (Path(req.run_dir) / "worker.json").stat().st_mtime - record.finished_at
    assert recorded_after >= grace


@pytest.mark.root
def test_an_unisolated_worker_leaves_nothing_of_its_process_group(tmp_path, keeper):
    req = make_request(tmp_path, None, ["sh", "-c", "sleep 300 & echo $!; sleep 0.3; exit 3"])
    worker = keeper.launch(req)
    log_dir = Path(req.log_dir)
    pid = int(
        wait_until("the helper's pid", lambda: (log_dir / "worker.log").exists() and read_log(log_dir, 1))[
            0
        ].text
    )
    start_time = process_start_time(pid)
    assert start_time is not None
    helper = ProcessIdentity(pid, start_time)
    try:
        record = wait_for_exit(Path(req.run_dir))
        assert record.code == 3
        assert wait_gone(helper, 5)
    finally:
        kill(helper)
        worker.close()


@pytest.mark.root
def test_an_orphaned_grandchild_is_reaped_by_the_keeper(tmp_path, slot, keeper, kill_workers):
    # The subshell forks a sleep and exits; the worker (the outer sh) is alive but no subreaper,
    # so the orphan goes to the keeper, which must reap it.
    req = make_request(tmp_path, slot, ["sh", "-c", "(sleep 0.5 & echo $!); exec sleep 300"])
    worker = keeper.launch(req)
    kill_workers.append(worker.identity)
    log_dir = Path(req.log_dir)
    pid = int(
        wait_until("the orphan's pid", lambda: (log_dir / "worker.log").exists() and read_log(log_dir, 1))[
            0
        ].text
    )
    host_keeper = current_keeper(tmp_path / "keeper")
    assert int(proc_field(pid, "PPid")) == host_keeper.pid
    wait_until(f"orphan {pid} to be reaped", lambda: not Path(f"/proc/{pid}").exists(), timeout=5)
    assert process_start_time(worker.pid) == worker.identity.start_time
    slot.kill_all(5.0)


@pytest.mark.root
def test_sigterm_stops_the_keeper_and_the_next_one_takes_its_workers(tmp_path, slot, keeper, kill_workers):
    req = make_request(tmp_path, slot, ["sh", "-c", "echo before; sleep 300"])
    worker = keeper.launch(req)
    kill_workers.append(worker.identity)
    log_dir = Path(req.log_dir)
    wait_until("output", lambda: (log_dir / "worker.log").exists() and read_log(log_dir, 1))
    old = stop_keeper(tmp_path / "keeper")
    assert old is not None
    assert process_start_time(worker.pid) == worker.identity.start_time
    new = keeper.connect()  # the agent's side starts the next one (or already has)
    assert new != old
    assert [w["pid"] for w in keeper.status()["workers"]] == [worker.pid]  # type: ignore[union-attr]
    slot.kill_all(5.0)
    record = wait_until("the exit record", worker.poll)
    assert record.reason == "unknown"


@pytest.mark.root
def test_only_one_keeper_runs_per_directory(tmp_path, keeper):
    running = current_keeper(tmp_path / "keeper")
    second = subprocess.run(
        [sys.executable, "-m", "nodeagent.runtime.keeper", str(tmp_path / "keeper")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert second.returncode == proto.EXIT_ALREADY_RUNNING
    assert "another keeper holds" in second.stderr
    other = KeeperClient(tmp_path / "keeper")
    try:
        assert other.connect() == running
    finally:
        other.close()


@pytest.mark.root
def test_a_protocol_mismatch_is_refused_with_what_to_do(tmp_path, keeper, monkeypatch):
    running = current_keeper(tmp_path / "keeper")
    spoken = proto.PROTOCOL
    monkeypatch.setattr(proto, "PROTOCOL", spoken + 1)
    newer = KeeperClient(tmp_path / "keeper")
    try:
        with pytest.raises(WorkerError, match=rf"speaks protocol {spoken} .*kill -TERM {running.pid}"):
            newer.connect()
    finally:
        newer.close()
    assert process_start_time(running.pid) == running.start_time  # left alone


@pytest.mark.root
def test_the_keeper_answers_bad_requests_and_keeps_serving(tmp_path, keeper):
    path = str(tmp_path / "keeper" / proto.SOCKET_NAME)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
        raw.settimeout(10)
        raw.connect(path)
        proto.send(raw, {"op": "status"})  # before hello
        reply, _ = proto.receive(raw)
        assert reply is not None
        assert (reply["op"], reply["request"]) == ("error", "hello")
        assert proto.receive(raw) == (None, [])  # and the connection is closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:
        raw.settimeout(10)
        raw.connect(path)
        proto.send(raw, {"op": "hello", "protocol": proto.PROTOCOL})
        assert proto.receive(raw)[0]["op"] == "welcome"  # type: ignore[index]
        proto.send(raw, {"op": "launch-everything"})
        reply, _ = proto.receive(raw)
        assert reply == {
            "op": "error",
            "request": "launch-everything",
            "message": "unknown request 'launch-everything'",
        }
        raw.send(b"not json")  # a malformed message ends this connection only
        assert proto.receive(raw) == (None, [])
    assert keeper.status()["op"] == "status"


@pytest.mark.parametrize(
    "old_keeper_records",
    [pytest.param(True, id="old-keeper-records"), pytest.param(False, id="old-keeper-dies")],
)
def test_a_worker_of_an_earlier_per_worker_keeper_is_taken_over(tmp_path, keeper, old_keeper_records):
    """After an upgrade: worker.json without custody names a per-worker keeper that still runs. The
    host keeper waits for it; its record stands, or, if it dies without one, the worker is adopted."""
    processes = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        old_keeper, old_worker = (ProcessIdentity(p.pid, process_start_time(p.pid) or 0) for p in processes)
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        state = WorkerState("legacy-1", old_worker, old_keeper, time.time())
        write_state(run_dir, state)
        notice = keeper.watch(run_dir, "legacy-1")
        assert notice is not None
        worker = WorkerProcess(state, run_dir, -1, notice, keeper)
        assert worker.poll() is None
        if old_keeper_records:
            record = ExitRecord.from_wait_status(5 << 8, oom_kills=0, finished_at=time.time())
            write_state(run_dir, WorkerState("legacy-1", old_worker, old_keeper, state.started_at, record))
            processes[1].kill()
        processes[0].kill()  # the old keeper exits
        if old_keeper_records:
            assert wait_until("the old keeper's record", worker.poll) == record
        else:
            wait_until("the handover", lambda: worker.poll() is None and not fd_fired(worker.exit_fd or -1))
            assert [w["pid"] for w in keeper.status()["workers"]] == [old_worker.pid]  # type: ignore[union-attr]
            processes[1].kill()
            assert wait_until("the exit", worker.poll).reason == "unknown"
        worker.close()
    finally:
        for process in processes:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("python", "says"),
    [
        pytest.param(
            "/nonexistent/python3", "cannot start a keeper for .* with /nonexistent/python3", id="no-python"
        ),
        pytest.param("/bin/false", "exited with status 1 while starting", id="keeper-fails"),
    ],
)
def test_a_keeper_that_cannot_start_is_a_clear_error_retried_with_backoff(tmp_path, python, says):
    client = KeeperClient(tmp_path / "keeper", python=python)
    try:
        with pytest.raises(WorkerError, match=says):
            client.connect()
        with pytest.raises(WorkerError, match=r"retrying in \d"):
            client.connect()  # not at once again: the agent's loops must not spin on it
    finally:
        client.close()


def test_status_pages_through_more_workers_than_a_message_holds(tmp_path, keeper, kill_workers):
    for n in range(110):  # one page is 100
        worker = keeper.launch(make_request(tmp_path / f"w{n}", None, ["sleep", "300"]))
        kill_workers.append(worker.identity)
        worker.close()
    status = keeper.status()
    assert status["total"] == 110
    assert sorted(w["pid"] for w in status["workers"]) == sorted(w.pid for w in kill_workers)


@pytest.mark.root
def test_idle_children_are_cut_to_one_at_rest_and_fill_up_at_the_next_launch(tmp_path, slot, kill_workers):
    """No launch for ``rest_after`` seconds: one armed child is kept instead of two (each is
    megabytes of PSS at rest) and the others exit; the next launch takes the one in hand and
    fills up to two again."""
    client = KeeperClient(tmp_path / "keeper", rest_after=0.5)
    try:
        client.connect()
        worker = client.launch(make_request(tmp_path, slot, ["sleep", "300"]))
        kill_workers.append(worker.identity)
        worker.close()
        in_hand = client.idle_children()
        assert len(in_hand) == 2
        wait_until("the rest", lambda: len(client.idle_children()) == 1)
        (kept,) = client.idle_children()
        for dropped in set(in_hand) - {kept}:
            assert wait_gone(dropped)
        worker = client.launch(make_request(tmp_path, slot, ["sleep", "300"]))
        kill_workers.append(worker.identity)
        worker.close()
        refilled = client.idle_children()
        assert len(refilled) == 2
        assert kept not in refilled  # the launch took the kept one
    finally:
        stop_test_keeper(tmp_path / "keeper", client)
