"""Container workers on pure cgroup v2, through a real ``nodeagent serve``, podman and its default
OCI runtime (collected only inside the VM, NODEAGENT_IN_CGROUP2_VM=1).

v2 allows no process in a cgroup whose controllers are enabled for its children, so the slot's
worker (podman) runs in the leaf ``<slot>/worker`` and the container (and conmon) below
``<slot>/containers``: the slot's own cgroup holds no process, its cpuset, memory and pids limits
and its device program bound everything below it, its memory.events counts the container's OOM
kills, the keeper ends what podman leaves behind when podman dies, the agent re-adopts the worker
after a SIGKILL, and release leaves nothing.

podman's storage: the guest's root is an overlay, on which podman's overlay driver refuses to
work ("'overlay' is not supported over overlayfs"); the module mounts a tmpfs on
/var/lib/containers for its run (the graph root the agent's podman uses too) and unmounts it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import bpf, detect
from nodeagent.runtime.container import CONTAINERS_CGROUP, WORKER_CGROUP, container_name
from tests.containers import (
    ALLOWED,
    OTHER,
    build_image,
    container_daemon,
    device_httpd_request,
    has_container,
    missing_for_containers,
    remove_image,
)
from tests.daemon import DaemonProcess, free_port, wait_until
from tests.runtime.test_container_kernel import OPEN_IN_CGROUP, container_pid, wait_for_phase

pytestmark = [pytest.mark.slow]

ROOT = Path("/sys/fs/cgroup")
PID = os.getpid()
ISOLATION = {
    "cgroup_parent": f"natest{PID}c2.slice",
    "netns_prefix": f"nc{PID}-",
    "firewall_table": f"natest{PID}c2",
    "host_partitioning": "off",
}
CDI = {"dir": "/var/run/cdi", "prefix": f"natest{PID}c2-"}
STORAGE = Path("/var/lib/containers")
RUN_STATE = (Path("/run/containers"), Path("/run/libpod"))
#: Everything is 10-15x slower in the VM than on a host.
SLOW = 240.0


def _needs() -> str | None:
    if detect().mode != "v2":
        return "needs a pure cgroup v2 host"
    return missing_for_containers()


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    why = _needs()
    if why:
        pytest.skip(why)
    made = [path for path in RUN_STATE if not path.exists()]
    STORAGE.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(STORAGE)], check=True)
    try:
        tag = build_image(f"localhost/natest-busybox:{PID}")
        yield tag
        remove_image(tag)
    finally:
        if subprocess.run(["umount", "-R", str(STORAGE)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-R", "-l", str(STORAGE)], check=True)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path: Path, image: str) -> Iterator[DaemonProcess]:
    with container_daemon(tmp_path, ISOLATION, CDI) as d:
        yield d


def cgroup_of(pid: int) -> str:
    """The v2 cgroup of ``pid`` as the root's cgroup namespace sees it."""
    line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if x.startswith("0::"))
    return line[3:]


def tasks_in(cgroup: str) -> dict[int, str]:
    """pid -> cgroup of every process in ``cgroup`` or below it."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                path = cgroup_of(int(entry))
            except (OSError, StopIteration):
                continue
            if path == f"/{cgroup}" or path.startswith(f"/{cgroup}/"):
                found[int(entry)] = path
    return found


def opens_from(cgroup: str, *paths: str) -> list[str]:
    """Open each device from a process in ``cgroup`` (its device programs and its ancestors')."""
    probe = subprocess.run(
        [sys.executable, "-c", OPEN_IN_CGROUP, str(ROOT / cgroup.lstrip("/") / "cgroup.procs"), *paths],
        capture_output=True,
        text=True,
        check=True,
    )
    return probe.stdout.split("\n")[: len(paths)]


def test_a_v2_container_worker_lives_below_its_slot_and_leaves_nothing(
    daemon: DaemonProcess, image: str
) -> None:
    client = daemon.start(timeout=SLOW)
    port = free_port()
    request = device_httpd_request(image, port, period=0.5, grace=10)
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, (created.text, daemon.log_tail())
    slot = wait_for_phase(client, "ctr", "running", "failed", timeout=SLOW)
    assert slot["worker"]["phase"] == "running", client.get("/v1/slots/ctr/logs").json()
    slot_id, cgroup = slot["id"], slot["cgroup"]
    assert "device-ok" in client.get("/v1/slots/ctr/logs").json()["lines"]

    # The layout: podman (the worker) in <slot>/worker, the container and conmon below
    # <slot>/containers, nothing in the slot's own cgroup, whose controllers reach its children.
    pid = container_pid(slot_id)
    worker_pid = slot["worker"]["pid"]
    assert cgroup_of(worker_pid) == f"/{cgroup}/{WORKER_CGROUP}"
    assert cgroup_of(pid).startswith(f"/{cgroup}/{CONTAINERS_CGROUP}/"), cgroup_of(pid)
    slot_dir = ROOT / cgroup
    assert (slot_dir / "cgroup.procs").read_text() == ""
    assert {"cpuset", "memory", "pids"} <= set((slot_dir / "cgroup.subtree_control").read_text().split())
    tasks = tasks_in(cgroup)
    assert pid in tasks
    assert worker_pid in tasks
    comms = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in tasks}
    conmon = [p for p, comm in comms.items() if comm == "conmon"]
    assert conmon, comms
    # Every process of the worker is in the leaf or below <slot>/containers; conmon stays in
    # podman's leaf (podman 4.3 makes <slot>/containers/conmon but leaves it empty on v2).
    leaf, below = f"/{cgroup}/{WORKER_CGROUP}", f"/{cgroup}/{CONTAINERS_CGROUP}/"
    assert all(path == leaf or path.startswith(below) for path in tasks.values()), tasks
    status = Path(f"/proc/{pid}/status").read_text()
    allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    assert allowed == ",".join(str(c) for c in slot["assignment"]["cpus"])

    # Devices: the slot's program is attached with BPF_F_ALLOW_MULTI, so it still runs for the
    # cgroups below it, where the OCI runtime attached its own (both must allow an open).
    flags, programs = bpf.query(slot_dir)
    assert flags & bpf.BPF_F_ALLOW_MULTI
    assert len(programs) == 1
    assert bpf.query(ROOT / cgroup_of(pid).lstrip("/"))[1]  # the runtime's own program
    assert opens_from(cgroup_of(pid), ALLOWED, OTHER) == [f"{ALLOWED} ok", f"{OTHER} 1"]  # EPERM
    # From the worker's leaf, where no program of the runtime's is: the slot's alone refuses it.
    assert opens_from(f"/{cgroup}/{WORKER_CGROUP}", OTHER) == [f"{OTHER} 1"]

    # The slot's memory limit holds the container, and its memory.events counts the kill below it.
    assert (slot_dir / "memory.max").read_text().strip() == str(256 << 20)
    hog = subprocess.run(
        ["podman", "exec", container_name(slot_id), "awk", 'BEGIN { s = "x"; while (1) s = s s }'],
        capture_output=True,
        timeout=SLOW,
        check=False,
    )
    assert hog.returncode == 137
    events = dict(line.split() for line in (slot_dir / "memory.events").read_text().splitlines())
    assert int(events["oom_kill"]) >= 1
    # The kernel charges in batches and may overshoot memory.max by up to one batch (64 pages)
    # before it reclaims or kills: seen once, one page over. The hog alone would take gigabytes.
    assert int((slot_dir / "memory.peak").read_text()) <= (256 << 20) + 64 * os.sysconf("SC_PAGE_SIZE")
    # The kernel chose the hog, not podman or the server: the worker ran on.
    slot = wait_for_phase(client, "ctr", "running", timeout=SLOW)
    assert slot["worker"]["pid"] == worker_pid, (slot["worker"], daemon.log_tail())
    assert container_pid(slot_id) == pid

    # SIGKILL the agent: the worker runs on, and the next agent re-adopts it (same processes).
    daemon.kill()
    client.close()
    client = daemon.start(timeout=SLOW)
    slot = wait_for_phase(client, "ctr", "running", timeout=SLOW)
    assert slot["worker"]["pid"] == worker_pid, (slot["worker"], daemon.log_tail())
    assert container_pid(slot_id) == pid

    # SIGKILL podman: the keeper ends what it left in <slot>/containers (the container, conmon)
    # before recording the exit, and the restart policy starts a new container in the same layout.
    os.kill(worker_pid, signal.SIGKILL)

    def restarted() -> int | None:
        current = client.get("/v1/slots/ctr").json()["worker"]
        return current["pid"] if current["phase"] == "running" and current["pid"] != worker_pid else None

    new_worker = wait_until("the container worker's restart", restarted, SLOW)
    assert pid not in tasks_in(cgroup)
    new_pid = container_pid(slot_id)
    assert new_pid != pid
    assert cgroup_of(new_worker) == f"/{cgroup}/{WORKER_CGROUP}"
    assert cgroup_of(new_pid).startswith(f"/{cgroup}/{CONTAINERS_CGROUP}/")

    # Release: the container is stopped and removed; no process, no cgroup, no CDI spec is left.
    assert client.delete("/v1/slots/ctr").status_code == 204
    assert not has_container(slot_id)
    assert tasks_in(cgroup) == {}
    assert not slot_dir.exists()
    assert not Path(CDI["dir"], f"{CDI['prefix']}{slot_id}.json").exists()
    client.close()


def test_a_command_worker_put_into_a_v2_container_slot_runs_in_its_leaf(
    daemon: DaemonProcess, image: str
) -> None:
    # Once the slot's controllers reach its children, its own cgroup refuses processes (EBUSY): a
    # command worker that replaces the container goes into the same leaf.
    client = daemon.start(timeout=SLOW)
    request = {
        "name": "swap",
        "qos": "burstable",
        "resources": {"cpus": 0.5, "memory": "128Mi"},
        "worker": {"container": {"image": image, "command": ["/bin/sleep", "3600"]}, "stop_grace_seconds": 5},
    }
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, (created.text, daemon.log_tail())
    slot = wait_for_phase(client, "swap", "running", "failed", timeout=SLOW)
    assert slot["worker"]["phase"] == "running", client.get("/v1/slots/swap/logs").json()
    container_pid(slot["id"])
    assert client.delete("/v1/slots/swap/worker").status_code == 200
    wait_for_phase(client, "swap", "stopped", "failed", timeout=SLOW)
    replaced = client.post("/v1/slots/swap/worker", json={"command": ["sleep", "3600"]})
    assert replaced.status_code == 200, replaced.text

    def command_running() -> dict[str, object] | None:
        worker: dict[str, object] = client.get("/v1/slots/swap").json()["worker"]
        return worker if worker["phase"] == "running" and worker.get("pid") != slot["worker"]["pid"] else None

    worker = wait_until("the command worker", command_running, SLOW)
    assert isinstance(worker["pid"], int)
    assert cgroup_of(worker["pid"]) == f"/{slot['cgroup']}/{WORKER_CGROUP}"
    assert client.delete("/v1/slots/swap").status_code == 204
    assert tasks_in(slot["cgroup"]) == {}
    client.close()
