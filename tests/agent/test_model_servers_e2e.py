"""Real model servers through the agent's REST API, sandboxed, on the real kernel: MLServer (with a
parallel worker process, from its repository's settings.json) and KServe's model server (a model.py
as KServe's examples write one), from PyPI, CPU only, a tiny model built in tests/servers, each
through its preset as docs/model-servers.md shows it, put through tests/servers/lifecycle.py's
checks:

- two slots of the same server, ready through the preset's model probe, on ports the agent
  assigned, each answering an inference;
- re-adopted after the agent is SIGKILLed (same pid, still answering);
- restarted after its main process is SIGKILLed, with nothing of the old tree left;
- a graceful stop drains (the worker is `stopping` at once and still answers during the drain,
  then exits on its stop signal, not by SIGKILL);
- release leaves no process, no listening port and no file of the slot's uid behind.

The heavier servers (Triton, TorchServe, the SageMaker contract) get the same checks by hand:
bench/validate_servers.py. The daemon, its cgroup parent and the clean-up are test_e2e's (names
carry "natest" and this pid).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.agent.test_e2e import Daemon
from tests.daemon import wait_until
from tests.servers.fixtures import kserve_case, kserve_install, mlserver_case, mlserver_install
from tests.servers.lifecycle import STARTUP, Case, Lifecycle, remove_daemon, server_daemon, slot_request

pytestmark = [pytest.mark.root, pytest.mark.slow]

__all__ = ["kserve_install", "mlserver_install"]  # fixtures


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = server_daemon(tmp_path)
    try:
        yield d
    finally:
        remove_daemon(d)


SERVERS: dict[str, tuple[str, Callable[[Path], Case]]] = {
    "mlserver": ("mlserver_install", mlserver_case),
    "kserve": ("kserve_install", kserve_case),
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_real_model_server_through_the_agent(
    server: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    fixture, case = SERVERS[server]
    install: Path = request.getfixturevalue(fixture)
    Lifecycle(daemon, case(install)).run()


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_real_model_server_from_a_warm_pool(
    server: str, daemon: Daemon, request: pytest.FixtureRequest
) -> None:
    """A pool of one standby of the server (docs/pools.md): claimed onto an exclusive core, it
    answers an inference at once; the pool starts a new standby; the claimed slot's release
    leaves it to no one."""
    fixture, case_of = SERVERS[server]
    case = case_of(request.getfixturevalue(fixture))
    client = daemon.start()
    body = slot_request("unused", case)
    spec = {
        "name": server,
        "size": 1,
        "slot": {**body, "qos": "guaranteed", "resources": {"cpus": 1, "memory": "1Gi"}},
    }
    del spec["slot"]["name"]
    created = client.post("/v1/pools", json=spec)
    assert created.status_code == 201, created.text
    ready = wait_until(
        f"a frozen {server} standby",
        lambda: (pool := client.get(f"/v1/pools/{server}").json())["ready"] == 1 and pool,
        STARTUP,
    )
    assert ready["problem"] is None
    began = time.monotonic()
    claimed = client.post("/v1/slots", json={"name": f"{server}-a", "pool": server})
    assert claimed.status_code == 201, claimed.text
    slot = claimed.json()
    daemon.remember(slot)
    assert case.infer(slot) == case.expected
    took = time.monotonic() - began
    print(f"{server}: allocate from the pool to the first inference answered: {took * 1000:.0f} ms")
    assert slot["assignment"]["exclusive"]
    assert slot["state"] == "running"
    wait_until(
        f"the {server} pool refilled",
        lambda: client.get(f"/v1/pools/{server}").json()["ready"] == 1,
        STARTUP,
    )
    assert client.delete(f"/v1/slots/{server}-a").status_code == 204
    assert client.delete(f"/v1/pools/{server}").status_code == 204
