"""Crash safety: SIGKILL ``nodeagent serve`` at random points of allocate/launch/release, restart it,
and check after every restart that no CPU is held twice (database and kernel cpusets), that no
orphaned kernel object remains, and that every live worker was re-adopted.

Iterations: 50 when CI is set, else NODEAGENT_CRASH_ITERATIONS (default 5).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.cpulist import parse_cpulist
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from tests.daemon import DaemonProcess

pytestmark = [pytest.mark.root, pytest.mark.slow]

ITERATIONS = 50 if os.environ.get("CI") else int(os.environ.get("NODEAGENT_CRASH_ITERATIONS", "5"))
CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = f"natest{os.getpid()}c.slice"
NETNS_PREFIX = f"nt{os.getpid()}-"
#: its own firewall table too: remove_all() deletes the configured one
FIREWALL_TABLE = f"natest{os.getpid()}c"
NAMES = ("a", "b", "c")
HOLDING = ("pending", "ready", "running", "releasing")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        tmp_path,
        f'[isolation]\ncgroup_parent = "{PARENT}"\nnetns_prefix = "{NETNS_PREFIX}"\n'
        f'firewall_table = "{FIREWALL_TABLE}"\n',
    )
    yield d
    d.stop()
    cfg = apply_overrides(
        parse_config(
            {
                "isolation": {
                    "cgroup_parent": PARENT,
                    "netns_prefix": NETNS_PREFIX,
                    "firewall_table": FIREWALL_TABLE,
                }
            }
        ),
        state_dir=d.state,
    )
    kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
    if isinstance(kernel, KernelIsolation):
        kernel.isolator.remove_all()


def random_operation(client: httpx.Client, rng: random.Random) -> None:
    name = rng.choice(NAMES)
    action = rng.random()
    try:
        if action < 0.5:
            qos = rng.choice(("guaranteed", "burstable"))
            cpus = 1 if qos == "guaranteed" else 0.2
            body: dict[str, Any] = {"name": name, "qos": qos, "resources": {"cpus": cpus, "memory": "32Mi"}}
            if rng.random() < 0.7:
                body["worker"] = {
                    "command": ["/bin/sleep", "600"],
                    "restart": "always",
                    "stop_grace_seconds": 1,
                }
            client.post("/v1/slots", json=body)
        elif action < 0.85:
            client.delete(f"/v1/slots/{name}")
        else:
            client.post(f"/v1/slots/{name}/worker", json={"command": ["/bin/sleep", "600"]})
    except httpx.TransportError:
        pass  # the daemon died under us: that is the point


def slot_dirs() -> dict[str, Path]:
    parents = [
        CGROUP_ROOT / "cpuset" / PARENT,
        *(CGROUP_ROOT / "cpuset" / PARENT / c for c in ("burstable", "best-effort")),
    ]
    found: dict[str, Path] = {}
    for parent in parents:
        if parent.is_dir():
            for entry in parent.iterdir():
                if entry.is_dir() and entry.name not in ("burstable", "best-effort"):
                    found[entry.name] = entry
    return found


def check_invariants(client: httpx.Client) -> None:
    slots = client.get("/v1/slots").json()
    slots = slots["slots"] if isinstance(slots, dict) else slots
    assert all(s["state"] not in ("pending", "releasing") for s in slots), "reconcile left unfinished work"
    holding = [s for s in slots if s["state"] in HOLDING]
    # No CPU held twice, in the database...
    exclusive = [c for s in holding if s["assignment"]["exclusive"] for c in s["assignment"]["cpus"]]
    assert len(exclusive) == len(set(exclusive)), f"CPUs held twice in the database: {exclusive}"
    # ...nor in the kernel, and the kernel has exactly the database's slots.
    dirs = slot_dirs()
    assert set(dirs) == {s["id"] for s in holding}, "orphaned or missing cgroups"
    seen: set[int] = set()
    for s in holding:
        cpus = parse_cpulist((dirs[s["id"]] / "cpuset.cpus").read_text())
        if s["assignment"]["exclusive"]:
            assert cpus == frozenset(s["assignment"]["cpus"])
            assert not cpus & seen, f"exclusive CPUs {sorted(cpus & seen)} also used by another slot"
            seen |= cpus
    for s in holding:
        if not s["assignment"]["exclusive"]:
            cpus = parse_cpulist((dirs[s["id"]] / "cpuset.cpus").read_text())
            assert not cpus & seen, "a shared slot runs on an exclusive slot's CPUs"
    netns_dir = Path("/run/netns")
    stray = (
        [n.name for n in netns_dir.iterdir() if n.name.startswith(NETNS_PREFIX)] if netns_dir.is_dir() else []
    )
    assert stray == [], f"orphaned netns {stray}"
    # Every live worker is ours again: the only process in a slot is the worker the agent reports.
    for s in holding:
        tasks = {int(p) for p in (dirs[s["id"]] / "cgroup.procs").read_text().split()}
        worker = s.get("worker") or {}
        if tasks:
            assert worker.get("pid") in tasks, f"slot {s['name']} runs {tasks} but the agent reports {worker}"
            assert worker.get("phase") in ("starting", "running", "unready", "stopping")


def test_sigkill_at_random_points_never_double_books(daemon: DaemonProcess) -> None:
    rng = random.Random(os.environ.get("NODEAGENT_CRASH_SEED", "7"))
    began = time.monotonic()
    for _ in range(ITERATIONS):
        client = daemon.start()
        check_invariants(client)
        stop = threading.Event()

        def churn(c: httpx.Client = client, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                random_operation(c, rng)

        worker = threading.Thread(target=churn)
        worker.start()
        time.sleep(rng.uniform(0.0, 0.4))
        daemon.kill()
        stop.set()
        worker.join(timeout=60)
        client.close()
    client = daemon.start()
    check_invariants(client)
    client.close()
    print(f"{ITERATIONS} SIGKILLs in {time.monotonic() - began:.1f} s")
