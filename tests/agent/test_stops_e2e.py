"""A graceful stop on the real kernel, through the agent: the worker is shown stopping at once, its
pre_stop request runs, a request under way finishes during the drain, the spec's stop signal
(SIGINT; the worker ignores SIGTERM) reaches it and the helper it forked, and nothing of its tree
is left. The daemon, its cgroup parent and clean-up are test_e2e's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent.test_e2e import REPO, Daemon, daemon, process_gone, wait_for_phase
from tests.daemon import wait_until
from tests.workerpy import worker_visible

pytestmark = [pytest.mark.root, pytest.mark.slow]

__all__ = ["daemon"]  # the fixture

WORKER = REPO / "tests" / "servers" / "drain_worker.py"


def worker_status(client: httpx.Client, name: str) -> dict[str, Any]:
    return client.get(f"/v1/slots/{name}").json()["worker"] or {}


def test_a_graceful_stop_drains_runs_pre_stop_and_signals_the_whole_slot(
    daemon: Daemon, worker_python: str
) -> None:
    client = daemon.start()
    request = {
        "name": "natest-drain",
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "128Mi"},
        "worker": {
            "command": [worker_python, worker_visible(WORKER), "--port", "{port:http}"],
            "ports": {"http": {}},
            "readiness": {"http": {"port": "http", "path": "/ready"}, "period_seconds": 0.2},
            "stop_signal": "SIGINT",
            "pre_stop": {"http": {"port": "http", "path": "/drain", "method": "POST"}},
            "drain_seconds": 1.0,
            "stop_grace_seconds": 10,
            "restart": "never",
        },
    }
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, created.text
    slot = wait_for_phase(client, "natest-drain", "running")
    daemon.remember(slot)
    port = slot["endpoints"][0]["port"]

    def logs() -> str:
        return "\n".join(client.get("/v1/slots/natest-drain/logs").json()["lines"])

    wait_until("the worker to serve", lambda: "serving on" in logs())

    answers: list[httpx.Response] = []
    url = f"http://127.0.0.1:{port}/slow"
    slow = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=30)))
    slow.start()
    wait_until("the slow request to be under way", lambda: "slow request started" in logs())

    stopping = client.delete("/v1/slots/natest-drain/worker")
    assert stopping.status_code == 200, stopping.text
    assert stopping.json()["worker"]["phase"] == "stopping"  # not ready from the first instant
    assert stopping.json()["state"] == "ready"

    wait_until("the worker to stop", lambda: worker_status(client, "natest-drain").get("phase") == "stopped")
    stopped = worker_status(client, "natest-drain")
    slow.join(30)
    assert answers, "the request under way got no answer"
    assert answers[0].status_code == 200
    assert answers[0].json() == {"drain_called": True}  # pre_stop ran while the request was served
    assert stopped["last_exit"]["code"] == 0, stopped  # SIGINT, not SIGKILL after the grace
    text = logs()
    assert "pre_stop /drain called" in text
    assert "SIGINT: finishing requests under way" in text
    helper_pid = int(text.split("helper ")[1].split()[0])
    assert "got SIGINT" in text  # the helper got the stop signal too
    assert process_gone(int(slot["worker"]["pid"]))
    assert process_gone(helper_pid)
    assert client.delete("/v1/slots/natest-drain").status_code == 204
    client.close()


def test_worker_script_is_world_readable() -> None:
    # A sandboxed worker runs as the slot's own uid: the script must be readable by anyone.
    assert Path(WORKER).stat().st_mode & 0o004
