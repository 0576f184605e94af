"""Worker logs through the agent on the real kernel: `nodeagent slots logs --follow --json` prints
new lines of both streams as they come (JSON lines, in time order, none twice), and a released
slot's logs stay readable by its name. The daemon, its cgroup parent and clean-up are test_e2e's."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any

import pytest

from tests.agent.test_e2e import Daemon, daemon, wait_for_phase
from tests.daemon import nodeagent_argv, wait_until

pytestmark = [pytest.mark.root, pytest.mark.slow]

__all__ = ["daemon"]  # the fixture

TICKER = 'i=0; while true; do echo "tick $i"; echo "err $i" >&2; i=$((i+1)); sleep 0.1; done'


def test_follow_json_and_logs_after_release(daemon: Daemon) -> None:
    client = daemon.start()
    request = {
        "name": "natest-logs",
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "64Mi"},
        "worker": {"command": ["/bin/sh", "-c", TICKER], "stop_grace_seconds": 2},
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    slot = wait_for_phase(client, "natest-logs", "running")
    daemon.remember(slot)

    def lines_so_far() -> int:
        answer = client.get("/v1/slots/natest-logs/logs")
        assert answer.status_code == 200, f"logs of a running worker: {answer.status_code} {answer.text}"
        return len(answer.json()["lines"])

    wait_until("some output", lambda: lines_so_far() >= 4)

    argv = [*nodeagent_argv(), "slots", "--api", daemon.url, "--token-file", str(daemon.token_file)]
    follower = subprocess.Popen(
        [*argv, "logs", "natest-logs", "--follow", "--json", "--lines", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    entries: list[dict[str, Any]] = []
    try:
        assert follower.stdout is not None
        while len(entries) < 30:
            line = follower.stdout.readline()
            assert line, f"the follower ended early ({follower.poll()})"
            entries.append(json.loads(line))
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(timeout=30)
        if follower.stdout is not None:
            follower.stdout.close()
    assert follower.returncode == 0
    assert {e["stream"] for e in entries} == {"stdout", "stderr"}
    assert [e["time"] for e in entries] == sorted(e["time"] for e in entries)
    keys = [(e["time"], e["stream"], e["text"]) for e in entries]
    assert len(keys) == len(set(keys)), "a line was printed twice"
    ticks = [int(e["text"].split()[1]) for e in entries if e["stream"] == "stdout"]
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), "a line was skipped"

    # A follower started now ends by itself at the release, with the worker's last lines printed.
    follower = subprocess.Popen(
        [*argv, "logs", "natest-logs", "--follow", "--lines", "1"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline()  # it follows
        assert client.delete("/v1/slots/natest-logs").status_code == 204
        follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=10)
    assert follower.returncode == 0
    kept = daemon.cli("logs", "natest-logs", "--lines", "5")
    assert "tick" in kept
    released = client.get("/v1/slots/natest-logs/logs", params={"lines": 3}).json()
    assert released["id"] == slot["id"]
    assert len(released["entries"]) == 3
    # --follow on a released slot prints what was kept and ends.
    done = subprocess.run(
        [*argv, "logs", "natest-logs", "--follow", "--lines", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
    client.close()


def test_a_slot_whose_worker_never_launched_keeps_the_agents_word_after_release(daemon: Daemon) -> None:
    client = daemon.start()
    request = {
        "name": "natest-never",
        "qos": "burstable",
        "resources": {"cpus": 0.1, "memory": "32Mi"},
        "worker": {"command": ["/bin/true"], "workdir": "/nonexistent-natest"},
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    wait_until(
        "the launch to fail",
        lambda: (client.get("/v1/slots/natest-never").json()["worker"] or {}).get("phase") == "failed",
    )
    assert client.delete("/v1/slots/natest-never").status_code == 204
    kept = client.get("/v1/slots/natest-never/logs")
    assert kept.status_code == 200, kept.text
    (line,) = kept.json()["lines"]
    assert line.startswith("[agent] worker failed: launch failed")
    client.close()
