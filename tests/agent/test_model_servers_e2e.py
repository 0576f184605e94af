"""Real model servers through the agent's REST API, sandboxed, on the real kernel: MLServer and
KServe's model server (from PyPI, CPU only, a tiny model built in tests/servers), each through its
preset:

- two slots of the same server, ready through the preset's model probe, on ports the agent
  assigned, each answering an inference;
- re-adopted after the agent is SIGKILLed (same pid, still answering);
- restarted after its main process is SIGKILLed, with nothing of the old tree left;
- a graceful stop drains (the worker is `stopping` at once and still answers during the drain,
  then exits on its stop signal, not by SIGKILL);
- release leaves no process, no listening port and no file of the slot's uid behind.

The daemon, its cgroup parent and the clean-up are test_e2e's (names carry "natest" and this pid).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.runtime.ports import in_use_on_host
from tests.agent.test_e2e import Daemon, clean_up, parent_dirs
from tests.daemon import wait_until
from tests.servers.fixtures import kserve_install, mlserver_install

pytestmark = [pytest.mark.root, pytest.mark.slow]

__all__ = ["kserve_install", "mlserver_install"]  # fixtures

FIRST = 20000 + (os.getpid() % 99) * 100
LAST = FIRST + 99
STARTUP = 240.0  # a cold Python server on a loaded 2-CPU box; typically a few seconds
BODY = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1.0, 2.5, -4.0]}]}


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    d = Daemon(tmp_path)
    text = d.config.read_text().replace("[workers]\n", f'[workers]\nport_range = "{FIRST}-{LAST}"\n')
    d.config.write_text(text)
    try:
        yield d
    finally:
        clean_up(d)
    assert not parent_dirs(), f"could not remove the test cgroups {sorted(map(str, parent_dirs()))}"


def mlserver_worker(base: Path) -> dict[str, Any]:
    return {
        "preset": "mlserver",
        "model_repository": str(base / "models"),
        "model_name": "doubler",
        "path": [str(base / "venv" / "bin")],
    }


def kserve_worker(base: Path) -> dict[str, Any]:
    return {
        "preset": "kserve",
        "command": [str(base / "venv" / "bin" / "python"), str(base / "model.py")],
        "model_name": "doubler",
    }


def slot_request(name: str, worker: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "qos": "burstable",
        "resources": {"cpus": 1, "memory": "1Gi"},
        "worker": {
            **worker,
            "startup_timeout_seconds": STARTUP,
            "drain_seconds": 2.0,
            "stop_grace_seconds": 15,
        },
    }


def worker_of(client: httpx.Client, name: str) -> dict[str, Any]:
    slot: dict[str, Any] = client.get(f"/v1/slots/{name}").json()
    return slot.get("worker") or {}


def running(client: httpx.Client, name: str, *, restarts: int = 0) -> dict[str, Any]:
    """The slot once its worker is running (after at least ``restarts`` restarts)."""

    def ready() -> dict[str, Any] | None:
        slot: dict[str, Any] = client.get(f"/v1/slots/{name}").json()
        worker = slot.get("worker") or {}
        assert worker.get("phase") not in ("failed", "crashloop"), f"{name}: {worker}"
        return slot if worker.get("phase") == "running" and worker.get("restarts", 0) >= restarts else None

    return wait_until(f"{name} to be running", ready, STARTUP)  # type: ignore[no-any-return]


def infer(slot: dict[str, Any]) -> list[float]:
    (http,) = [e for e in slot["endpoints"] if e["name"] == "http"]
    url = f"http://{http['address']}:{http['port']}/v2/models/doubler/infer"
    answer = httpx.post(url, json=BODY, timeout=30)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["outputs"][0]["data"])


def uid_of(pid: int) -> int:
    return Path(f"/proc/{pid}").stat().st_uid


def processes_of(uid: int) -> set[int]:
    """Every process running as ``uid`` (a slot's own: only its worker's tree has it)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and "State:\tZ" not in (entry / "status").read_text():
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def files_of(uid: int, state: Path) -> list[str]:
    """Files the slot's uid left in the host's shared places and in this agent's state directory.
    Other tests' trees under /tmp are theirs (a slot uid is reused by the next agent's slots)."""
    left = []
    for top in ("/tmp", "/var/tmp", "/dev/shm", str(state)):
        for root, dirs, files in os.walk(top):
            if root == "/tmp":
                dirs[:] = [d for d in dirs if not d.startswith("pytest-of-")]
            for name in dirs + files:
                path = os.path.join(root, name)
                try:
                    if os.lstat(path).st_uid == uid:
                        left.append(path)
                except OSError:
                    continue
    return left


SERVERS: dict[str, tuple[str, Callable[[Path], dict[str, Any]]]] = {
    "mlserver": ("mlserver_install", mlserver_worker),
    "kserve": ("kserve_install", kserve_worker),
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_real_model_server_through_the_agent(
    server: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    fixture, worker = SERVERS[server]
    install: Path = request.getfixturevalue(fixture)
    client = daemon.start()
    names = (f"natest-{server}-a", f"natest-{server}-b")
    for name in names:
        created = client.post("/v1/slots", json=slot_request(name, worker(install)))
        assert created.status_code == 201, created.text
    a, b = (running(client, name) for name in names)
    for slot in (a, b):
        daemon.remember(slot)
    ports = {e["name"]: e["port"] for e in a["endpoints"]}
    expected = {"http", "grpc", "metrics"} if server == "mlserver" else {"http", "grpc"}
    assert set(ports) == expected
    assert {e["port"] for e in a["endpoints"]}.isdisjoint(e["port"] for e in b["endpoints"])
    assert infer(a) == infer(b) == [2.0, 5.0, -8.0]
    uid = uid_of(int(a["worker"]["pid"]))
    assert uid == a["sandbox"]["uid"]

    # The agent is SIGKILLed: the workers run on and the next agent re-adopts them.
    daemon.kill()
    client.close()
    client = daemon.start()
    again = running(client, names[0])
    assert again["worker"]["pid"] == a["worker"]["pid"]
    assert infer(again) == [2.0, 5.0, -8.0]

    # The main process is SIGKILLed: nothing of its tree runs on, and the worker is restarted.
    old_tree = processes_of(uid)
    assert int(a["worker"]["pid"]) in old_tree
    os.kill(int(a["worker"]["pid"]), signal.SIGKILL)
    restarted = running(client, names[0], restarts=1)
    daemon.remember(restarted)
    assert restarted["worker"]["pid"] != a["worker"]["pid"]
    assert processes_of(uid).isdisjoint(old_tree), "a process of the killed worker's tree runs on"
    assert infer(restarted) == [2.0, 5.0, -8.0]
    assert {e["port"] for e in restarted["endpoints"]} == {e["port"] for e in a["endpoints"]}

    # A graceful stop: shown stopping at once, still serving during the drain, then its signal.
    stopping = client.delete(f"/v1/slots/{names[1]}/worker")
    assert stopping.status_code == 200, stopping.text
    assert stopping.json()["worker"]["phase"] == "stopping"
    assert infer(b) == [2.0, 5.0, -8.0]  # drain_seconds: requests still answered
    wait_until(f"{names[1]} to stop", lambda: worker_of(client, names[1]).get("phase") == "stopped", 60)
    last_exit = worker_of(client, names[1])["last_exit"]
    assert last_exit["signal"] != signal.SIGKILL, f"it had to be killed: {last_exit}"

    # Release: no process, no listening port, no file of the slots' uids left.
    uids = {uid, b["sandbox"]["uid"]}
    for name in names:
        assert client.delete(f"/v1/slots/{name}").status_code == 204
    for slot_uid in uids:
        wait_until(f"uid {slot_uid}'s processes to end", lambda u=slot_uid: not processes_of(u), 30)
        assert files_of(slot_uid, daemon.state) == []
    for slot in (a, b):
        for endpoint in slot["endpoints"]:
            assert not in_use_on_host(endpoint["port"]), f"port {endpoint['port']} still listened on"
        assert not (daemon.state / "workers" / slot["id"]).exists()
    client.close()

