"""The pre-forked worker children: idle outside any slot, never running user code early, taken in
order, cleaned up when unused, and joined to the slot before the worker's first instruction."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from nodeagent.runtime.enter import join_cgroups, join_file
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.logs import read_log
from nodeagent.runtime.process import ProcessIdentity, process_start_time
from tests.runtime.conftest import current_keeper, make_request, stop_test_keeper, wait_gone, wait_until
from tests.runtime.slotcg import V1Slot


def _parent(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def _identity(pid: int) -> ProcessIdentity:
    start_time = process_start_time(pid)
    assert start_time is not None
    return ProcessIdentity(pid, start_time)


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
def test_idle_children_wait_outside_any_slot_without_running_user_code(tmp_path, keeper: KeeperClient):
    idle = keeper.idle_children()
    assert len(idle) == 2
    host_keeper = current_keeper(tmp_path / "keeper")
    for child in idle:
        assert _parent(child.pid) == host_keeper.pid
        # Still the interpreter it was forked from: nothing was exec'd.
        assert Path(f"/proc/{child.pid}/exe").resolve() == Path(f"/proc/{host_keeper.pid}/exe").resolve()
        assert (
            Path(f"/proc/{child.pid}/cgroup").read_text()
            == Path(f"/proc/{host_keeper.pid}/cgroup").read_text()
        )
        # stdio and its three pipes, nothing inherited from the agent or the keeper (once it has
        # prepared itself, which it does after the keeper handed it over).
        fds = f"/proc/{child.pid}/fd"
        wait_until(f"child {child.pid} to close what it inherited", lambda fds=fds: len(os.listdir(fds)) == 6)


@pytest.mark.root
def test_launch_takes_the_first_idle_child(tmp_path, slot, keeper, kill_workers):
    first = keeper.idle_children()[0]
    result = keeper.launch(make_request(tmp_path, slot, ["sleep", "60"]))
    kill_workers.append(result.identity)
    assert result.identity == first
    assert _parent(result.pid) == current_keeper(tmp_path / "keeper").pid
    slot.kill_all(5.0)


@pytest.mark.root
def test_worker_is_in_its_slot_at_its_first_instruction(tmp_path, slot, keeper, kill_workers):
    # cat is the worker itself (exec'd, not forked), so what it prints is where exec left it.
    req = make_request(tmp_path, slot, ["cat", "/proc/self/cgroup"])
    kill_workers.append(keeper.launch(req).identity)
    log = Path(req.log_dir) / "worker.log"
    wait_until("the worker's output", lambda: log.exists() and f"pids:/{slot.name}" in log.read_text())
    text = "".join(line.text + "\n" for line in read_log(Path(req.log_dir), 50))
    for controller in ("cpuset", "memory", "pids", "freezer"):
        assert f":{controller}:/{slot.name}\n" in text


@pytest.mark.root
@pytest.mark.parametrize("adj", [-997, 1000], ids=["guaranteed", "best-effort"])
def test_worker_takes_its_slots_oom_score_adj_not_the_keepers(tmp_path, slot, keeper, kill_workers, adj):
    """The keeper runs with the agent unit's strong protection (-900 under systemd); a worker gets its
    slot's value instead, lower (needs root, so before the identity switch) or higher."""
    req = make_request(
        tmp_path, slot, ["cat", "/proc/self/oom_score_adj"], oom_score_adj=adj, uid=65534, gid=65534
    )
    kill_workers.append(keeper.launch(req).identity)
    log = Path(req.log_dir) / "worker.log"
    wait_until("the worker's output", lambda: log.exists() and log.read_text().strip() != "")
    inherited = int(Path("/proc/self/oom_score_adj").read_text())  # the keeper's, as the test's
    # Lowering needs CAP_SYS_RESOURCE (some hosts withhold it from root): then the worker keeps
    # the inherited value rather than fail; raising always works.
    may_lower = bool(int(_cap_eff(), 16) >> CAP_SYS_RESOURCE & 1)
    expected = adj if adj >= inherited or may_lower else inherited
    assert [line.text for line in read_log(Path(req.log_dir), 5)] == [str(expected)]


CAP_SYS_RESOURCE = 24


def _cap_eff() -> str:
    status = Path("/proc/self/status").read_text()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff:"))


@pytest.mark.root
def test_unused_children_go_away_with_the_client_and_the_keeper_stays(tmp_path):
    client = KeeperClient(tmp_path / "keeper")
    try:
        idle = client.idle_children()
        host_keeper = current_keeper(tmp_path / "keeper")
    finally:
        client.close()
    try:
        for process in idle:
            assert wait_gone(process), f"pid {process.pid} is still there after close()"
        assert process_start_time(host_keeper.pid) == host_keeper.start_time
    finally:
        stop_test_keeper(tmp_path / "keeper")
    assert wait_gone(host_keeper)


@pytest.mark.root
def test_a_keeper_lost_before_the_launch_is_replaced_and_the_launch_goes_through(
    tmp_path, slot, keeper, kill_workers
):
    idle = keeper.idle_children()
    old = current_keeper(tmp_path / "keeper")
    os.kill(old.pid, signal.SIGKILL)  # the keeper this test started
    assert wait_gone(old)
    result = keeper.launch(make_request(tmp_path, slot, ["sleep", "60"]))
    kill_workers.append(result.identity)
    new = current_keeper(tmp_path / "keeper")
    assert new != old
    assert _parent(result.pid) == new.pid
    assert slot.pids() == [result.pid]
    # The children the dead keeper had armed were dropped, and exited: none ran anything.
    for child in idle:
        assert wait_gone(child)
    slot.kill_all(5.0)
