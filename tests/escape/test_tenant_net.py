"""Slot against slot and slot against host over what a shared network namespace leaves open.

Two default (sandboxed) slots without a network of their own, through the real SlotManager,
kernel isolation and host keeper: the ``listener`` slot's worker binds an abstract unix socket,
the test (the host) binds another; the ``prober`` slot's worker tries to connect to both, and to
an abstract socket of its own. Landlock's scope (runtime/sandbox/landlock.py) refuses the first
two and allows the last; the same script run by the test outside every slot connects to all
three, so a refusal means something.

A real ``nodeagent serve`` then runs a slot whose worker connects to the agent's TCP API, to a
host service on another loopback port, to another slot's listener and to a listener of another
process of its own slot. With ``[isolation] local_default_deny = false`` only the API is out of
reach (isolation/api_guard.py), and with ``[api] slots_may_connect = true`` it is not; by default a
host service on 127.0.0.1 and another slot's listener refuse it at once (the other slot's server
never sees the connection) while a port in ``local_open_ports`` and its own listener connect; a
clean stop leaves no rule behind; the host itself still reaches all of them. Every socket,
process and rule is the test's own and removed by it.
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

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.manager import SlotManager
from nodeagent.errors import NotFound
from nodeagent.isolation.api_guard import ApiGuard, table_name
from nodeagent.isolation.firewall import LibNftables
from nodeagent.runtime.sandbox import landlock
from nodeagent.schema.request import parse_slot_request
from tests.daemon import HOST_OFF, DaemonProcess, remove_daemon_objects, wait_until
from tests.escape.harness import config_for, free_port, started_manager
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
    with started_manager(cfg) as made:
        yield made, cfg


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
import json, socket, subprocess, sys

def connect(port, host="127.0.0.1"):
    try:
        with socket.create_connection((host, int(port)), timeout=1.5):
            return "connected"
    except OSError as err:
        return "timed out" if isinstance(err, TimeoutError) else f"refused: {err.strerror}"

# Another process of this slot, listening on a port nobody assigned (as torch.distributed does).
LISTEN = (
    "import socket\\n"
    "s = socket.create_server(('::', 0), family=socket.AF_INET6, dualstack_ipv6=True)\\n"
    "print(s.getsockname()[1], flush=True)\\n"
    "while True: s.accept()[0].close()\\n"
)
own = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
own_port = own.stdout.readline().strip()
def send(port):
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", int(port)))
        return "sent"
    except OSError as err:
        return f"refused: {err.strerror}"

names = ("api", "other", "opened", "slot")
verdicts = {name: connect(port) for name, port in zip(names, sys.argv[1:5])}
if len(sys.argv) > 5:
    verdicts["datagram"] = send(sys.argv[5])
if len(sys.argv) > 6:
    address, _, port = sys.argv[6].rpartition(":")
    verdicts["network"] = connect(port, address)
verdicts["own"] = connect(own_port)
verdicts["own_ip6"] = connect(own_port, "::1")
own.kill()
print(json.dumps(verdicts), flush=True)
"""
ACCEPTER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    print("accepted", peer, flush=True)
    conn.close()
"""
#: what the connector reports of its own slot's listener in every case
OWN = {"own": "connected", "own_ip6": "connected"}
API_PARENT = f"natest{os.getpid()}a.slice"
API_TABLE = f"natest{os.getpid()}a"
#: The slots' uids here: none another agent's rules match (a table a killed test agent left in the
#: kernel refuses its own range's connections, and would refuse these too with the default range).
API_UIDS = "700000-700999"


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
                f'[sandbox]\nuid_range = "{API_UIDS}"\n\n'
                f'[isolation]\ncgroup_parent = "{API_PARENT}"\nfirewall_table = "{API_TABLE}"\n{extra}',
            )
        )
        return made[-1]

    yield factory
    for daemon in made:
        daemon.stop()
        daemon.stop_keeper()
        remove_daemon_objects(daemon, {"cgroup_parent": API_PARENT, "firewall_table": API_TABLE, **HOST_OFF})
    ApiGuard(LibNftables(), table_name(API_TABLE)).remove()


def connections_from_a_slot(
    daemon: DaemonProcess, *ports: int | str, client: httpx.Client | None = None
) -> dict[str, str]:
    """Run the connector in a slot of ``daemon`` (started here, and its client closed, unless
    ``client`` is given)."""
    started = client is None
    client = client or daemon.start()
    try:
        api_port = daemon.url.rsplit(":", 1)[1]
        body = worker("connector", [world_python(), "-c", CONNECTOR, api_port, *map(str, ports)])
        assert client.post("/v1/slots", json=body).status_code == 201

        def verdicts() -> dict[str, str] | None:
            answer = client.get("/v1/slots/connector/logs")
            if answer.status_code == 404:  # the keeper makes the log once it takes the worker
                return None
            lines = answer.json()["lines"]
            found = [line[line.index("{") :] for line in lines if "{" in line]
            return json.loads(found[0]) if found else None

        result: dict[str, str] = wait_until("the connector's verdicts", verdicts)
        assert client.delete("/v1/slots/connector").status_code in (200, 202, 204)
        return result
    finally:
        if started:
            client.close()


def test_a_slot_reaches_the_agents_tcp_api_only_where_configured(
    api_daemon: Callable[[str], DaemonProcess],
) -> None:
    other = socket.create_server(("127.0.0.1", 0))  # a host service: not the API
    try:
        other_port = other.getsockname()[1]
        guarded = api_daemon("local_default_deny = false\n")
        verdicts = connections_from_a_slot(guarded, other_port)
        assert verdicts == {"api": "timed out", "other": "connected", **OWN}, verdicts
        assert api_tables(), "the agent's rule is in the kernel while it runs"
        assert guarded.stop() == 0
        assert not api_tables(), "a clean stop removes the rule"
        # Configured open: the same worker connects.
        opened = api_daemon("local_default_deny = false\n[api]\nslots_may_connect = true\n")
        verdicts = connections_from_a_slot(opened, other_port)
        assert verdicts == {"api": "connected", "other": "connected", **OWN}, verdicts
        assert not api_tables()
    finally:
        other.close()


def _reaches(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_by_default_a_slot_reaches_its_own_listeners_and_opened_ports_only(
    api_daemon: Callable[[str], DaemonProcess],
) -> None:
    """By default (``[isolation] local_default_deny``) a host service on 127.0.0.1 and another
    slot's listener refuse a slot's connection at once, and the other slot's server never sees
    it; a port in ``local_open_ports`` and the slot's own listeners (another process of the slot,
    IPv4 and IPv6) connect; a datagram to a host port is not sent; the host reaches all of them."""
    other = socket.create_server(("127.0.0.1", 0))
    opened = socket.create_server(("127.0.0.1", 0))
    datagrams = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        datagrams.bind(("127.0.0.1", 0))
        datagrams.settimeout(0.5)
        other_port, opened_port = other.getsockname()[1], opened.getsockname()[1]
        daemon = api_daemon(f'local_open_ports = ["{opened_port}/tcp"]\n[api]\nslots_may_connect = true\n')
        # Another slot's worker listening on a port of its own.
        slot_port = free_port()
        client = daemon.start()
        body = worker("victim", [world_python(), "-c", ACCEPTER, str(slot_port)])
        assert client.post("/v1/slots", json=body).status_code == 201

        def victim_log() -> str:
            answer = client.get("/v1/slots/victim/logs")
            return "" if answer.status_code == 404 else "\n".join(answer.json()["lines"])

        wait_until("the victim slot's listener", lambda: "listening" in victim_log())
        # And a slot with a network of its own, listening in its namespace.
        networked = worker("networked", [world_python(), "-c", ACCEPTER, str(slot_port)])
        networked["resources"] = {**networked["resources"], "network": {}}  # type: ignore[dict-item]
        created = client.post("/v1/slots", json=networked)
        assert created.status_code == 201, created.text
        slot_address = created.json()["network"]["slot_address"]
        target = f"{slot_address}:{slot_port}"
        # The host reaches it (before the slot tries, so that a refusal is the rule's).
        wait_until("the networked slot's listener", lambda: _reaches(slot_address, slot_port))
        verdicts = connections_from_a_slot(
            daemon, other_port, opened_port, slot_port, datagrams.getsockname()[1], target, client=client
        )
        assert verdicts == {
            "api": "connected",
            "other": "refused: Connection refused",
            "opened": "connected",
            "slot": "refused: Connection refused",
            "datagram": "refused: Operation not permitted",
            "network": "refused: Connection refused",
            **OWN,
        }, verdicts
        assert "accepted" not in victim_log(), "the other slot's server never saw the connection"
        with pytest.raises(TimeoutError):
            datagrams.recv(16)
        # From the host: the victim listens and accepts; only the slots' uids are refused.
        socket.create_connection(("127.0.0.1", slot_port), timeout=5).close()
        wait_until("the host's connection at the victim", lambda: "accepted" in victim_log())
        socket.create_connection(("127.0.0.1", other_port), timeout=5).close()
        client.close()
        assert daemon.stop() == 0
        assert not api_tables()
    finally:
        other.close()
        opened.close()
        datagrams.close()
