"""End to end on the real kernel: ``nodeagent serve`` as a subprocess, driven through the CLI and REST.

(a) the CLI allocates a guaranteed slot with the example inference worker; isolation is checked
from /proc and cgroupfs (cgroups, CPU affinity, memory limit, environment), an inference request
is answered, ``slots logs`` shows the worker's output, and ``slots stop/start --wait`` cycle it;
(b) REST allocates a burstable slot with a network namespace, whose cpuset must exclude the
guaranteed slot's CPU; (c) both are released (CLI and REST) and nothing may remain: no slot
cgroups, no worker processes, no netns or veth with our prefixes. The daemon then stops on SIGTERM.

Names carry "natest" and this pid; the ``daemon`` fixture's finalizer cleans up whatever a
failure left: it kills only the worker pids the test recorded and removes the test's cgroups,
netns and veths.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.cgroups import detect
from nodeagent.cpulist import parse_cpulist
from tests.daemon import DaemonProcess, free_port, keeper_status, nodeagent_argv, wait_until
from tests.workerpy import worker_visible

pytestmark = [pytest.mark.root, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PARENT = f"natest{os.getpid()}e.slice"
NETNS_PREFIX = f"ne{os.getpid()}-"
VETH_PREFIX = "nte"
FIREWALL_TABLE = f"natest{os.getpid()}e"
NETNS_DIR = Path("/run/netns")
CLASS_PARENTS = ("burstable", "best-effort")
ALIVE = ("starting", "running", "unready", "stopping")
MODEL = "mlp"
INPUT_WIDTH = 64


# =========================================================================== the daemon


class Daemon(DaemonProcess):
    """The daemon under the test's cgroup parent, netns and veth prefixes; remembers worker pids."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp,
            f'[isolation]\ncgroup_parent = "{PARENT}"\nnetns_prefix = "{NETNS_PREFIX}"\n'
            f'veth_prefix = "{VETH_PREFIX}"\nfirewall_table = "{FIREWALL_TABLE}"\n\n'
            "[workers]\ntick_seconds = 0.1\n",
        )
        #: Every worker pid the test saw: the finalizer kills these (and only these) if still alive.
        self.worker_pids: set[int] = set()

    def remember(self, slot: dict[str, Any]) -> None:
        pid = (slot.get("worker") or {}).get("pid")
        if pid:
            self.worker_pids.add(int(pid))


def controller_mounts() -> dict[str, Path]:
    """Where each controller the slots use is mounted (v1), or the unified mount for all (v2)."""
    host = detect()
    if host.v1_mounts.get("cpuset"):
        return {c: host.v1_mounts[c] for c in ("cpuset", "memory", "pids") if c in host.v1_mounts}
    assert host.v2_mount is not None, f"no cgroup mount found (mode {host.mode})"
    return dict.fromkeys(("cpuset", "memory", "pids"), host.v2_mount)


def parent_dirs() -> set[Path]:
    host = detect()
    roots = set(host.v1_mounts.values()) | ({host.v2_mount} if host.v2_mount else set())
    return {root / PARENT for root in roots if (root / PARENT).is_dir()}


def slot_cgroup_dirs() -> list[Path]:
    """Slot cgroups under the test parent, in any hierarchy (class parents are not slots)."""
    found = []
    for parent in parent_dirs():
        for level in (parent, *(parent / c for c in CLASS_PARENTS)):
            if level.is_dir():
                found += [d for d in level.iterdir() if d.is_dir() and d.name not in CLASS_PARENTS]
    return found


def our_netns() -> list[str]:
    return (
        sorted(n.name for n in NETNS_DIR.iterdir() if n.name.startswith(NETNS_PREFIX))
        if NETNS_DIR.is_dir()
        else []
    )


def our_veths() -> list[str]:
    return sorted(n.name for n in Path("/sys/class/net").iterdir() if n.name.startswith(VETH_PREFIX))


def our_firewall_table() -> bool:
    found = subprocess.run(["nft", "list", "table", "inet", FIREWALL_TABLE], capture_output=True, check=False)
    return found.returncode == 0


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return state[state.rindex(")") + 2] == "Z"  # a zombie has ended; the keeper reaps it


def in_test_parent(pid: int) -> bool:
    """Pid-reuse guard for the finalizer: only a process inside our test parent is ours to kill."""
    try:
        return f"/{PARENT}/" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def pids_in_test_parent() -> set[int]:
    """Every process in a cgroup under the test's own parent: only this test creates them."""
    pids: set[int] = set()
    for parent in parent_dirs():
        for procs in parent.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in procs.read_text().split()}
    return pids


def clean_up(daemon: Daemon) -> None:
    daemon.stop()
    daemon.stop_keeper()
    # The workers the test saw, and any it never saw (a worker that never became ready) that still
    # sits in the test's slots.
    leftovers = {p for p in daemon.worker_pids if in_test_parent(p)} | pids_in_test_parent()
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in leftovers | daemon.worker_pids:
        with contextlib.suppress(AssertionError):
            wait_until(f"worker {pid} to end", lambda p=pid: process_gone(p), timeout=10)
    for parent in parent_dirs():
        for path in sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            parent.rmdir()
    for name in our_netns():
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
    for name in our_veths():
        subprocess.run(["ip", "link", "delete", name], check=False, capture_output=True)
    # The agent keeps its firewall table when it stops (leftover veths stay denied); this one is
    # the test's own.
    if our_firewall_table():
        subprocess.run(["nft", "delete", "table", "inet", FIREWALL_TABLE], check=False, capture_output=True)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    try:
        yield d
    finally:
        clean_up(d)
    assert not parent_dirs(), f"could not remove the test cgroups {sorted(map(str, parent_dirs()))}"
    assert not our_firewall_table(), f"could not remove the test's nftables table {FIREWALL_TABLE}"


# =========================================================================== checks


def worker_request(name: str, port: int, python: str) -> dict[str, Any]:
    """The example worker; ``python`` must be runnable by the slot's own uid (tests.workerpy)."""
    return {
        "name": name,
        "qos": "guaranteed",
        "resources": {"cpus": 1, "memory": "256Mi"},
        "worker": {
            "command": [python, worker_visible(REPO / "examples" / "oip_worker.py"), "--port", str(port)],
            "readiness": {"http": {"port": port, "path": f"/v2/models/{MODEL}/ready"}, "period_seconds": 0.2},
            "restart": "on-failure",
            "stop_grace_seconds": 10,
        },
    }


def wait_for_phase(client: httpx.Client, slot_id: str, phase: str, timeout: float = 60) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        slot: dict[str, Any] = client.get(f"/v1/slots/{slot_id}").json()
        worker = slot.get("worker") or {}
        assert worker.get("phase") not in ("failed", "crashloop"), f"worker failed: {worker}"
        return slot if worker.get("phase") == phase else None

    return wait_until(f"slot {slot_id}'s worker to be {phase}", reached, timeout)  # type: ignore[no-any-return]


def proc_cgroups(pid: int) -> dict[str, str]:
    """controller -> cgroup path of ``pid`` ("" for the v2 hierarchy), from /proc/PID/cgroup."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
    return out


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def proc_status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {key}")


def check_confined(slot: dict[str, Any]) -> int:
    """The slot's worker is where the slot says, from the kernel's point of view; returns its pid."""
    pid = int(slot["worker"]["pid"])
    cpus = frozenset(slot["assignment"]["cpus"])
    mounts = controller_mounts()
    memberships = proc_cgroups(pid)
    v1 = "cpuset" in memberships
    for controller, mount in mounts.items():
        where = memberships[controller if v1 else ""]
        assert where == f"/{slot['cgroup']}", f"pid {pid} is in {where} for {controller or 'cgroup2'}"
        procs = (mount / slot["cgroup"] / "cgroup.procs").read_text().split()
        assert str(pid) in procs, f"pid {pid} not in the slot's {controller} cgroup.procs {procs}"
    cpuset_dir = mounts["cpuset"] / slot["cgroup"]
    assert parse_cpulist((cpuset_dir / "cpuset.cpus").read_text()) == cpus
    assert parse_cpulist(proc_status(pid, "Cpus_allowed_list")) == cpus
    limit_file = "memory.limit_in_bytes" if v1 else "memory.max"
    assert int((mounts["memory"] / slot["cgroup"] / limit_file).read_text()) == 256 << 20
    env = proc_environ(pid)
    assert env.get("NODEAGENT_SLOT_ID") == slot["id"]
    # Sandboxed by default: the slot's own uid (no capabilities), from the configured range.
    uid = int(proc_status(pid, "Uid").split()[0])
    assert 600000 <= uid <= 665535, f"worker {pid} runs as uid {uid}"
    assert slot["sandbox"] == {"uid": uid, "gid": uid}, slot["sandbox"]  # what the API says it is
    assert int(proc_status(pid, "CapEff"), 16) == 0
    assert proc_status(pid, "Seccomp") == "2"
    assert env.get("OMP_NUM_THREADS") == str(len(cpus)) == "1"
    return pid


def infer(port: int, host: str = "127.0.0.1") -> list[float]:
    body = {
        "id": "natest",
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, INPUT_WIDTH], "data": [0.5] * 2 * INPUT_WIDTH}
        ],
    }
    response = httpx.post(f"http://{host}:{port}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    assert output["shape"] == [2, 10]
    return list(output["data"])


# =========================================================================== the test


def test_allocate_isolate_serve_release(daemon: Daemon, worker_python: str) -> None:
    client = daemon.start()
    port = free_port()

    # (a) CLI: a guaranteed slot with the example worker.
    out = daemon.cli(
        "allocate", "--request", json.dumps(worker_request("natest-llm", port, worker_python)), "--json"
    )
    guaranteed = json.loads(out)
    assert (guaranteed["state"], guaranteed["assignment"]["exclusive"]) in (
        ("ready", True),
        ("running", True),
    )
    daemon.remember(guaranteed)
    guaranteed = wait_for_phase(client, guaranteed["id"], "running")
    daemon.remember(guaranteed)
    first_pid = check_confined(guaranteed)
    outputs = infer(port)
    assert outputs == infer(port), "the seeded model must answer the same input the same way"
    logs = daemon.cli("logs", guaranteed["id"])
    assert f"serving model '{MODEL}'" in logs
    assert "1 BLAS threads" in logs
    shown = daemon.cli("show", "natest-llm")
    assert f"  worker    running (pid {first_pid}, 0 restarts)" in shown.splitlines()

    assert "stopped" in daemon.cli("stop", guaranteed["id"], "--wait", "--timeout", "30")
    wait_until(f"the stopped worker {first_pid} to end", lambda: process_gone(first_pid))
    assert "running" in daemon.cli("start", guaranteed["id"], "--wait", "--timeout", "60")
    guaranteed = client.get(f"/v1/slots/{guaranteed['id']}").json()
    daemon.remember(guaranteed)
    second_pid = check_confined(guaranteed)
    assert second_pid != first_pid
    assert infer(port) == outputs

    # (b) REST: a burstable slot in its own network namespace runs on the pool, not on the exclusive CPU,
    # and its worker, listening inside the namespace, is probed and served through the slot's address.
    web_port = free_port()
    web = worker_request("natest-web", web_port, worker_python)
    web["qos"] = "burstable"
    web["resources"] = {"cpus": 0.5, "memory": "256Mi", "network": {}}
    response = client.post("/v1/slots", json=web)
    assert response.status_code == 201, response.text
    burstable = wait_for_phase(client, response.json()["id"], "running")
    daemon.remember(burstable)
    slot_address = burstable["network"]["slot_address"]
    # Default-deny is on (the slot may reach nothing), and still the agent's probes reached the
    # worker (it is running) and so does a client on the host.
    assert burstable["network"]["filtered"] is True
    assert burstable["network"]["access"] == {"egress": "none", "host_ports": []}
    assert our_firewall_table()
    assert infer(web_port, slot_address) == outputs
    with pytest.raises(httpx.ConnectError):
        infer(web_port)  # nothing listens on the host's loopback: the worker is in its own netns
    assert burstable["assignment"]["exclusive"] is False
    pool = parse_cpulist((controller_mounts()["cpuset"] / burstable["cgroup"] / "cpuset.cpus").read_text())
    assert pool, "the burstable slot's cpuset is empty"
    assert not pool & set(guaranteed["assignment"]["cpus"]), "the shared pool includes the exclusive CPU"
    assert our_netns() == [f"{NETNS_PREFIX}{burstable['id']}"]
    assert len(our_veths()) == 1

    # (c) release through both, and nothing may remain.
    assert daemon.cli("release", "natest-llm") == "released natest-llm\n"
    assert client.delete(f"/v1/slots/{burstable['id']}").status_code == 204
    assert client.get("/v1/slots").json()["slots"] == []
    assert slot_cgroup_dirs() == []
    for pid in daemon.worker_pids:
        wait_until(f"worker {pid} to be gone", lambda p=pid: process_gone(p), timeout=10)
    assert our_netns() == []
    assert our_veths() == []
    client.close()
    assert daemon.stop() == 0, daemon.log_path.read_text()[-3000:]


#: A worker that says, twice a second, the CPUs each of its threads may run on, as it sees them.
AFFINITY_REPORTER = """
import os, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
while True:
    cpus = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
    print("affinity", sorted(cpus), flush=True)
    time.sleep(0.5)
"""


def reported_affinity(daemon: Daemon, slot_id: str) -> str:
    lines = [line for line in daemon.cli("logs", slot_id).splitlines() if line.startswith("affinity ")]
    return lines[-1] if lines else ""


def test_a_worker_sees_every_change_of_its_slots_cpus(daemon: Daemon, worker_python: str) -> None:
    """From inside the worker (its own sched_getaffinity, every thread): a resize of a guaranteed
    slot, and the pool a burstable slot runs on growing when an exclusive slot leaves."""
    client = daemon.start()
    worker = {"command": [worker_python, "-c", AFFINITY_REPORTER]}
    exclusive = client.post(
        "/v1/slots",
        json={
            "name": "natest-g",
            "qos": "guaranteed",
            "resources": {"cpus": 1, "memory": "64Mi"},
            "worker": worker,
        },
    )
    assert exclusive.status_code == 201, exclusive.text
    g = exclusive.json()
    (cpu,) = g["assignment"]["cpus"]
    wait_until(
        "the worker's first report", lambda: reported_affinity(daemon, g["id"]) == f"affinity [({cpu},)]"
    )
    resized = client.patch(f"/v1/slots/{g['id']}", json={"resources": {"cpus": 2}})
    assert resized.status_code == 200, resized.text
    assert sorted(resized.json()["assignment"]["cpus"]) == [0, 1]
    wait_until(
        "the resize to reach every thread", lambda: reported_affinity(daemon, g["id"]) == "affinity [(0, 1)]"
    )
    resized = client.patch(f"/v1/slots/{g['id']}", json={"resources": {"cpus": 1}})
    assert resized.status_code == 200, resized.text
    (cpu,) = resized.json()["assignment"]["cpus"]
    free = 1 - cpu

    shared = client.post(
        "/v1/slots",
        json={
            "name": "natest-b",
            "qos": "burstable",
            "resources": {"cpus": 0.5, "memory": "64Mi"},
            "worker": worker,
        },
    )
    assert shared.status_code == 201, shared.text
    b = shared.json()
    wait_until(
        "the burstable worker's report", lambda: reported_affinity(daemon, b["id"]) == f"affinity [({free},)]"
    )
    assert client.delete(f"/v1/slots/{g['id']}").status_code == 204
    wait_until(
        "the pool's growth to reach every thread",
        lambda: reported_affinity(daemon, b["id"]) == "affinity [(0, 1)]",
    )
    assert client.delete(f"/v1/slots/{b['id']}").status_code == 204
    client.close()
    assert daemon.stop() == 0, daemon.log_tail()


def uninstall(daemon: Daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [*nodeagent_argv(), "uninstall", "--config", str(daemon.config), "--state-dir", str(daemon.state)]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=120, check=False)


def test_uninstall_refuses_while_the_agent_runs_or_slots_exist_then_hands_the_host_back(
    daemon: Daemon,
) -> None:
    client = daemon.start()
    request = {
        "name": "natest-left",
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "32Mi", "network": {}},
        "worker": {"command": ["/bin/sleep", "600"]},
    }
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, created.text
    slot = wait_for_phase(client, created.json()["id"], "running")
    daemon.remember(slot)
    worker = int(slot["worker"]["pid"])

    running = uninstall(daemon)
    assert running.returncode == 1
    assert "another nodeagent" in running.stderr
    assert "stop it first" in running.stderr

    client.close()
    assert daemon.stop() == 0, daemon.log_tail()
    refused = uninstall(daemon)
    assert refused.returncode == 1
    assert f"natest-left ({slot['id']})" in refused.stderr
    assert "--release-slots" in refused.stderr
    assert not process_gone(worker), "a refused uninstall must not touch the slot"
    assert our_firewall_table()
    assert our_netns()
    assert slot_cgroup_dirs()

    done = uninstall(daemon, "--release-slots")
    assert done.returncode == 0, done.stderr
    assert f"released slots: {slot['id']}" in done.stdout
    assert "stopped the host keeper" in done.stdout
    assert f"removed the cgroup parent {PARENT}" in done.stdout
    assert f"removed the nftables table inet {FIREWALL_TABLE}" in done.stdout
    wait_until("the slot's worker to be gone", lambda: process_gone(worker), timeout=10)
    assert not parent_dirs()
    assert not our_firewall_table()
    assert our_netns() == []
    assert our_veths() == []
    assert keeper_status(daemon.keeper_dir) is None

    again = uninstall(daemon, "--json")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert (report["released"], report["cgroup_parent"], report["firewall_table"], report["keeper_pid"]) == (
        [],
        None,
        None,
        None,
    )
    restarted = daemon.start()
    assert restarted.get("/v1/slots").json()["slots"] == []  # the slot left the database too
    restarted.close()
    # An agent that died leaves its rules for slots without a network: uninstall removes them.
    daemon.kill()
    after_crash = uninstall(daemon)
    assert after_crash.returncode == 0, after_crash.stderr
    assert f"removed nftables table inet {FIREWALL_TABLE}_host" in after_crash.stdout
