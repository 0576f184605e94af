"""Slot against slot and slot against host over what a shared network namespace leaves open.

Two default (sandboxed) slots without a network of their own, through the real SlotManager,
kernel isolation and host keeper: the ``listener`` slot's worker binds an abstract unix socket,
the test (the host) binds another; the ``prober`` slot's worker tries to connect to both, and to
an abstract socket of its own. Landlock's scope (runtime/sandbox/landlock.py) refuses the first
two and allows the last; the same script run by the test outside every slot connects to all
three, so a refusal means something.

A real ``nodeagent serve`` then runs a slot whose worker connects to the agent's TCP API and to a
host service on another loopback port: the API is out of reach (isolation/api_guard.py) and the
other port is not; with ``[api] slots_may_connect = true`` both connect, and a clean stop leaves
no rule behind. With ``[isolation] local_default_deny`` a host service on 127.0.0.1 and another
slot's port are out of reach while a port in ``local_open_ports`` is not; the host itself still
reaches both. Every socket, process and rule is the test's own and removed by it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from nodeagent.agent.config import AgentConfig, apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation, build_manager
from nodeagent.agent.manager import SlotManager
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.errors import NotFound
from nodeagent.isolation.api_guard import ApiGuard, table_name
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.isolation.firewall import LibNftables
from nodeagent.runtime.sandbox import landlock
from nodeagent.schema.request import parse_slot_request
from tests.daemon import HOST_OFF, DaemonProcess, wait_until
from tests.escape.harness import VICTIM, config_for, free_port, tear_down
from tests.workerpy import world_python

pytestmark = [pytest.mark.root, pytest.mark.slow]

TAG = f"natest{os.getpid()}"
HOST_NAME = f"{TAG}-host"
VICTIM_NAME = f"{TAG}-victim"
LISTENER = """
import socket, sys, time
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind("\\0" + sys.argv[1])
server.listen(8)
print("listening", flush=True)
while True:
    server.accept()[0].close()
"""
PROBER = """
import json, socket, sys, threading

def connect(name):
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect("\\0" + name)
        return "connected"
    except OSError as err:
        return f"refused: {err.strerror}"
    finally:
        client.close()

own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind("\\0" + sys.argv[1] + "-own-" + str(__import__("os").getpid()))
own.listen(1)
result = {name: connect(name) for name in sys.argv[2:]}
result["own"] = connect(own.getsockname()[1:].decode())
print(json.dumps(result), flush=True)
"""


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[SlotManager, AgentConfig]]:
    cfg = config_for(tmp_path, "n")
    made = build_manager(cfg, discover(gpus=False, fpgas=False))
    made.start(supervise=False)
    try:
        yield made, cfg
    finally:
        made.close()
        tear_down(cfg)


def logged(slots: SlotManager, slot_id: str, needle: str) -> list[str] | None:
    try:
        lines = slots.logs(slot_id, 20)
    except NotFound:  # the keeper makes the log once it takes custody of the worker
        return None
    return lines if any(needle in line for line in lines) else None


def worker(name: str, argv: list[str]) -> dict[str, object]:
    return {
        "name": name,
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "64Mi"},
        "worker": {"command": argv, "stop_grace_seconds": 1, "restart": "never"},
    }


@pytest.mark.skipif(not landlock.scope_supported(), reason="Landlock ABI 6 (scopes) needed")
def test_another_slots_and_the_hosts_abstract_sockets_are_out_of_reach(
    manager: tuple[SlotManager, AgentConfig],
) -> None:
    slots, _ = manager
    python = world_python()
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        host.bind("\0" + HOST_NAME)
        host.listen(8)
        slots.allocate(parse_slot_request(worker("listener", [python, "-c", LISTENER, VICTIM_NAME])))
        wait_until("the listener slot's socket", lambda: logged(slots, "listener", "listening"))
        slots.allocate(
            parse_slot_request(worker("prober", [python, "-c", PROBER, TAG, HOST_NAME, VICTIM_NAME]))
        )
        lines = wait_until("the prober's verdicts", lambda: logged(slots, "prober", "{"))
        confined = json.loads(next(line[line.index("{") :] for line in lines if "{" in line))
        assert confined["own"] == "connected", confined  # its own abstract sockets work
        assert confined[HOST_NAME].startswith("refused"), confined
        assert confined[VICTIM_NAME].startswith("refused"), confined
        # The control: outside every slot, the same script reaches both.
        done = subprocess.run(
            [python, "-c", PROBER, TAG, HOST_NAME, VICTIM_NAME], capture_output=True, text=True, timeout=30
        )
        free = json.loads(done.stdout)
        assert free == {HOST_NAME: "connected", VICTIM_NAME: "connected", "own": "connected"}, done
        for name in ("prober", "listener"):
            slots.release(name)
    finally:
        host.close()


CONNECTOR = """
import json, socket, sys

def connect(port):
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=1.5):
            return "connected"
    except OSError as err:
        return "timed out" if isinstance(err, TimeoutError) else f"refused: {err.strerror}"

names = ("api", "other", "opened", "slot")
print(json.dumps({name: connect(port) for name, port in zip(names, sys.argv[1:])}), flush=True)
"""
API_PARENT = f"natest{os.getpid()}a.slice"
API_TABLE = f"natest{os.getpid()}a"


def api_tables() -> list[str]:
    """Our agent's API guard table, if it is in the kernel."""
    guard = ApiGuard(LibNftables(), table_name(API_TABLE))
    return [guard.table] if guard.installed() else []


@pytest.fixture
def api_daemon(tmp_path: Path) -> Iterator[Callable[[str], DaemonProcess]]:
    """Agents with the test's own cgroup parent and firewall table, and ``extra`` configuration."""
    made: list[DaemonProcess] = []

    def factory(extra: str) -> DaemonProcess:
        made.append(
            DaemonProcess(
                tmp_path / str(len(made)),
                f'[isolation]\ncgroup_parent = "{API_PARENT}"\nfirewall_table = "{API_TABLE}"\n{extra}',
            )
        )
        return made[-1]

    yield factory
    for daemon in made:
        daemon.stop()
        daemon.stop_keeper()
        isolation = {"cgroup_parent": API_PARENT, **HOST_OFF}
        cfg = apply_overrides(parse_config({"isolation": isolation}), state_dir=daemon.state)
        backend = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
        if isinstance(backend, KernelIsolation):
            backend.isolator.remove_all()
    ApiGuard(LibNftables(), table_name(API_TABLE)).remove()


def connections_from_a_slot(
    daemon: DaemonProcess, *ports: int, client: httpx.Client | None = None
) -> dict[str, str]:
    """Run the connector in a slot of ``daemon`` (started here unless ``client`` is given)."""
    client = client or daemon.start()
    try:
        api_port = daemon.url.rsplit(":", 1)[1]
        body = worker("connector", [world_python(), "-c", CONNECTOR, api_port, *map(str, ports)])
        assert client.post("/v1/slots", json=body).status_code == 201

        def verdicts() -> dict[str, str] | None:
            lines = client.get("/v1/slots/connector/logs").json()["lines"]
            found = [line[line.index("{") :] for line in lines if "{" in line]
            return json.loads(found[0]) if found else None

        result: dict[str, str] = wait_until("the connector's verdicts", verdicts)
        assert client.delete("/v1/slots/connector").status_code in (200, 202, 204)
        return result
    finally:
        client.close()


def test_a_slot_reaches_the_agents_tcp_api_only_where_configured(
    api_daemon: Callable[[str], DaemonProcess],
) -> None:
    other = socket.create_server(("127.0.0.1", 0))  # a host service: not the API
    try:
        other_port = other.getsockname()[1]
        guarded = api_daemon("")
        assert connections_from_a_slot(guarded, other_port) == {"api": "timed out", "other": "connected"}
        assert api_tables(), "the agent's rule is in the kernel while it runs"
        assert guarded.stop() == 0
        assert not api_tables(), "a clean stop removes the rule"
        # Configured open: the same worker connects.
        opened = api_daemon("[api]\nslots_may_connect = true\n")
        assert connections_from_a_slot(opened, other_port) == {"api": "connected", "other": "connected"}
        assert not api_tables()
    finally:
        other.close()


def test_local_default_deny_keeps_a_slot_off_host_services_but_what_it_opens(
    api_daemon: Callable[[str], DaemonProcess],
) -> None:
    """With ``[isolation] local_default_deny``, a host service on 127.0.0.1 is out of a slot's
    reach, one listed in ``local_open_ports`` is not, and the API follows ``slots_may_connect``."""
    other = socket.create_server(("127.0.0.1", 0))
    opened = socket.create_server(("127.0.0.1", 0))
    try:
        other_port, opened_port = other.getsockname()[1], opened.getsockname()[1]
        daemon = api_daemon(
            f'local_default_deny = true\nlocal_open_ports = ["{opened_port}/tcp"]\n'
            "[api]\nslots_may_connect = true\n"
        )
        # Another slot's worker listening on a port of its own.
        slot_port = free_port()
        client = daemon.start()
        body = worker("victim", [world_python(), "-c", VICTIM, str(slot_port)])
        assert client.post("/v1/slots", json=body).status_code == 201
        wait_until(
            "the victim slot's listener",
            lambda: "listening" in str(client.get("/v1/slots/victim/logs").json()),
        )
        verdicts = connections_from_a_slot(daemon, other_port, opened_port, slot_port, client=client)
        assert verdicts == {
            "api": "connected",
            "other": "timed out",
            "opened": "connected",
            "slot": "timed out",
        }
        socket.create_connection(("127.0.0.1", slot_port), timeout=5).close()  # from the host: it listens
        # The host itself (root) still reaches the service: only the slots' uids are refused.
        socket.create_connection(("127.0.0.1", other_port), timeout=5).close()
        assert daemon.stop() == 0
        assert not api_tables()
    finally:
        other.close()
        opened.close()
