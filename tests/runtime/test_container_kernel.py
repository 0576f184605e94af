"""Container workers on this kernel, through a real ``nodeagent serve``, podman and runc: a
container in a guaranteed slot with one allowed device lives in the slot's cgroups and on its CPUs,
opens the device named through the slot's CDI spec and is refused another, is held to the slot's
memory limit, is re-adopted after the agent is SIGKILLed, and leaves nothing behind on release.

podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi, so these agents write theirs into
/var/run/cdi under a file prefix of their own (removed at the end, like every other object).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from nodeagent.cpulist import format_cpulist
from nodeagent.runtime.container import container_name
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
from tests.isolation.cdi_schema import cdi_schema

pytestmark = [pytest.mark.root, pytest.mark.slow]

PID = os.getpid()
ISOLATION = {
    "cgroup_parent": f"natest{PID}ct.slice",
    "netns_prefix": f"nc{PID}-",
    "firewall_table": f"natest{PID}ct",
    "host_partitioning": "off",
}
CDI = {"dir": "/var/run/cdi", "prefix": f"natest{PID}ct-"}


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    why = "needs root" if os.geteuid() != 0 else missing_for_containers()
    if why:
        pytest.skip(why)
    tag = build_image(f"localhost/natest-busybox:{PID}")
    yield tag
    remove_image(tag)


@pytest.fixture
def daemon(tmp_path: Path, image: str) -> Iterator[DaemonProcess]:
    with container_daemon(tmp_path, ISOLATION, CDI) as d:
        yield d


def wait_for_phase(client: httpx.Client, name: str, *phases: str, timeout: float = 60.0) -> dict[str, Any]:
    def arrived() -> dict[str, Any] | None:
        slot: dict[str, Any] = client.get(f"/v1/slots/{name}").json()
        return slot if (slot.get("worker") or {}).get("phase") in phases else None

    result: dict[str, Any] = wait_until(f"worker of {name} to be {'/'.join(phases)}", arrived, timeout)
    return result


def container_pid(slot_id: str) -> int:
    """The container's main process (its init), once podman has started it."""

    def started() -> int:
        done = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Pid}}", container_name(slot_id)],
            capture_output=True,
            text=True,
            check=False,
        )
        return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else 0

    found: int = wait_until(f"container {container_name(slot_id)} to run", started, 30)
    return found


def cgroups_of(pid: int) -> dict[str, str]:
    """controller -> path, from /proc/PID/cgroup (v1 lines; the v2 line keyed '')."""
    paths = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") or [""]:
            paths[controller] = path
    return paths


def tasks_under(cgroup: str) -> list[int]:
    """Every process whose memory cgroup is the slot's or below it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if cgroups_of(int(entry)).get("memory", "").startswith(f"/{cgroup}"):
                    found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


OPEN_IN_CGROUP = """
import os, sys
with open(sys.argv[1], "w") as procs:
    procs.write(str(os.getpid()))
for path in sys.argv[2:]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        print(path, "ok")
    except OSError as err:
        print(path, err.errno)
"""


def test_a_container_worker_lives_in_its_slot_and_leaves_nothing(daemon: DaemonProcess, image: str) -> None:
    client = daemon.start()
    port = free_port()
    request = device_httpd_request(image, port, period=0.2, grace=5)
    created = client.post("/v1/slots", json=request)
    assert created.status_code == 201, created.text
    slot = wait_for_phase(client, "ctr", "running", "failed")
    assert slot["worker"]["phase"] == "running", client.get("/v1/slots/ctr/logs").json()
    slot_id, cgroup = slot["id"], slot["cgroup"]

    # The slot's CDI spec is valid, is where podman reads it, and podman consumed it: the device
    # it names opened inside the container, and the slot's wiring is in the container's env.
    spec = client.get("/v1/slots/ctr/cdi").json()
    jsonschema.validate(spec, cdi_schema(spec["cdiVersion"]))
    assert json.loads(Path(CDI["dir"], f"{CDI['prefix']}{slot_id}.json").read_text()) == spec
    logs = client.get("/v1/slots/ctr/logs").json()["lines"]
    assert "device-ok" in logs, logs
    pid = container_pid(slot_id)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"NODEAGENT_SLOT_ID={slot_id}".encode() in environ
    assert b"OMP_NUM_THREADS=1" in environ
    described = subprocess.run(
        ["podman", "exec", container_name(slot_id), "cat", "/run/nodeagent/slot.json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(described.stdout)["slot_id"] == slot_id  # the slot file, readable by the slot's uid
    # The device opened as the slot's uid although the host's node may be root's 0600: the runtime
    # made the container's node for the container's user; the host's node is unchanged.
    host_node = os.stat(ALLOWED)
    uid = int(
        next(
            line.split()[1]
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Uid:")
        )
    )
    inside = subprocess.run(
        ["podman", "exec", container_name(slot_id), "ls", "-ln", ALLOWED],
        capture_output=True,
        text=True,
        check=True,
    )
    assert uid != 0
    assert int(inside.stdout.split()[2]) == uid, inside.stdout
    after = os.stat(ALLOWED)
    assert (after.st_mode, after.st_uid, after.st_gid) == (
        host_node.st_mode,
        host_node.st_uid,
        host_node.st_gid,
    )

    # Its processes are in cgroups below the slot's, in every hierarchy, and on the slot's CPU.
    paths = cgroups_of(pid)
    for controller in ("cpuset", "memory", "pids", "devices", "cpu", "freezer"):
        assert paths[controller].startswith(f"/{cgroup}/"), (controller, paths[controller])
    status = Path(f"/proc/{pid}/status").read_text()
    allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    assert allowed == ",".join(str(c) for c in slot["assignment"]["cpus"])

    # The container's device cgroup: the slot's device opens, another is refused by the kernel.
    devices_procs = Path("/sys/fs/cgroup/devices", paths["devices"].lstrip("/"), "cgroup.procs")
    probe = subprocess.run(
        [sys.executable, "-c", OPEN_IN_CGROUP, str(devices_procs), ALLOWED, OTHER],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split("\n")[:2] == [f"{ALLOWED} ok", f"{OTHER} 1"]  # EPERM

    # The slot's memory limit holds the container: a process growing past it is OOM-killed.
    limit = int(Path("/sys/fs/cgroup/memory", cgroup, "memory.limit_in_bytes").read_text())
    assert limit == 256 << 20
    hog = subprocess.run(
        ["podman", "exec", container_name(slot_id), "awk", 'BEGIN { s = "x"; while (1) s = s s }'],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert hog.returncode == 137
    # On v1 the kill is counted in the container's own memory cgroup (the victim's), not the slot's.
    kills = 0
    for oom_control in Path("/sys/fs/cgroup/memory", cgroup).rglob("memory.oom_control"):
        kills += int(oom_control.read_text().split("oom_kill ")[1].split()[0])
    assert kills >= 1
    assert int(Path("/sys/fs/cgroup/memory", cgroup, "memory.max_usage_in_bytes").read_text()) <= limit

    # SIGKILL the agent: the worker runs on, and the next agent re-adopts it (same process).
    slot = wait_for_phase(client, "ctr", "running")
    worker_pid = slot["worker"]["pid"]
    daemon.kill()
    client.close()
    client = daemon.start()
    slot = wait_for_phase(client, "ctr", "running")
    assert slot["worker"]["pid"] == worker_pid
    assert container_pid(slot_id) == pid

    # Release: the container is stopped and removed; no conmon, no container process, no cgroup,
    # no CDI spec is left.
    assert client.delete("/v1/slots/ctr").status_code == 204
    assert not has_container(slot_id)
    assert tasks_under(cgroup) == []
    assert not Path("/sys/fs/cgroup/memory", cgroup).exists()
    assert not Path(CDI["dir"], f"{CDI['prefix']}{slot_id}.json").exists()
    client.close()


def test_a_missing_image_fails_the_worker_at_once(daemon: DaemonProcess) -> None:
    client = daemon.start()
    request = {
        "name": "noimage",
        "qos": "burstable",
        "resources": {"cpus": 0.2, "memory": "128Mi"},
        "worker": {"container": {"image": f"localhost/natest-absent:{PID}"}},
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    worker = wait_for_phase(client, "noimage", "failed", "backoff", "crashloop", timeout=30)["worker"]
    assert worker["phase"] == "failed"  # not a crash loop
    assert worker["restarts"] == 0
    assert "is not in this host's local storage" in worker["message"]
    assert client.delete("/v1/slots/noimage").status_code == 204
    client.close()


def test_a_shared_container_slot_follows_the_pool_when_it_shrinks(daemon: DaemonProcess, image: str) -> None:
    # runc copies the slot's CPUs into the container's cpuset; v1 refuses to cut the slot's below
    # that (EBUSY), so an exclusive slot allocated next would fail unless the container follows.
    client = daemon.start()
    request = {
        "name": "shared",
        "qos": "burstable",
        "resources": {"cpus": 0.5, "memory": "256Mi"},
        "worker": {"container": {"image": image, "command": ["/bin/sleep", "3600"]}},
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    slot_id = wait_for_phase(client, "shared", "running")["id"]
    pid = container_pid(slot_id)  # its cgroups exist below the slot's now
    guaranteed = {"name": "exclusive", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi"}}
    created = client.post("/v1/slots", json=guaranteed)
    assert created.status_code == 201, created.text
    taken = set(created.json()["assignment"]["cpus"])
    assert taken
    status = Path(f"/proc/{pid}/status").read_text()
    allowed = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    assert not {int(c) for c in allowed.replace("-", ",").split(",")} & taken
    # ... and grows back with the pool once the exclusive slot is gone, threads included.
    assert client.delete("/v1/slots/exclusive").status_code == 204
    pool = client.get(f"/v1/slots/{slot_id}").json()["assignment"]["cpus"]
    wanted = format_cpulist(frozenset(pool))
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        allowed = next(
            line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
        )
        assert allowed == wanted, f"task {task.name} of the container runs on {allowed}, the pool is {wanted}"
    assert client.delete("/v1/slots/shared").status_code == 204
    client.close()


def test_a_container_in_a_slot_with_a_network_is_in_its_namespace(daemon: DaemonProcess, image: str) -> None:
    client = daemon.start()
    port = free_port()
    request = {
        "name": "net",
        "qos": "guaranteed",
        "resources": {"cpus": 1, "memory": "256Mi", "network": {}},
        "worker": {
            "container": {"image": image, "command": ["/bin/httpd", "-f", "-p", str(port), "-h", "/www"]},
            # Probes connect to the slot's address: passing proves the server is in the slot's netns.
            "readiness": {"http": {"port": port, "path": "/ready"}, "period_seconds": 0.2},
        },
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    slot = wait_for_phase(client, "net", "running", "failed")
    assert slot["worker"]["phase"] == "running", client.get("/v1/slots/net/logs").json()
    netns = os.stat(slot["network"]["netns_path"])
    inside = os.stat(f"/proc/{container_pid(slot['id'])}/ns/net")
    assert (inside.st_dev, inside.st_ino) == (netns.st_dev, netns.st_ino)
    assert client.delete("/v1/slots/net").status_code == 204
    client.close()


def test_exec_probes_run_inside_and_stopping_is_graceful(daemon: DaemonProcess, image: str) -> None:
    # SIGTERM to podman reaches the server inside (podman's sig-proxy, then the container's init),
    # which exits in its own time, within the grace: a stop, not a kill.
    client = daemon.start()
    script = "trap 'echo got-term; exit 0' TERM; echo up; while true; do sleep 0.1; done"
    request = {
        "name": "graceful",
        "qos": "burstable",
        "resources": {"cpus": 0.5, "memory": "256Mi"},
        "worker": {
            "container": {"image": image, "command": ["/bin/sh", "-c", script]},
            # An exec probe runs inside the container (podman exec): the file is the image's.
            "readiness": {
                "exec": {"argv": ["cat", "/www/ready"]},
                "period_seconds": 0.2,
                "timeout_seconds": 10,
            },
            "stop_grace_seconds": 30,
        },
    }
    assert client.post("/v1/slots", json=request).status_code == 201
    slot_id = wait_for_phase(client, "graceful", "running")["id"]
    container_pid(slot_id)
    wait_until(
        "the worker's first line", lambda: "up" in client.get("/v1/slots/graceful/logs").json()["lines"]
    )
    assert client.delete("/v1/slots/graceful/worker").status_code == 200
    worker = wait_for_phase(client, "graceful", "stopped")["worker"]
    assert worker["last_exit"]["code"] == 0, worker
    assert "got-term" in client.get("/v1/slots/graceful/logs").json()["lines"]
    assert client.delete("/v1/slots/graceful").status_code == 204
    client.close()


def test_a_container_of_a_slot_nobody_knows_is_removed_at_start(daemon: DaemonProcess, image: str) -> None:
    """A worker directory left by a slot that is in no record (a crash between its removal from the
    database and its directory's) is reaped at start; its container, if podman still holds one, goes
    with it, found by asking podman once, not by a file beside the worker."""
    leftover = "s0123456789ab"
    name = container_name(leftover)
    subprocess.run(["podman", "create", "--name", name, image, "true"], capture_output=True, check=True)
    try:
        (daemon.state / "workers" / leftover).mkdir(parents=True)
        daemon.start().close()
        assert not has_container(leftover)
        assert not (daemon.state / "workers" / leftover).exists()
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", name], capture_output=True, check=False)
