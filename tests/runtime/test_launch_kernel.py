"""Launching into a real cgroup v1 slot through the spawner and keeper; checked from /proc."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime.logs import tail
from nodeagent.runtime.process import ExitRecord, read_state
from nodeagent.runtime.spawner import Spawner
from tests.runtime.conftest import keeper_of, make_request
from tests.runtime.slotcg import V1Slot

pytestmark = pytest.mark.root


def wait_for_exit(run_dir: Path, timeout: float = 10.0) -> ExitRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state is not None and state.exit is not None:
            return state.exit
        time.sleep(0.02)
    raise AssertionError(f"no exit recorded in {run_dir} within {timeout}s")


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def test_worker_runs_inside_its_slot(tmp_path, slot: V1Slot, spawner: Spawner, kill_keepers):
    req = make_request(
        tmp_path, slot, ["sleep", "60"], cpus=(0,), uid=65534, gid=65534, groups=(), umask=0o077, cwd="/tmp"
    )
    result = spawner.launch(req)
    kill_keepers.append(keeper_of(result))

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
    # The keeper is the worker's parent and stays outside the slot.
    assert int(status["PPid"]) == result.keeper_pid
    assert result.keeper_pid not in slot.pids()
    assert slot.pids() == [result.pid]

    slot.kill_all(5.0)
    record = wait_for_exit(Path(req.run_dir))
    assert (record.signal, record.reason) == (9, "signaled")


def test_exit_status_and_output_are_recorded(tmp_path, slot, spawner, kill_keepers):
    req = make_request(tmp_path, slot, ["sh", "-c", "echo to-out; echo to-err >&2; exit 7"])
    kill_keepers.append(keeper_of(spawner.launch(req)))

    record = wait_for_exit(Path(req.run_dir))
    assert (record.code, record.signal, record.reason) == (7, None, "exited")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (Path(req.log_dir) / "stderr.log").stat().st_size:
        time.sleep(0.02)
    assert tail(Path(req.log_dir), "stdout", 5) == ["to-out"]
    assert tail(Path(req.log_dir), "stderr", 5) == ["to-err"]


@pytest.mark.parametrize(
    ("argv", "extra", "step"),
    [
        pytest.param(["/nonexistent/worker"], {}, "exec /nonexistent/worker", id="missing-program"),
        pytest.param(["true"], {"cwd": "/nonexistent"}, "chdir /nonexistent", id="missing-workdir"),
        pytest.param(["true"], {"netns": "/nonexistent/netns"}, "enter netns", id="missing-netns"),
    ],
)
def test_failed_launch_names_the_step(tmp_path, slot, spawner, *, argv, extra, step):
    with pytest.raises(WorkerError, match=step):
        spawner.launch(make_request(tmp_path, slot, argv, **extra))
    assert slot.pids() == []


def test_oom_kill_is_reported_as_such(tmp_path, spawner, kill_keepers):
    oom_slot = V1Slot(memory_bytes=48 * 1024 * 1024)
    try:
        hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))"
        req = make_request(tmp_path, oom_slot, [sys.executable, "-c", hog])
        kill_keepers.append(keeper_of(spawner.launch(req)))
        record = wait_for_exit(Path(req.run_dir), timeout=30)
        assert (record.signal, record.oom_killed, record.reason) == (9, True, "oom-killed")
        assert oom_slot.oom_kill_count() >= 1
    finally:
        oom_slot.remove()


def test_thread_and_slot_environment_reach_the_worker(tmp_path, slot, spawner, kill_keepers):
    req = make_request(tmp_path, slot, ["sleep", "60"], env={"OMP_NUM_THREADS": "3", "PATH": "/bin:/usr/bin"})
    result = spawner.launch(req)
    kill_keepers.append(keeper_of(result))
    environ = dict(
        entry.split("=", 1) for entry in Path(f"/proc/{result.pid}/environ").read_text().split("\0") if entry
    )
    assert environ == {"OMP_NUM_THREADS": "3", "PATH": "/bin:/usr/bin"}
    slot.kill_all(5.0)
