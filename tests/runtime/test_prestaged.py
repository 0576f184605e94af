"""The pre-forked worker children: idle outside any slot, never running user code early, taken in
order, cleaned up when unused, and joined to the slot before the worker's first instruction."""

from __future__ import annotations

import os
import select
import signal
import time
from pathlib import Path

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime.enter import join_cgroups, join_file
from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd, process_start_time
from nodeagent.runtime.spawner import Spawner
from tests.runtime.conftest import keeper_of, make_request
from tests.runtime.slotcg import V1Slot


def _parent(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def _identity(pid: int) -> ProcessIdentity:
    start_time = process_start_time(pid)
    assert start_time is not None
    return ProcessIdentity(pid, start_time)


def _wait_gone(identity: ProcessIdentity, timeout: float = 10.0) -> bool:
    pidfd = open_verified_pidfd(identity)
    if pidfd is None:
        return True
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(["cgroup.procs", "tasks"], "tasks", id="v1-uses-tasks"),
        pytest.param(["cgroup.procs"], "cgroup.procs", id="v2-keeps-procs"),
    ],
)
def test_join_file_prefers_tasks_where_it_exists(tmp_path, files, expected):
    for name in files:
        (tmp_path / name).write_text("")
    assert join_file(str(tmp_path / "cgroup.procs")) == str(tmp_path / expected)


def test_join_file_leaves_other_paths_alone(tmp_path):
    (tmp_path / "tasks").write_text("")
    assert join_file(str(tmp_path / "cgroup.threads")) == str(tmp_path / "cgroup.threads")


@pytest.mark.root
def test_joining_through_tasks_moves_the_whole_single_threaded_process(slot: V1Slot):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            join_cgroups(slot.procs_files)
            os.write(write_end, b"joined")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 16) == b"joined"
        assert slot.pids() == [pid]  # cgroup.procs of the pids hierarchy lists the process
        for controller in ("cpuset", "memory", "pids", "freezer"):
            assert f":{controller}:/{slot.name}\n" in Path(f"/proc/{pid}/cgroup").read_text()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)


@pytest.mark.root
def test_idle_children_wait_outside_any_slot_without_running_user_code(spawner: Spawner):
    idle = spawner.idle_children()
    assert len(idle) == 2
    for child in idle:
        # Still the interpreter it was forked from: nothing was exec'd.
        assert Path(f"/proc/{child.pid}/exe").resolve() == Path(f"/proc/{os.getpid()}/exe").resolve()
        assert (
            Path(f"/proc/{child.pid}/cgroup").read_text()
            == Path(f"/proc/{_parent(child.pid)}/cgroup").read_text()
        )
        # stdio and its three pipes, nothing inherited from the agent or the keeper. The child closes
        # the rest right after the fork, and its keeper may announce it before it has: wait for it.
        fds = f"/proc/{child.pid}/fd"
        deadline = time.monotonic() + 10
        while len(os.listdir(fds)) != 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir(fds)) == 6, os.listdir(fds)


@pytest.mark.root
def test_launch_takes_the_first_idle_child(tmp_path, slot, spawner, kill_keepers):
    first = spawner.idle_children()[0]
    result = spawner.launch(make_request(tmp_path, slot, ["sleep", "60"]))
    kill_keepers.append(keeper_of(result))
    assert (result.pid, result.start_time) == (first.pid, first.start_time)
    assert _parent(result.pid) == result.keeper_pid
    slot.kill_all(5.0)


@pytest.mark.root
def test_worker_is_in_its_slot_at_its_first_instruction(tmp_path, slot, spawner, kill_keepers):
    # cat is the worker itself (exec'd, not forked), so what it prints is where exec left it.
    req = make_request(tmp_path, slot, ["cat", "/proc/self/cgroup"])
    kill_keepers.append(keeper_of(spawner.launch(req)))
    log = Path(req.log_dir) / "stdout.log"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and f"pids:/{slot.name}" not in (
        log.read_text() if log.exists() else ""
    ):
        time.sleep(0.02)
    text = log.read_text()
    for controller in ("cpuset", "memory", "pids", "freezer"):
        assert f":{controller}:/{slot.name}\n" in text


@pytest.mark.root
def test_unused_children_and_keepers_go_away_with_the_spawner():
    spawner = Spawner()
    spawner.start()
    try:
        idle = spawner.idle_children()
        keepers = [_identity(_parent(child.pid)) for child in idle]
    finally:
        spawner.close()
    for process in (*idle, *keepers):
        assert _wait_gone(process), f"pid {process.pid} is still there after close()"


@pytest.mark.root
def test_a_keeper_lost_before_the_launch_fails_it_cleanly(tmp_path, slot, spawner, kill_keepers):
    first = spawner.idle_children()[0]
    keeper_pid = _parent(first.pid)
    keeper = _identity(keeper_pid)
    os.kill(keeper_pid, signal.SIGKILL)  # a keeper this test's spawner started
    # kill() returns before the keeper has died: until then its pipe still takes the request.
    assert _wait_gone(keeper)
    with pytest.raises(WorkerError, match="hand the request to the keeper"):
        spawner.launch(make_request(tmp_path, slot, ["sleep", "60"]))
    assert _wait_gone(first)
    assert slot.pids() == []
    # The next idle keeper takes the next launch.
    result = spawner.launch(make_request(tmp_path, slot, ["sleep", "60"]))
    kill_keepers.append(keeper_of(result))
    assert slot.pids() == [result.pid]
    slot.kill_all(5.0)
