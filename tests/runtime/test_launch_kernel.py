"""Launching into a real cgroup v1 slot through the host keeper; checked from /proc."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.logs import read_log
from tests.runtime.conftest import current_keeper, make_request, wait_for_exit, wait_until
from tests.runtime.slotcg import V1Slot

pytestmark = pytest.mark.root


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def test_worker_runs_inside_its_slot(tmp_path, slot: V1Slot, keeper: KeeperClient, kill_workers):
    req = make_request(
        tmp_path, slot, ["sleep", "60"], cpus=(0,), uid=65534, gid=65534, groups=(), umask=0o077, cwd="/tmp"
    )
    result = keeper.launch(req)
    kill_workers.append(result.identity)

    cgroups = Path(f"/proc/{result.pid}/cgroup").read_text()
    for controller in ("cpuset", "memory", "pids", "freezer"):
        assert f":{controller}:/{slot.name}\n" in cgroups
    status = proc_status(result.pid)
    assert status["Cpus_allowed_list"] == "0"
    assert status["Uid"].split() == ["65534"] * 4
    assert status["Gid"].split() == ["65534"] * 4
    assert status["Groups"] == ""
    assert status["NoNewPrivs"] == "1"
    assert status["Umask"] == "0077"
    environ = Path(f"/proc/{result.pid}/environ").read_bytes().split(b"\0")
    assert b"NATEST=1" in environ
    assert Path(f"/proc/{result.pid}/cwd").readlink() == Path("/tmp")
    # The host keeper is the worker's parent and stays outside the slot.
    host_keeper = current_keeper(tmp_path / "keeper")
    assert result.state.keeper == host_keeper
    assert int(status["PPid"]) == host_keeper.pid
    assert host_keeper.pid not in slot.pids()
    assert slot.pids() == [result.pid]

    slot.kill_all(5.0)
    record = wait_for_exit(Path(req.run_dir))
    assert (record.signal, record.reason) == (9, "signaled")


def test_exit_status_and_output_are_recorded_in_time_order(tmp_path, slot, keeper, kill_workers):
    script = "echo first; sleep 0.1; echo second >&2; sleep 0.1; echo third; exit 7"
    req = make_request(tmp_path, slot, ["sh", "-c", script])
    kill_workers.append(keeper.launch(req).identity)

    record = wait_for_exit(Path(req.run_dir))
    assert (record.code, record.signal, record.reason) == (7, None, "exited")
    lines = wait_until(
        "three lines of output",
        lambda: len(read_log(Path(req.log_dir), 5)) == 3 and read_log(Path(req.log_dir), 5),
    )
    assert [(line.stream, line.text) for line in lines] == [
        ("stdout", "first"),
        ("stderr", "second"),
        ("stdout", "third"),
    ]
    assert [line.render() for line in lines] == ["first", "[stderr] second", "third"]


@pytest.mark.parametrize(
    ("argv", "extra", "step"),
    [
        pytest.param(["/nonexistent/worker"], {}, "exec /nonexistent/worker", id="missing-program"),
        pytest.param(["true"], {"cwd": "/nonexistent"}, "chdir /nonexistent", id="missing-workdir"),
        pytest.param(["true"], {"netns": "/nonexistent/netns"}, "enter netns", id="missing-netns"),
    ],
)
def test_failed_launch_names_the_step(tmp_path, slot, keeper, *, argv, extra, step):
    with pytest.raises(WorkerError, match=step):
        keeper.launch(make_request(tmp_path, slot, argv, **extra))
    assert slot.pids() == []


def test_oom_kill_is_reported_as_such(tmp_path, keeper, kill_workers):
    oom_slot = V1Slot(memory_bytes=48 * 1024 * 1024)
    try:
        hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))"
        req = make_request(tmp_path, oom_slot, [sys.executable, "-c", hog])
        kill_workers.append(keeper.launch(req).identity)
        record = wait_for_exit(Path(req.run_dir), timeout=30)
        assert (record.signal, record.oom_killed, record.reason) == (9, True, "oom-killed")
        assert oom_slot.oom_kill_count() >= 1
    finally:
        oom_slot.remove()


def test_thread_and_slot_environment_reach_the_worker(tmp_path, slot, keeper, kill_workers):
    req = make_request(tmp_path, slot, ["sleep", "60"], env={"OMP_NUM_THREADS": "3", "PATH": "/bin:/usr/bin"})
    result = keeper.launch(req)
    kill_workers.append(result.identity)
    environ = dict(
        entry.split("=", 1) for entry in Path(f"/proc/{result.pid}/environ").read_text().split("\0") if entry
    )
    assert environ == {"OMP_NUM_THREADS": "3", "PATH": "/bin:/usr/bin"}
    slot.kill_all(5.0)
