"""NodeResourceTopology (agent/nrt.py): the object from a 2-NUMA synthetic host, and the publisher
against a fake API server.

The fake API server is a threaded http.server on 127.0.0.1 that keeps the CRD and the objects in
memory and records every request; the publisher reaches it through the real kubernetes client,
configured by a kubeconfig file the test writes (so the kubeconfig path is exercised too). Most
tests drive ``publish_once`` by hand so nothing waits on a clock; one runs the thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.config import load_config
from nodeagent.agent.nrt import (
    CRD_NAME,
    KubernetesNrtApi,
    NrtPublisher,
    PublisherTiming,
    node_resource_topology,
    quantity,
)
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError
from nodeagent.placement import Allocated, Capacity, capacity, mig_key

GIB = 1 << 30
# Two NUMA nodes of 8 CPUs and 64 GiB; GPUs 0, 1 on node 0, GPUs 2, 3 on node 1 with GPU 3 split
# into MIG instances; one FPGA per node.
TOPOLOGY = synthetic_topology(
    sockets=2, gpus_per_numa=2, mig={3: ["1g.10gb", "1g.10gb", "3g.40gb"]}, fpgas_per_numa=1
)
NODE = "worker-1"
NRT_PATH = f"/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies/{NODE}"
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
NODE_PATH = f"/api/v1/nodes/{NODE}"
FAST = PublisherTiming(
    resync_s=60.0, crd_check_s=0.1, min_interval_s=0.05, backoff_initial_s=0.05, backoff_max_s=0.2
)


def zones(body: dict[str, Any]) -> dict[str, dict[str, tuple[str, str, str]]]:
    """zone name -> resource name -> (capacity, allocatable, available)."""
    return {
        z["name"]: {r["name"]: (r["capacity"], r["allocatable"], r["available"]) for r in z["resources"]}
        for z in body["zones"]
    }


# =========================================================================== the object


def test_zones_of_an_idle_two_numa_host() -> None:
    body = node_resource_topology(NODE, TOPOLOGY, capacity(TOPOLOGY, Allocated()), devices=True).to_json()
    assert body["apiVersion"] == "topology.node.k8s.io/v1alpha2"
    assert body["kind"] == "NodeResourceTopology"
    assert body["metadata"] == {"name": NODE}
    assert {"name": "topologyManagerPolicy", "value": "single-numa-node"} in body["attributes"]
    assert {"name": "topologyManagerScope", "value": "container"} in body["attributes"]
    assert [z["type"] for z in body["zones"]] == ["Node", "Node"]
    mem = str(64 * GIB)
    assert zones(body) == {
        # Node 0 holds the default reserved CPUs (a core: 2 threads), not allocatable.
        "node-0": {
            "cpu": ("8", "6", "6"),
            "memory": (mem, mem, mem),
            "nodeagent.io/gpu": ("2", "2", "2"),
            "nodeagent.io/fpga": ("1", "1", "1"),
        },
        # GPU 3 is in MIG mode: offered as its instances, not as a whole GPU.
        "node-1": {
            "cpu": ("8", "8", "8"),
            "memory": (mem, mem, mem),
            "nodeagent.io/gpu": ("1", "1", "1"),
            "nodeagent.io/mig-1g.10gb": ("2", "2", "2"),
            "nodeagent.io/mig-3g.40gb": ("1", "1", "1"),
            "nodeagent.io/fpga": ("1", "1", "1"),
        },
    }
    # The SLIT distances, to every zone, itself included.
    costs = {z["name"]: {c["name"]: c["value"] for c in z["costs"]} for z in body["zones"]}
    assert costs == {"node-0": {"node-0": 10, "node-1": 32}, "node-1": {"node-0": 32, "node-1": 10}}


def test_what_slots_hold_is_not_available() -> None:
    gpu3 = TOPOLOGY.gpus[3]
    assert gpu3.mig is not None
    inst = gpu3.mig.instances[0]
    held = Allocated(
        cpus=frozenset({4, 12, 5, 13}),  # two whole cores of node 1
        gpus=frozenset({2}),
        mig=frozenset({mig_key(3, inst.uuid, inst.gpu_instance_id, inst.compute_instance_id)}),
        fpgas=frozenset({"fpga0"}),
        memory_by_node={1: 8 * GIB},
        memory_unbound=GIB,  # bound to no node: in no zone
    )
    got = zones(node_resource_topology(NODE, TOPOLOGY, capacity(TOPOLOGY, held), devices=True).to_json())
    assert got["node-1"]["cpu"] == ("8", "8", "4")
    assert got["node-1"]["memory"] == (str(64 * GIB), str(64 * GIB), str(56 * GIB))
    assert got["node-1"]["nodeagent.io/gpu"] == ("1", "1", "0")
    assert got["node-1"]["nodeagent.io/mig-1g.10gb"] == ("2", "2", "1")
    assert got["node-0"]["nodeagent.io/fpga"] == ("1", "1", "0")
    assert got["node-0"]["cpu"] == ("8", "6", "6")
    assert got["node-0"]["memory"][2] == str(64 * GIB)


def test_an_unhealthy_gpu_counts_but_is_not_allocatable() -> None:
    sick = dataclasses.replace(TOPOLOGY.gpus[0], healthy=False)
    topo = dataclasses.replace(TOPOLOGY, gpus=(sick, *TOPOLOGY.gpus[1:]))
    got = zones(node_resource_topology(NODE, topo, capacity(topo, Allocated()), devices=True).to_json())
    assert got["node-0"]["nodeagent.io/gpu"] == ("2", "1", "1")


def test_without_the_device_plugin_only_cpu_and_memory() -> None:
    body = node_resource_topology(NODE, TOPOLOGY, capacity(TOPOLOGY, Allocated()), devices=False).to_json()
    assert {name: set(res) for name, res in zones(body).items()} == {
        "node-0": {"cpu", "memory"},
        "node-1": {"cpu", "memory"},
    }


def test_unknown_distances_and_memory_are_left_out() -> None:
    nodes = tuple(dataclasses.replace(n, distances=None, memory_bytes=None) for n in TOPOLOGY.numa_nodes)
    topo = dataclasses.replace(TOPOLOGY, numa_nodes=nodes, gpus=(), fpgas=())
    body = node_resource_topology(NODE, topo, capacity(topo, Allocated()), devices=True).to_json()
    assert all("costs" not in z for z in body["zones"])
    assert {name: set(res) for name, res in zones(body).items()} == {"node-0": {"cpu"}, "node-1": {"cpu"}}


def test_quantities() -> None:
    assert quantity(8) == "8"
    assert quantity(2.0) == "2"
    assert quantity(1.5) == "1500m"
    assert quantity(64 * GIB) == "68719476736"


# =========================================================================== configuration


def test_config_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[kubernetes]\nnode_resource_topology = true\nkubeconfig = "/etc/kubernetes/agent.conf"\n'
        'node_name = "worker-1.example"\n'
    )
    k = load_config(path).kubernetes
    assert (k.node_resource_topology, k.kubeconfig, k.resolved_node_name) == (
        True,
        "/etc/kubernetes/agent.conf",
        "worker-1.example",
    )
    assert load_config(None).kubernetes.node_resource_topology is False
    assert load_config(None).kubernetes.resolved_node_name == socket.gethostname().lower()


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('kubeconfig = "agent.conf"', ["kubernetes.kubeconfig", "absolute path"]),
        ('node_name = "Worker_1"', ["kubernetes.node_name", "Worker_1", "kubectl get nodes"]),
        ("node_resource_topology = 1", ["kubernetes.node_resource_topology", "true or false"]),
    ],
)
def test_config_errors_say_what_is_wrong(tmp_path: Path, line: str, words: list[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[kubernetes]\n{line}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    for word in words:
        assert word in str(caught.value)


# =========================================================================== the fake API server


class FakeApiServer:
    """The few paths the publisher uses, kept in memory; ``requests`` records (method, path, body,
    authorization). ``crd``: whether the CRD is installed; ``conflicts``: how many of the next
    writes answer 409; ``fail``: an HTTP status every request answers with (0: none); ``nodes``:
    the Nodes there are, name -> uid; ``node_status``: what reading a Node answers instead (0: none)."""

    def __init__(self, port: int = 0) -> None:
        self.crd = False
        self.conflicts = 0
        self.fail = 0
        self.nodes: dict[str, str] = {}
        self.node_status = 0
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.requests: list[tuple[str, str, Any, str]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with fake.lock:
                    fake.requests.append(
                        (self.command, self.path.split("?")[0], body, self.headers.get("Authorization", ""))
                    )
                    status, answer = fake.route(self.command, self.path.split("?")[0], body)
                self._answer(status, answer)

            do_GET = do_POST = do_PUT = _handle  # http.server's names

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        def status(code: int, reason: str) -> tuple[int, Any]:
            return code, {"kind": "Status", "status": "Failure", "reason": reason, "code": code}

        if self.fail:
            return status(self.fail, "InternalError")
        if path.startswith("/api/v1/nodes/") and method == "GET":
            name = path.rsplit("/", 1)[1]
            if self.node_status:
                return status(self.node_status, "Forbidden")
            if name not in self.nodes:
                return status(404, "NotFound")
            return 200, {"kind": "Node", "metadata": {"name": name, "uid": self.nodes[name]}, "status": {}}
        if path == CRD_PATH and method == "GET":
            if not self.crd:
                return status(404, "NotFound")
            versions = [{"name": "v1alpha2", "served": True}]
            return 200, {"metadata": {"name": CRD_NAME}, "spec": {"versions": versions}}
        base = "/apis/topology.node.k8s.io/v1alpha2/noderesourcetopologies"
        if not self.crd or not path.startswith(base):
            return status(404, "NotFound")
        name = path[len(base) + 1 :]
        if method == "GET":
            return (200, self.objects[name]) if name in self.objects else status(404, "NotFound")
        if method == "POST" and not name:
            name = body["metadata"]["name"]
            if name in self.objects:
                return status(409, "AlreadyExists")
            return 201, self._store(name, body)
        if method == "PUT" and name in self.objects:
            if self.conflicts:
                self.conflicts -= 1
                self.version += 1  # someone else wrote meanwhile
                self.objects[name]["metadata"]["resourceVersion"] = str(self.version)
                return status(409, "Conflict")
            if body["metadata"].get("resourceVersion") != self.objects[name]["metadata"]["resourceVersion"]:
                return status(409, "Conflict")
            return 200, self._store(name, body)
        return status(405, "MethodNotAllowed")

    def _store(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        self.objects[name] = stored
        return stored

    def writes(self) -> list[tuple[str, Any]]:
        with self.lock:
            return [(m, b) for m, p, b, _ in self.requests if m in ("POST", "PUT")]

    def paths(self) -> list[tuple[str, str]]:
        with self.lock:
            return [(m, p) for m, p, _, _ in self.requests]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def kubeconfig(tmp_path: Path, port: int) -> str:
    path = tmp_path / "kubeconfig"
    # JSON is YAML: the client reads it as any kubeconfig.
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "agent", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "agent"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


class Ledger:
    """A CapacitySource whose holdings the test changes."""

    def __init__(self, topology: Topology = TOPOLOGY) -> None:
        self.current = topology
        self.held = Allocated()

    def topology(self) -> Topology:
        return self.current

    def capacity_report(self) -> Capacity:
        return capacity(self.current, self.held)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.stop()


@pytest.fixture
def publisher_for(tmp_path: Path) -> Iterator[Callable[[int, Ledger], NrtPublisher]]:
    made: list[NrtPublisher] = []

    def make(port: int, ledger: Ledger) -> NrtPublisher:
        config = kubeconfig(tmp_path, port)
        p = NrtPublisher(
            ledger, NODE, lambda: KubernetesNrtApi(config, timeout_s=2.0), devices=True, timing=FAST
        )
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# =========================================================================== the publisher


def test_without_the_crd_nothing_is_written(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    publisher = publisher_for(api.port, Ledger())
    delay, held = publisher.publish_once()
    assert (delay, held) == (FAST.crd_check_s, True)
    assert api.paths() == [("GET", CRD_PATH)]
    assert not publisher.crd_served()
    assert publisher.problems() == ()  # a cluster without the CRD is not a fault
    publisher.publish_once()
    assert api.writes() == []
    # The client sends the kubeconfig's token.
    assert {auth for *_, auth in api.requests} == {"Bearer t0ken"}


def test_with_the_crd_created_then_replaced_on_change(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    ledger = Ledger()
    publisher = publisher_for(api.port, ledger)
    assert publisher.publish_once() == (FAST.resync_s, False)
    assert api.paths() == [
        ("GET", CRD_PATH),
        ("GET", NODE_PATH),
        ("GET", NRT_PATH),
        ("POST", NRT_PATH.rsplit("/", 1)[0]),
    ]
    [(method, created)] = api.writes()
    assert method == "POST"
    assert created == node_resource_topology(NODE, TOPOLOGY, ledger.capacity_report(), devices=True).to_json()
    assert zones(created)["node-1"]["cpu"] == ("8", "8", "8")

    # Nothing changed: read, not written.
    publisher.publish_once()
    assert len(api.writes()) == 1

    ledger.held = Allocated(cpus=frozenset({4, 12}), memory_by_node={1: GIB})
    publisher.publish_once()
    method, replaced = api.writes()[-1]
    assert method == "PUT"
    assert replaced["metadata"] == {"name": NODE, "resourceVersion": "1"}
    assert zones(replaced)["node-1"]["cpu"] == ("8", "8", "6")
    assert zones(api.objects[NODE])["node-1"]["memory"][2] == str(63 * GIB)
    assert publisher.publishes == 3


def test_a_change_that_moves_no_number_sends_nothing(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    ledger = Ledger()
    publisher = publisher_for(api.port, ledger)
    publisher.publish_once()
    sent = len(api.requests)
    # A worker's phase changed (the manager's hook fires), the capacity did not.
    assert publisher.publish_once(resync=False) == (FAST.resync_s, False)
    assert len(api.requests) == sent
    ledger.held = Allocated(cpus=frozenset({4, 12}))
    publisher.publish_once(resync=False)
    assert [m for m, _ in api.paths()[sent:]] == ["GET", "PUT"]
    # The timer's pass reads the Node and the object even when nothing moved.
    publisher.publish_once()
    assert api.paths()[sent + 2 :] == [("GET", NODE_PATH), ("GET", NRT_PATH)]


def test_the_node_owns_the_object_once_it_can_be_read(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    """Deleting the Node deletes the object (the garbage collector follows ``ownerReferences``):
    the owner is added when the Node appears, follows a Node registered again (a new uid), and a
    Node the agent may not read leaves the object published, without an owner, and no problem."""

    def owners() -> Any:
        return api.objects[NODE]["metadata"].get("ownerReferences")

    api.crd = True
    api.node_status = 403
    publisher = publisher_for(api.port, Ledger())
    assert publisher.publish_once() == (FAST.resync_s, False)
    assert owners() is None
    assert publisher.problems() == ()
    api.node_status = 0
    publisher.publish_once()
    assert owners() is None  # registered later
    api.nodes[NODE] = "uid-1"
    publisher.publish_once(resync=False)  # a change pass does not read the Node again
    assert owners() is None
    publisher.publish_once()
    assert owners() == [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-1"}]
    writes = len(api.writes())
    publisher.publish_once()
    assert len(api.writes()) == writes  # the owner already named: nothing to write
    api.nodes[NODE] = "uid-2"  # deleted and registered again
    publisher.publish_once()
    assert owners()[0]["uid"] == "uid-2"
    api.node_status = 403  # the right taken away: the last owner known stays
    publisher.publish_once()
    assert owners()[0]["uid"] == "uid-2"
    assert publisher.problems() == ()


def test_a_conflict_reads_again_and_retries(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    ledger = Ledger()
    publisher = publisher_for(api.port, ledger)
    publisher.publish_once()
    ledger.held = Allocated(cpus=frozenset({4, 12}))
    api.conflicts = 1
    assert publisher.publish_once() == (FAST.resync_s, False)
    puts = [b for m, b in api.writes() if m == "PUT"]
    assert len(puts) == 2
    # The second write names the version read after the conflict.
    assert puts[1]["metadata"]["resourceVersion"] == "2"
    assert zones(api.objects[NODE])["node-1"]["cpu"][2] == "6"
    assert [m for m, _ in api.paths()[-4:]] == ["GET", "PUT", "GET", "PUT"]

    # A writer that never stops conflicting: a problem, retried with backoff.
    ledger.held = Allocated()
    api.conflicts = 10
    delay, held = publisher.publish_once()
    assert (delay, held) == (FAST.backoff_initial_s, True)
    assert "conflict" in publisher.problems()[0]


def test_a_deleted_object_is_put_back(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    publisher = publisher_for(api.port, Ledger())
    publisher.publish_once()
    del api.objects[NODE]
    publisher.publish_once()
    assert [m for m, _ in api.writes()] == ["POST", "POST"]
    assert NODE in api.objects


def test_a_crd_removed_later_is_looked_for_again(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    publisher = publisher_for(api.port, Ledger())
    publisher.publish_once()
    api.crd = False
    api.objects.clear()
    assert publisher.publish_once() == (FAST.crd_check_s, True)
    assert not publisher.crd_served()
    api.requests.clear()
    publisher.publish_once()
    assert api.paths() == [("GET", CRD_PATH)]


def test_server_errors_are_problems_with_backoff(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.crd = True
    api.fail = 500
    publisher = publisher_for(api.port, Ledger())
    delays = [publisher.publish_once()[0] for _ in range(4)]
    assert delays == [0.05, 0.1, 0.2, 0.2]  # doubling, up to the most
    assert "500" in publisher.problems()[0]
    api.fail = 0
    assert publisher.publish_once() == (FAST.resync_s, False)
    assert publisher.problems() == ()
    assert publisher.publish_once()[0] == FAST.resync_s  # the backoff starts over


def test_a_refusal_says_what_the_identity_needs(
    api: FakeApiServer, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    api.fail = 403
    publisher = publisher_for(api.port, Ledger())
    assert publisher.publish_once()[1]
    [problem] = publisher.problems()
    assert "403" in problem
    assert "needs get, create and update on noderesourcetopologies.topology.node.k8s.io" in problem


def test_a_missing_kubeconfig_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    publisher = NrtPublisher(Ledger(), NODE, lambda: KubernetesNrtApi(missing), timing=FAST)
    _, held = publisher.publish_once()
    assert held
    assert "cannot load" in publisher.problems()[0]
    assert missing in publisher.problems()[0]
    publisher.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_the_thread_publishes_changes_and_survives_a_server_that_is_down(
    tmp_path: Path, publisher_for: Callable[[int, Ledger], NrtPublisher]
) -> None:
    port = free_port()
    ledger = Ledger()
    publisher = publisher_for(port, ledger)
    publisher.start()
    publisher.notify_change()
    wait_for(lambda: bool(publisher.problems()))
    assert "did not answer" in publisher.problems()[0]

    server = FakeApiServer(port)  # the API server comes up: the backoff's next try finds it
    try:
        server.crd = True
        wait_for(lambda: NODE in server.objects)
        wait_for(lambda: publisher.problems() == ())
        ledger.held = Allocated(cpus=frozenset({4, 12}))
        publisher.notify_change()
        wait_for(lambda: zones(server.objects[NODE])["node-1"]["cpu"][2] == "6")
        # A burst of changes is one write (at most one every min_interval_s).
        before = len(server.writes())
        for n in range(20):
            ledger.held = Allocated(cpus=frozenset({4, 12} if n % 2 else {5, 13, 4, 12}))
            publisher.notify_change()
        wait_for(lambda: zones(server.objects[NODE])["node-1"]["cpu"][2] == "6")
        time.sleep(0.2)
        assert len(server.writes()) - before <= 3
    finally:
        publisher.close()
        server.stop()


def test_start_and_change_notices_leave_the_api_server_to_the_publishers_thread(tmp_path: Path) -> None:
    # The agent starts the publisher before serving and notifies it under its own lock: neither
    # may wait on an API server that hangs. The client is made (and every call made) on the
    # publisher's thread; here the client's making hangs until the test lets it go.
    gate = threading.Event()
    callers: list[threading.Thread] = []

    def hanging_client() -> KubernetesNrtApi:
        callers.append(threading.current_thread())
        gate.wait(10)
        return KubernetesNrtApi(str(tmp_path / "nope"))

    publisher = NrtPublisher(Ledger(), NODE, hanging_client, timing=FAST)
    try:
        publisher.start()
        publisher.notify_change()
        wait_for(lambda: bool(callers))
        assert threading.main_thread() not in callers, "the API server was called from the caller's thread"
        assert publisher.problems() == ()  # nothing answered or failed yet: the call still hangs
    finally:
        gate.set()
        publisher.close()


def test_the_object_fits_the_vendored_crd_schema() -> None:
    """The body against the v1alpha2 schema of the CRD the cluster installs (kube/), so a field
    name or type the API server would refuse fails here."""
    import jsonschema
    import yaml

    manifest = Path(__file__).resolve().parents[2] / "kube" / "noderesourcetopology-crd.yaml"
    crd = yaml.safe_load(manifest.read_text())
    assert crd["metadata"]["name"] == CRD_NAME
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    assert version["served"]
    assert version["storage"]
    schema = version["schema"]["openAPIV3Schema"]
    sick = dataclasses.replace(TOPOLOGY.gpus[0], healthy=False)
    topo = dataclasses.replace(TOPOLOGY, gpus=(sick, *TOPOLOGY.gpus[1:]))
    body = node_resource_topology(NODE, topo, capacity(topo, Allocated()), devices=True).to_json()
    jsonschema.validate(body, schema)
    # The schema does check what it says: a zone without its type is refused.
    broken = json.loads(json.dumps(body))
    del broken["zones"][0]["type"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


# =========================================================================== the daemon's wiring


class FakeManager(Ledger):
    """The manager as the daemon hands it over: a CapacitySource with the change hook."""

    def __init__(self) -> None:
        super().__init__()
        self.subscribers: list[Callable[[], None]] = []
        self.integrations: dict[str, Callable[[], tuple[str, ...]]] = {}

    def watch_integration(self, name: str, problems: Callable[[], tuple[str, ...]]) -> None:
        self.integrations[name] = problems

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.subscribers.append(callback)

    def change(self, held: Allocated) -> None:
        self.held = held
        for callback in self.subscribers:
            callback()


def test_the_daemon_starts_it_only_when_asked(
    tmp_path: Path, api: FakeApiServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nodeagent.agent import daemon, nrt
    from nodeagent.agent.config import AgentConfig, KubernetesConfig

    manager = FakeManager()
    assert daemon._nrt_publisher(AgentConfig(), manager) is None  # type: ignore[arg-type]
    assert manager.subscribers == []
    assert manager.integrations == {}

    on = AgentConfig(
        kubernetes=KubernetesConfig(
            node_resource_topology=True, kubeconfig=kubeconfig(tmp_path, api.port), node_name=NODE
        )
    )
    # Without the client: said why, and the agent goes on without publishing.
    monkeypatch.setattr(nrt, "client_installed", lambda: False)
    assert daemon._nrt_publisher(on, manager) is None  # type: ignore[arg-type]
    assert "pip install 'nodeagent[kubernetes]'" in caplog.text
    # ... and in the node's view, which `nodeagent doctor` shows.
    [missing] = manager.integrations["node_resource_topology"]()
    assert "kubernetes Python client is not installed" in missing
    monkeypatch.undo()

    api.crd = True
    publisher = daemon._nrt_publisher(on, manager)  # type: ignore[arg-type]
    assert publisher is not None
    try:
        wait_for(lambda: NODE in api.objects)
        # The ledger's change hook reaches the publisher.
        manager.change(Allocated(cpus=frozenset({4, 12})))
        wait_for(lambda: zones(api.objects[NODE])["node-1"]["cpu"][2] == "6")
        # Without [kubernetes] device_plugin the zones list only CPUs and memory.
        assert set(zones(api.objects[NODE])["node-1"]) == {"cpu", "memory"}
        assert manager.integrations["node_resource_topology"] == publisher.problems
        assert publisher.problems() == ()
    finally:
        publisher.close()


# =========================================================================== a running agent


def cpu_available(server: FakeApiServer) -> int:
    return sum(int(res["cpu"][2]) for res in zones(server.objects[NODE]).values())


@pytest.mark.root
@pytest.mark.slow
def test_a_running_agent_publishes_what_its_ledger_holds(tmp_path: Path, api: FakeApiServer) -> None:
    """``nodeagent serve`` with the key on, against the fake API server: the object appears at
    start, follows an allocate and a release, and stays when the agent stops."""
    import subprocess

    from tests.daemon import DaemonProcess, nodeagent_argv, wait_until

    pid = os.getpid()
    api.crd = True
    daemon = DaemonProcess(
        tmp_path / "agent",
        f'[isolation]\ncgroup_parent = "natestnrt{pid}.slice"\nnetns_prefix = "nr{pid}-"\n'
        f'veth_prefix = "nrv"\nfirewall_table = "natestnrt{pid}"\n\n'
        f'[kubernetes]\nnode_resource_topology = true\nkubeconfig = "{kubeconfig(tmp_path, api.port)}"\n'
        f'node_name = "{NODE}"\n',
    )
    try:
        client = daemon.start()
        wait_until("the object", lambda: NODE in api.objects)
        node = client.get("/v1/node").json()
        assert node["integrations"] == {"node_resource_topology": []}
        idle = cpu_available(api)
        assert idle >= 1, f"no exclusive CPU to allocate on this host: {api.objects[NODE]}"
        made = client.post(
            "/v1/slots", json={"name": "nrt", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "64Mi"}}
        )
        assert made.status_code == 201, made.text
        held = len(made.json()["assignment"]["cpus"])
        wait_until("the allocate to be published", lambda: cpu_available(api) == idle - held)
        assert client.delete(f"/v1/slots/{made.json()['id']}").status_code in (200, 204)
        wait_until("the release to be published", lambda: cpu_available(api) == idle)
        assert daemon.stop() == 0
        assert NODE in api.objects  # a stopped agent leaves its object
    finally:
        daemon.stop()
        daemon.stop_keeper()
        uninstall = ["uninstall", "--config", str(daemon.config), "--state-dir", str(daemon.state)]
        subprocess.run(
            [*nodeagent_argv(), *uninstall],
            capture_output=True,
            timeout=120,
            check=False,
        )
    from nodeagent.cgroups import detect

    host = detect()
    roots = {*host.v1_mounts.values(), *((host.v2_mount,) if host.v2_mount else ())}
    assert not [r for r in roots if (r / f"natestnrt{pid}.slice").exists()], "the test's cgroups were left"
