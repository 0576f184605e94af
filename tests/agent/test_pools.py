"""Warm standby pools through a real ``nodeagent serve`` (docs/pools.md): standbys started, ready and
frozen in burstable cgroups; a claim that gets an exclusive core, a thawed worker that serves at
once, and a refill; refusals that name the problem; a standby killed while frozen replaced; an
agent SIGKILL that neither thaws nor duplicates them; the memory they hold given up to an
allocate that needs it; a cold fallback; and a deleted pool leaving nothing behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import HOST_OFF, DaemonProcess, remove_daemon_objects, wait_until

pytestmark = [pytest.mark.root]

PARENT = f"natest{os.getpid()}w.slice"
ISOLATION = {
    "cgroup_parent": PARENT,
    "netns_prefix": f"nw{os.getpid()}-",
    "firewall_table": f"natest{os.getpid()}w",
}
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The pure-v2 VM (tests/agent/v2vm) runs the same tests on a much slower machine.
STARTUP = 180.0 if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else 30.0
#: Outside the test's virtualenv: a sandboxed worker runs as its slot's own uid.
PYTHON = "/usr/bin/python3"
SPEC: dict[str, Any] = {
    "name": "web",
    "size": 2,
    "slot": {
        "qos": "guaranteed",
        "resources": {"cpus": 1, "memory": "128Mi"},
        "worker": {
            "command": [PYTHON, "-m", "http.server", "--bind", "127.0.0.1", "{port:http}"],
            "ports": {"http": {}},
            "readiness": {"http": {"port": "http", "path": "/"}},
            "stop_grace_seconds": 2,
        },
    },
}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    toml = "[isolation]\n" + "".join(f'{k} = "{v}"\n' for k, v in ISOLATION.items())
    d = DaemonProcess(tmp_path, toml)
    yield d
    d.stop()
    d.stop_keeper()
    remove_daemon_objects(d, {**ISOLATION, **HOST_OFF})


def frozen(cgroup: str) -> bool:
    v1 = CGROUP_ROOT / "freezer" / cgroup / "freezer.state"
    if v1.exists():
        return v1.read_text().strip() != "THAWED"
    return (CGROUP_ROOT / cgroup / "cgroup.freeze").read_text().strip() == "1"


def procs(cgroup: str) -> set[int]:
    for hierarchy in ("cpuset", "pids", ""):
        path = CGROUP_ROOT / hierarchy / cgroup / "cgroup.procs"
        if path.exists():
            return {int(line) for line in path.read_text().split()}
    raise AssertionError(f"no cgroup {cgroup}")


def cgroup_exists(cgroup: str) -> bool:
    return (
        any((root / cgroup).exists() for root in CGROUP_ROOT.iterdir() if root.is_dir())
        or (CGROUP_ROOT / cgroup).exists()
    )


def standbys(client: httpx.Client) -> list[dict[str, Any]]:
    return [s for s in client.get("/v1/slots", params={"standby": "true"}).json()["slots"] if s["pool"]]


def wait_ready(client: httpx.Client, count: int, timeout: float = 2 * STARTUP) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pool = client.get("/v1/pools/web").json()
        return pool if pool["ready"] == count and pool["starting"] == 0 else None

    return wait_until(f"pool web with {count} frozen standbys", ready, timeout)


def serves(endpoint: dict[str, Any]) -> bool:
    return httpx.get(f"http://{endpoint['address']}:{endpoint['port']}/", timeout=5).status_code == 200


def test_standbys_frozen_then_claimed_onto_an_exclusive_core_and_refilled(daemon: DaemonProcess) -> None:
    client = daemon.start(timeout=STARTUP)
    created = client.post("/v1/pools", json=SPEC)
    assert created.status_code == 201, created.text
    assert client.post("/v1/pools", json=SPEC).status_code == 200  # the same pool again
    other = client.post("/v1/pools", json={**SPEC, "size": 3})
    assert other.status_code == 409
    assert "PATCH" in other.json()["error"]["message"]
    wait_ready(client, 2)

    waiting = standbys(client)
    assert len(waiting) == 2
    for slot in waiting:
        assert slot["state"] == "standby"
        assert slot["qos"] == "burstable"
        assert frozen(slot["cgroup"]), "a ready standby is frozen"
        assert "/burstable/" in f"/{slot['cgroup']}/", "a standby waits on the shared pool, not on a core"
    held = client.get("/v1/capacity").json()["standby"]
    assert held == {"slots": 2, "frozen": 2, "memory_bytes": 2 * 128 * 2**20}
    scraped = {
        sample.labels["resource"]: sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        if family.name == "nodeagent_standby"
        for sample in family.samples
    }
    assert scraped == {"slots": 2, "frozen": 2, "memory_bytes": 2 * 128 * 2**20}
    assert [s["name"] for s in client.get("/v1/slots").json()["slots"]] == []  # standbys are no one's

    claimed = client.post("/v1/slots", json={"name": "a", "pool": "web"})
    assert claimed.status_code == 201, claimed.text
    slot = claimed.json()
    taken = next(s for s in waiting if s["id"] == slot["id"])
    assert slot["name"] == "a"
    assert slot["pool"] is None
    assert slot["state"] == "running"
    assert slot["qos"] == "guaranteed"
    assert slot["assignment"]["exclusive"]
    assert slot["cgroup"] != taken["cgroup"]
    assert "burstable" not in slot["cgroup"]
    assert not cgroup_exists(taken["cgroup"]), "the standby's burstable cgroup went"
    assert not frozen(slot["cgroup"])
    pid = slot["worker"]["pid"]
    assert pid in procs(slot["cgroup"])
    cpus = {int(c) for c in slot["assignment"]["cpus"]}
    allowed = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if "Cpus_allowed_list" in line
    )
    assert allowed.split(":")[1].strip() == ",".join(str(c) for c in sorted(cpus))
    assert serves(slot["endpoints"][0]), "the thawed worker answers at once"
    assert slot["endpoints"] == taken["endpoints"], "the slot serves where its standby listened"
    assert client.post("/v1/slots", json={"name": "a", "pool": "web"}).status_code == 200  # idempotent

    pool = wait_ready(client, 2)  # refilled in the background
    assert pool["claims"] == 1
    assert slot["id"] not in {s["id"] for s in pool["standbys"]}

    # The released slot's worker never goes back to the pool.
    assert client.delete("/v1/slots/a").status_code == 204
    assert {s["id"] for s in standbys(client)} == {s["id"] for s in pool["standbys"]}


def test_claims_that_do_not_match_are_refused_or_cold_started(daemon: DaemonProcess) -> None:
    client = daemon.start(timeout=STARTUP)
    assert client.post("/v1/pools", json={**SPEC, "size": 1}).status_code == 201
    wait_ready(client, 1)

    wrong = client.post(
        "/v1/slots", json={"name": "b", "pool": "web", "resources": {"cpus": 2, "memory": "128Mi"}}
    )
    assert wrong.status_code == 422
    assert "cpus" in wrong.json()["error"]["message"]
    assert client.post("/v1/slots", json={"name": "b", "pool": "nope"}).status_code == 404
    standby_named = client.post("/v1/slots", json={"name": "pool.web.abcdef", "pool": "web"})
    assert standby_named.status_code == 422
    assert "standby" in standby_named.json()["error"]["message"]
    assert len(standbys(client)) == 1, "a refused claim takes nothing"

    assert client.patch("/v1/pools/web", json={"size": 0}).status_code == 200
    wait_until("the pool emptied", lambda: not standbys(client), 30)
    empty = client.post("/v1/slots", json={"name": "b", "pool": "web"})
    assert empty.status_code == 409
    assert "fallback" in empty.json()["error"]["message"]
    cold = client.post("/v1/slots", json={"name": "b", "pool": "web", "fallback": "cold"})
    assert cold.status_code == 201, cold.text
    assert cold.json()["assignment"]["exclusive"]
    assert client.get("/v1/pools/web").json()["cold_claims"] == 1


def test_a_standby_that_died_frozen_is_passed_over_and_an_agent_kill_keeps_them_frozen(
    daemon: DaemonProcess,
) -> None:
    client = daemon.start(timeout=STARTUP)
    assert client.post("/v1/pools", json=SPEC).status_code == 201
    wait_ready(client, 2)
    first, second = sorted(standbys(client), key=lambda s: s["created_at"])

    daemon.kill()
    for slot in (first, second):
        assert frozen(slot["cgroup"]), "the standbys stay frozen while the agent is away"
    client = daemon.start(timeout=STARTUP)
    time.sleep(1.5)  # a few pool rounds
    after = {s["id"]: s for s in standbys(client)}
    assert set(after) == {first["id"], second["id"]}, "re-adopted, not duplicated"
    assert all(s["state"] == "standby" and frozen(s["cgroup"]) for s in after.values())

    # The claim takes the oldest standby first; that one's worker was killed while frozen (on
    # cgroup v1 the signal waits for the thaw, on v2 it dies at once and the pool replaces it).
    os.kill(first["worker"]["pid"], signal.SIGKILL)
    claimed = client.post("/v1/slots", json={"name": "c", "pool": "web"})
    assert claimed.status_code == 201, claimed.text
    assert claimed.json()["id"] == second["id"]
    assert serves(claimed.json()["endpoints"][0])
    assert first["id"] not in {s["id"] for s in standbys(client)}, "the dead standby is dropped"
    assert not cgroup_exists(first["cgroup"])
    wait_ready(client, 2)


def test_standbys_give_their_memory_to_an_allocate_that_needs_it(daemon: DaemonProcess) -> None:
    client = daemon.start(timeout=STARTUP)
    # A quarter of what is free (at most 4 GiB) each: two standbys fit, and so does the slot below,
    # on this host and in a small VM alike.
    each = min(4 * 2**30, client.get("/v1/capacity").json()["resources"]["memory_bytes"]["free"] // 4)
    big = {**SPEC, "slot": {**SPEC["slot"], "resources": {"cpus": 1, "memory": each}}}
    assert client.post("/v1/pools", json=big).status_code == 201
    wait_ready(client, 2)
    free = client.get("/v1/capacity").json()["resources"]["memory_bytes"]["free"]
    need = free + each  # fits only with one standby's memory back
    request = {"name": "big", "qos": "burstable", "resources": {"cpus": 0.1, "memory": need}}
    got = client.post("/v1/slots", json=request)
    assert got.status_code == 201, got.text
    left = standbys(client)
    assert len(left) == 1, "one standby gave its memory, the other stayed"
    # Nor does the pool take it back while the slot holds it: its refill waits, and says why.
    pool = wait_until(
        "the refill to pause", lambda: (p := client.get("/v1/pools/web").json())["problem"] and p, 30
    )
    assert "memory" in pool["problem"]
    assert client.delete("/v1/slots/big").status_code == 204
    assert client.patch("/v1/pools/web", json={"size": 2}).status_code == 200  # a resize retries at once
    wait_ready(client, 2)


def test_deleting_a_pool_removes_its_standbys_and_their_cgroups(daemon: DaemonProcess) -> None:
    client = daemon.start(timeout=STARTUP)
    assert client.post("/v1/pools", json=SPEC).status_code == 201
    wait_ready(client, 2)
    cgroups = [s["cgroup"] for s in standbys(client)]
    pids = [s["worker"]["pid"] for s in standbys(client)]
    assert client.delete("/v1/pools/web").status_code == 204
    assert client.get("/v1/pools/web").status_code == 404
    assert standbys(client) == []
    assert client.get("/v1/capacity").json()["standby"]["slots"] == 0
    for cgroup in cgroups:
        assert not cgroup_exists(cgroup)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
