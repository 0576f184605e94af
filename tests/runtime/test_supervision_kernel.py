"""Supervision and re-adoption with real processes in a real cgroup v1 slot, through a real keeper."""

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

from nodeagent.runtime.adopt import adopt, resume_supervision
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.process import (
    ProcessIdentity,
    WorkerState,
    process_start_time,
    read_state,
    write_state,
)
from nodeagent.runtime.supervisor import Backoff, Phase, Supervisor
from nodeagent.schema.worker import HttpCheck, Probe, RestartPolicy, WorkerSpec
from tests.runtime.conftest import current_keeper, make_request, wait_gone

pytestmark = pytest.mark.root


def drive(sup: Supervisor, until, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = sup.tick()
        if until(status):
            return status
        time.sleep(0.02)
    raise AssertionError(f"supervisor stuck in {sup.status()}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_crashing_worker_is_restarted_with_growing_backoff(tmp_path, slot, keeper):
    spec = WorkerSpec(command=("sh", "-c", "exit 3"), restart=RestartPolicy.ON_FAILURE)
    backoff = Backoff(initial_seconds=0.05, factor=2.0, crashloop_after=3)
    sup = Supervisor(
        spec,
        make_request(tmp_path, slot, list(spec.command)),
        keeper,
        slot,
        backoff=backoff,
    )
    sup.start()
    scheduled = []
    for _ in range(4):
        status = drive(
            sup, lambda s: s.phase in (Phase.BACKOFF, Phase.CRASHLOOP) and s.restarts > len(scheduled)
        )
        scheduled.append((status.phase, status.message.rsplit(" in ", 1)[1]))
        assert status.last_exit is not None
        assert status.last_exit.code == 3
    sup.stop()
    assert scheduled == [
        (Phase.BACKOFF, "0.05s"),
        (Phase.BACKOFF, "0.1s"),
        (Phase.CRASHLOOP, "0.2s"),
        (Phase.CRASHLOOP, "0.4s"),
    ]


def test_hung_worker_is_killed_by_its_liveness_probe(tmp_path, slot, keeper):
    port = free_port()
    # Accepts connections but never answers, and ignores SIGTERM: only the slot kill can end it.
    hung = (
        "import signal, socket, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(16)\n"
        "time.sleep(600)\n"
    )
    liveness = Probe(
        http=HttpCheck(port=port, path="/v2/health/live"),
        period_seconds=0.2,
        timeout_seconds=0.2,
        failure_threshold=2,
        initial_delay_seconds=0.3,
    )
    spec = WorkerSpec(
        command=(sys.executable, "-c", hung),
        liveness=liveness,
        stop_grace_seconds=0.5,
        restart=RestartPolicy.NEVER,
    )
    sup = Supervisor(spec, make_request(tmp_path, slot, list(spec.command)), keeper, slot)
    sup.start()
    status = drive(sup, lambda s: s.phase is Phase.FAILED)
    assert status.last_exit is not None
    assert status.last_exit.signal == signal.SIGKILL
    assert "liveness probe failed" in status.message
    assert slot.pids() == []


AGENT = """
import json, sys, time
from pathlib import Path
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.launch_request import LaunchRequest
worker = KeeperClient(Path(sys.argv[2])).launch(LaunchRequest.from_json(json.loads(sys.argv[1])))
print(json.dumps({"pid": worker.pid, "start_time": worker.identity.start_time}), flush=True)
time.sleep(600)
"""


def run_agent_and_sigkill_it(request_json: str, keeper_dir: Path) -> dict[str, int]:
    """An agent of its own launches the worker through the keeper of ``keeper_dir``, then dies."""
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, request_json, str(keeper_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdout is not None
        launched = json.loads(agent.stdout.readline())
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()
    return launched


def test_worker_survives_agent_sigkill_and_is_readopted(tmp_path, slot, keeper: KeeperClient):
    req = make_request(tmp_path, slot, ["sleep", "60"])
    launched = run_agent_and_sigkill_it(json.dumps(req.to_json()), tmp_path / "keeper")
    time.sleep(0.2)

    # Untouched: same process, still in its slot, still the keeper's child.
    assert process_start_time(launched["pid"]) == launched["start_time"]
    assert slot.pids() == [launched["pid"]]
    status = Path(f"/proc/{launched['pid']}/status").read_text()
    assert f"PPid:\t{current_keeper(tmp_path / 'keeper').pid}\n" in status
    found = adopt(Path(req.run_dir), keeper)
    assert found.process is not None
    assert found.process.identity == ProcessIdentity(launched["pid"], launched["start_time"])

    spec = WorkerSpec(command=req.argv, stop_grace_seconds=5, restart=RestartPolicy.ALWAYS)
    sup = Supervisor(spec, req, launcher=None, cgroup=slot)  # type: ignore[arg-type]
    sup.resume(found.process)
    assert sup.tick().phase is Phase.RUNNING or sup.status().phase is Phase.STARTING
    sup.stop()
    status = drive(sup, lambda s: s.phase is Phase.STOPPED)
    assert status.last_exit is not None
    assert status.last_exit.signal == signal.SIGTERM  # the keeper recorded it, the agent read it


def test_exit_while_agent_is_down_is_recorded_and_handled_by_policy(tmp_path, slot, keeper: KeeperClient):
    req = make_request(tmp_path, slot, ["sh", "-c", "sleep 0.3; exit 5"])
    launched = run_agent_and_sigkill_it(json.dumps(req.to_json()), tmp_path / "keeper")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process_start_time(launched["pid"]) is not None:
        time.sleep(0.05)
    time.sleep(0.2)

    spec = WorkerSpec(command=req.argv, restart=RestartPolicy.NEVER)
    sup = Supervisor(spec, req, launcher=None, cgroup=slot)  # type: ignore[arg-type]
    found = resume_supervision(sup, Path(req.run_dir), keeper)
    assert found.exit is not None
    assert (found.exit.code, found.exit.reason) == (5, "exited")
    assert sup.status().phase is Phase.FAILED


def _occupy_pid(target: int, attempts: int = 200) -> subprocess.Popen[bytes] | None:
    """Start a process that gets exactly ``target`` as its pid (a recycled pid), via ns_last_pid."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(attempts):
        last_pid.write_text(str(target - 1))
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == target:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_recycled_pid_is_never_adopted(tmp_path, slot, keeper: KeeperClient):
    req = make_request(tmp_path, slot, ["sleep", "60"])
    result = keeper.launch(req)
    result.close()
    time.sleep(0.1)
    recorded = read_state(Path(req.run_dir))
    assert recorded is not None
    # The worker and its keeper vanish without a word (as in a crash of the whole box's userland),
    # and the state file still names the worker as alive.
    host_keeper = current_keeper(tmp_path / "keeper")
    os.kill(host_keeper.pid, signal.SIGKILL)
    assert wait_gone(host_keeper)
    slot.kill_all(5.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{result.pid}").exists():
        time.sleep(0.02)  # until init has reaped the orphan and the pid is free again
    write_state(
        Path(req.run_dir),
        WorkerState(
            recorded.launch_id, recorded.worker, recorded.keeper, recorded.started_at, None, recorded.custody
        ),
    )

    stranger = _occupy_pid(result.pid)
    if stranger is None:
        pytest.skip(f"could not get pid {result.pid} back from the kernel (a busy host)")
    try:
        found = adopt(Path(req.run_dir), keeper)  # the keeper the client starts finds a stranger there
        assert found.process is None
        assert found.exit is not None
        assert found.exit.reason == "lost"
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()
