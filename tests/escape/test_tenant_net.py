"""Slot against slot and slot against host over what a shared network namespace leaves open.

Two default (sandboxed) slots without a network of their own, through the real SlotManager,
kernel isolation and host keeper: the ``listener`` slot's worker binds an abstract unix socket,
the test (the host) binds another; the ``prober`` slot's worker tries to connect to both, and to
an abstract socket of its own. Landlock's scope (runtime/sandbox/landlock.py) refuses the first
two and allows the last; the same script run by the test outside every slot connects to all
three, so a refusal means something. Every socket and process is the test's own and ended by it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.daemon import build_manager
from nodeagent.agent.manager import SlotManager
from nodeagent.devices.discovery import discover
from nodeagent.errors import NotFound
from nodeagent.runtime.sandbox import landlock
from nodeagent.schema.request import parse_slot_request
from tests.daemon import wait_until
from tests.escape.harness import config_for, tear_down
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
