"""Ports end to end on the real kernel: two slots of the same server (the example inference worker,
sandboxed) on ports the agent assigns, told through ``{port:http}`` and probed by the port's name;
their endpoints through REST and ``slots show``; a port another slot holds refused with nothing
created; the same endpoints after the agent is SIGKILLed and restarted; and on release the worker
gone and the port free again.

The daemon, its cgroup parent and the clean-up are test_e2e's (names carry "natest" and this pid).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.runtime.ports import in_use_on_host
from tests.agent.test_e2e import (
    MODEL,
    REPO,
    Daemon,
    proc_environ,
    process_gone,
    wait_for_phase,
)
from tests.daemon import wait_until
from tests.servers.lifecycle import first_port, remove_daemon, server_daemon
from tests.workerpy import worker_visible

pytestmark = [pytest.mark.root, pytest.mark.slow]

#: A range of this run's own (20000-29999 is the default range): 100 ports from a base by pid.
FIRST = first_port()
LAST = FIRST + 99


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = server_daemon(tmp_path)
    try:
        yield d
    finally:
        remove_daemon(d)


def request(name: str, python: str, **port: Any) -> dict[str, Any]:
    return {
        "name": name,
        # Burstable: this leaves exclusive CPUs to other tests on a small host.
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "256Mi"},
        "worker": {
            "command": [python, worker_visible(REPO / "examples" / "oip_worker.py"), "--port", "{port:http}"],
            "ports": {"http": port},
            "readiness": {
                "http": {"port": "http", "path": f"/v2/models/{MODEL}/ready"},
                "period_seconds": 0.2,
            },
            "stop_grace_seconds": 10,
        },
    }


def http_endpoint(slot: dict[str, Any]) -> tuple[str, int]:
    (endpoint,) = [e for e in slot["endpoints"] if e["name"] == "http"]
    assert endpoint["protocol"] == "http"
    return endpoint["address"], int(endpoint["port"])


def infer(address: str, port: int) -> list[float]:
    body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    answer = httpx.post(f"http://{address}:{port}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["outputs"][0]["data"])


def test_two_slots_of_one_server_on_assigned_ports(daemon: Daemon, worker_python: str) -> None:
    client = daemon.start()
    for name in ("natest-a", "natest-b"):
        created = client.post("/v1/slots", json=request(name, worker_python))
        assert created.status_code == 201, created.text
    a = wait_for_phase(client, "natest-a", "running")
    b = wait_for_phase(client, "natest-b", "running")
    daemon.remember(a)
    daemon.remember(b)
    a_at, b_at = http_endpoint(a), http_endpoint(b)
    assert a_at[1] != b_at[1]
    assert FIRST <= a_at[1] <= LAST
    assert FIRST <= b_at[1] <= LAST
    assert infer(*a_at) == infer(*b_at)  # the same model answers on each slot's own port
    assert proc_environ(int(a["worker"]["pid"]))["NODEAGENT_PORT_HTTP"] == str(a_at[1])
    assert f"endpoint  http  {a_at[0]}:{a_at[1]} (http)" in daemon.cli("show", "natest-a")

    # A port another slot holds: refused, naming the holder, and nothing is left of the attempt.
    refused = client.post("/v1/slots", json=request("natest-c", worker_python, port=a_at[1]))
    assert refused.status_code == 409, refused.text
    assert "held by slot 'natest-a'" in refused.json()["error"]["message"]
    assert sorted(s["name"] for s in client.get("/v1/slots").json()["slots"]) == ["natest-a", "natest-b"]

    # The agent dies and comes back: the workers ran on, and their endpoints are the same.
    daemon.kill()
    client.close()
    client = daemon.start()
    again = wait_for_phase(client, "natest-a", "running")
    assert again["worker"]["pid"] == a["worker"]["pid"]
    assert http_endpoint(again) == a_at
    assert http_endpoint(client.get("/v1/slots/natest-b").json()) == b_at
    infer(*a_at)

    # Release: the worker is gone and its port is free again (for the host and for the next slot).
    assert client.delete("/v1/slots/natest-a").status_code == 204
    wait_until("natest-a's worker to end", lambda: process_gone(int(a["worker"]["pid"])), timeout=30)
    assert not in_use_on_host(a_at[1])
    created = client.post("/v1/slots", json=request("natest-c", worker_python, port=a_at[1]))
    assert created.status_code == 201, created.text
    c = wait_for_phase(client, "natest-c", "running")
    daemon.remember(c)
    assert http_endpoint(c)[1] == a_at[1]
    for name in ("natest-b", "natest-c"):
        assert client.delete(f"/v1/slots/{name}").status_code == 204
    for slot in (b, c):
        wait_until("the worker to end", lambda s=slot: process_gone(int(s["worker"]["pid"])), timeout=30)
    assert not in_use_on_host(b_at[1])
    client.close()
