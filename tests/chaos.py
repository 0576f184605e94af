"""Chaos: random allocate/launch/resize/release load on a real ``nodeagent serve``, with SIGKILLs of
the agent, of its host keeper, or of both, at random moments; after every restart the invariants
are checked:

- no CPU held twice (in the database and in the kernel's cpusets), and a shared slot never runs on
  an exclusive slot's CPUs;
- every slot in the database has its kernel objects, and every kernel object of ours its slot (no
  orphaned cgroup or netns);
- every live worker is in its slot's cgroup and re-adopted, by the agent and by the keeper; no
  process of ours runs outside a slot, and no pre-forked child of a dead keeper is left waiting;
- capacity equals the sum of the slots: allocated CPUs, memory and slots per QoS class.

Used by tests/agent/test_crash_safety.py (a short run in CI) and bench/chaos.py (the long run).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from nodeagent.cpulist import parse_cpulist
from nodeagent.runtime.keeper_client import keeper_identity
from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd, process_start_time
from tests.daemon import DaemonProcess, keeper_status, wait_until

CGROUP_ROOT = Path("/sys/fs/cgroup")
NAMES = ("a", "b", "c")
HOLDING = ("pending", "ready", "running", "releasing")


@dataclass(frozen=True)
class Names:
    """Where a chaos run's objects live: its own cgroup parent, netns prefix and firewall table."""

    parent: str
    netns_prefix: str
    firewall_table: str

    def config_toml(self) -> str:
        return (
            f'[isolation]\ncgroup_parent = "{self.parent}"\nnetns_prefix = "{self.netns_prefix}"\n'
            f'firewall_table = "{self.firewall_table}"\n'
        )

    def config(self) -> dict[str, Any]:
        return {
            "isolation": {
                "cgroup_parent": self.parent,
                "netns_prefix": self.netns_prefix,
                "firewall_table": self.firewall_table,
                "host_partitioning": "off",
            }
        }


@dataclass
class Tally:
    rounds: int = 0
    killed: dict[str, int] = field(default_factory=lambda: {"agent": 0, "keeper": 0})
    operations: int = 0
    checks: int = 0
    seconds: float = 0.0


def random_operation(client: httpx.Client, rng: random.Random) -> None:
    """One random call: allocate (with or without a worker), release, resize, start a worker."""
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
        elif action < 0.75:
            client.delete(f"/v1/slots/{name}")
        elif action < 0.9:
            resources: dict[str, Any] = {"memory": rng.choice(("32Mi", "48Mi", "64Mi"))}
            if rng.random() < 0.5:
                resources["cpus"] = rng.choice((1, 2))  # refused (422) for a burstable slot: fine
            client.patch(f"/v1/slots/{name}", json={"resources": resources})
        else:
            client.post(f"/v1/slots/{name}/worker", json={"command": ["/bin/sleep", "600"]})
    except httpx.TransportError:
        pass  # the daemon died under us: that is the point


def slot_dirs(names: Names) -> dict[str, Path]:
    parents = [
        CGROUP_ROOT / "cpuset" / names.parent,
        *(CGROUP_ROOT / "cpuset" / names.parent / c for c in ("burstable", "best-effort")),
    ]
    found: dict[str, Path] = {}
    for parent in parents:
        if parent.is_dir():
            for entry in parent.iterdir():
                if entry.is_dir() and entry.name not in ("burstable", "best-effort"):
                    found[entry.name] = entry
    return found


def check_booking(client: httpx.Client, names: Names) -> None:
    """Resources: what the database books and what the kernel holds agree, nothing twice."""
    slots = client.get("/v1/slots").json()
    slots = slots["slots"] if isinstance(slots, dict) else slots
    assert all(s["state"] not in ("pending", "releasing") for s in slots), "reconcile left unfinished work"
    holding = [s for s in slots if s["state"] in HOLDING]
    # No CPU held twice, in the database...
    exclusive = [c for s in holding if s["assignment"]["exclusive"] for c in s["assignment"]["cpus"]]
    assert len(exclusive) == len(set(exclusive)), f"CPUs held twice in the database: {exclusive}"
    # ...nor in the kernel, and the kernel has exactly the database's slots.
    dirs = slot_dirs(names)
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
    entries = list(netns_dir.iterdir()) if netns_dir.is_dir() else []
    stray = [n.name for n in entries if n.name.startswith(names.netns_prefix)]
    assert stray == [], f"orphaned netns {stray}"
    check_capacity(client, holding)


def check_capacity(client: httpx.Client, holding: list[dict[str, Any]]) -> None:
    """Capacity is the sum of the slots: what the controller is told is what placement counts."""
    capacity = client.get("/v1/capacity").json()
    exclusive = sum(len(s["assignment"]["cpus"]) for s in holding if s["assignment"]["exclusive"])
    assert capacity["resources"]["cpus"]["allocated"] == exclusive, "capacity's CPUs are not the slots'"
    memory = sum(s["assignment"]["memory_bytes"] for s in holding)
    allocated = capacity["resources"]["memory_bytes"]["allocated"]
    assert allocated == memory, f"capacity counts {allocated} bytes of memory, the slots hold {memory}"
    for qos, figures in capacity["by_qos"].items():
        count = sum(1 for s in holding if s["qos"] == qos)
        assert figures["slots"] == count, f"capacity counts {figures['slots']} {qos} slots, there are {count}"


def _proc(pid: str, name: str) -> bytes:
    try:
        return (Path("/proc") / pid / name).read_bytes()
    except OSError:
        return b""


def _running(pid: str) -> bool:
    stat = _proc(pid, "stat")
    return bool(stat) and stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def our_processes(daemon: DaemonProcess) -> tuple[dict[int, str], set[int]]:
    """(worker pid -> its slot id, from its environment) for every worker launched by this test's
    agent, and the pids of everything running the keeper's command line for this test's state
    (the keeper and the children it forked ahead of time: forked, never exec'd)."""
    keeper_argv = f"-m\0nodeagent.runtime.keeper\0{daemon.keeper_dir}\0".encode()
    workers: dict[int, str] = {}
    keepers: set[int] = set()
    marker = f"NODEAGENT_SLOT_FILE={daemon.state / 'workers'}/".encode()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        if not _running(pid):
            continue
        if _proc(pid, "cmdline").endswith(keeper_argv):
            keepers.add(int(pid))
            continue
        for entry in _proc(pid, "environ").split(b"\0"):
            if entry.startswith(marker):
                workers[int(pid)] = entry[len(marker) :].split(b"/")[0].decode()
    return workers, keepers


def check_processes(client: httpx.Client, daemon: DaemonProcess, names: Names) -> None:
    """Processes: every live worker is in its slot and re-adopted by the agent and the keeper; no
    child of a dead keeper is left waiting. A dead keeper is replaced asynchronously: retried."""
    slots = client.get("/v1/slots").json()
    slots = slots["slots"] if isinstance(slots, dict) else slots
    holding = {s["id"]: s for s in slots if s["state"] in HOLDING}
    dirs = slot_dirs(names)
    for s in holding.values():
        tasks = {int(p) for p in (dirs[s["id"]] / "cgroup.procs").read_text().split()}
        worker = s.get("worker") or {}
        if tasks:
            assert worker.get("pid") in tasks, f"slot {s['name']} runs {tasks} but the agent reports {worker}"
            assert worker.get("phase") in ("starting", "running", "unready", "stopping")
    workers, keepers = our_processes(daemon)
    for pid, slot_id in workers.items():
        assert slot_id in holding, f"worker {pid} of slot {slot_id} runs, but no such slot holds resources"
        tasks = {int(p) for p in (dirs[slot_id] / "cgroup.procs").read_text().split()}
        assert pid in tasks, f"worker {pid} of slot {slot_id} runs outside its slot's cgroup"
    keeper = keeper_identity(daemon.keeper_dir)
    alive = [keeper.pid] if keeper is not None and is_alive(keeper) else []
    if workers or keepers:
        assert alive, "workers run but no keeper does"
    strays = {pid for pid in keepers - set(alive) if parent(pid) not in alive}
    assert not strays, f"children of a dead keeper still wait: {sorted(strays)}"
    if alive:
        status = keeper_status(daemon.keeper_dir)
        assert status is not None, "the keeper does not answer"
        custody = {w["pid"] for w in status["workers"] if not w["final"]}
        assert set(workers) <= custody, f"workers {sorted(set(workers) - custody)} are in no keeper's custody"


def is_alive(identity: ProcessIdentity) -> bool:
    return process_start_time(identity.pid) == identity.start_time and _running(str(identity.pid))


def parent(pid: int) -> int:
    stat = _proc(str(pid), "stat")
    return int(stat[stat.rindex(b")") + 2 :].split()[1]) if stat else 0


def settle(what: str, check: Any, timeout: float = 30.0) -> None:
    """``check`` until it passes (AssertionError: not yet), or fail with its last complaint."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def kill_keeper(daemon: DaemonProcess) -> None:
    """SIGKILL the daemon's keeper, exactly that process (verified pidfd), and wait for it to die."""
    identity = keeper_identity(daemon.keeper_dir)
    pidfd = None if identity is None else open_verified_pidfd(identity)
    if pidfd is None:
        return
    assert identity is not None
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    os.close(pidfd)
    wait_until("the keeper to die", lambda: not is_alive(identity))


def victims(rng: random.Random) -> tuple[str, ...]:
    return rng.choice((("agent",), ("keeper",), ("agent", "keeper"), ("keeper", "agent")))


def run(
    daemon: DaemonProcess,
    names: Names,
    rounds: int,
    seed: str,
    progress: Callable[[Tally], None] | None = None,
) -> Tally:
    """``rounds`` rounds of churn ended by SIGKILLs; the invariants checked after each restart."""
    rng = random.Random(seed)
    tally = Tally()
    began = time.monotonic()
    client: httpx.Client | None = None
    for _ in range(rounds):
        if client is None:
            client = daemon.start()
        check_booking(client, names)
        settle("processes", lambda c=client: check_processes(c, daemon, names))
        tally.checks += 1
        stop = threading.Event()

        def churn(c: httpx.Client = client, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                random_operation(c, rng)
                tally.operations += 1

        worker = threading.Thread(target=churn)
        worker.start()
        time.sleep(rng.uniform(0.0, 0.4))
        for victim in victims(rng):
            tally.killed[victim] += 1
            if victim == "agent":
                daemon.kill()
            else:
                kill_keeper(daemon)
        stop.set()
        worker.join(timeout=60)
        if daemon.process is None:  # the agent died: start it again next round
            client.close()
            client = None
        tally.rounds += 1
        tally.seconds = time.monotonic() - began
        if progress is not None:
            progress(tally)
    if client is None:
        client = daemon.start()
    check_booking(client, names)
    settle("processes", lambda c=client: check_processes(c, daemon, names))
    tally.checks += 1
    client.close()
    tally.seconds = time.monotonic() - began
    return tally
