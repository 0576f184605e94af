"""Pods placed by the agent, driven by a real kubelet: ``kube/cluster start`` (kine, kube-apiserver,
containerd with NRI, a kubelet; no scheduler: pods name their node), a test agent (``nodeagent serve``
with ``[kubernetes] nri = true`` and ``device_plugin = true``, its own state dir and cgroup parent,
host partitioning on with the kubelet's pod cgroups left to NRI), the NRI shim, kubectl. Proof
from the outside: what the kubelet, the runtime's cgroups and the agent's REST API say.

Run by ``kube/pods-e2e`` (root; the components from kube/build's cache). Checks, in order:

0. the agent's NodeResourceTopology is on the API server, owned by the Node;
1. a Burstable and a BestEffort pod run in slots of the burstable and best-effort class, their
   containers' cgroup cpusets on the agent's shared pool; a REST guaranteed slot of one CPU moves
   them off its CPU (the shim's long poll), its release moves them back; a Guaranteed pod (1 CPU,
   64Mi, requests == limits) runs on an exclusive CPU of a guaranteed slot (``GET /v1/slots``):
   its container's cgroup cpuset is the slot's CPU, its memory limit 64Mi, the shared pods are
   off that CPU by the time it runs (its CreateContainer answer moved them), and so is every
   thread of the cluster's own processes (host partitioning), the container still on its CPU,
   and the NodeResourceTopology shows the CPU taken;
   then a spinning BestEffort pod is held to the QoS loop's allowance (the kubelet's ``besteffort``
   cgroup's CFS quota) while a Burstable pod spins beside it, and gets CPU back when it goes;
2. one ledger: deleting the Burstable and BestEffort pods frees their slots; a REST guaranteed
   slot of every CPU the agent has left (on the 2-CPU host: the other one) never gets the pod's;
   a Guaranteed pod asking for a CPU then (the kubelet admits it: its own count says one CPU is
   free) fails its creation with the agent's reason in the pod's events, and holds no slot;
3. a second Guaranteed pod asking for ``nodeagent.io/device-<loopN>`` too (a loop device as
   ``[placement] allowed_devices`` stands in for an accelerator): the node shows it allocatable,
   the kubelet admits the pod, its container reads the device node (the plugin answers the
   agent's CDI name ``nodeagent.io/device=<loopN>``, which containerd resolves from the agent's
   spec in its CDI directory), its slot holds the device (the shim forwards the container's
   device nodes; a REST slot asking for it is refused) and it runs on its slot's exclusive CPU;
   the first pod has no such node;
4. a kubelet restart, a containerd restart, an agent SIGKILL and restart: the pods keep running
   (the same containers, no restart) on their slots' CPUs, their slots keep their ids, no CPU is
   held twice (nor given to a REST slot), the device is allocatable again;
5. deleting the pods frees their slots; 20 pods (Burstable and BestEffort) created and deleted
   leave nothing: no slot (also after an agent restart), no cgroup under the agent's parent or
   the kubelet's pod cgroups, no CDI spec beyond those before the first pod;
6. the agent stopped (SIGTERM): the host's tasks have their CPUs back; ``nodeagent uninstall``
   lifts the QoS loop's quota from the kubelet's ``besteffort`` cgroup.

Each step prints its time. On failure it prints the pods, their events and the tails of the
kubelet's, containerd's, the agent's and the shim's logs. Everything it starts is ended in
``finally`` (the shim, the agent, then ``nodeagent uninstall --release-slots``); the wrapper's
``kube/cluster stop`` ends the cluster and removes its work directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from nodeagent.agent.nri import slot_name
from nodeagent.cpulist import parse_cpulist
from tests.daemon import DaemonProcess, nodeagent_argv, wait_until
from tests.kube.nri_e2e import Crictl, cgroup_file, clean_up, nri_agent, registrations, start_shim

PARENT = f"natestpods{os.getpid()}.slice"
NRT_CRD = "noderesourcetopologies.topology.node.k8s.io"
NODE = os.environ.get("KUBE_NODE_NAME", "nodeagent-kube")
KUBE_CGROUP_ROOT = os.environ.get("KUBE_CGROUP_ROOT", "nodeagent-kube")
IMAGE = "nodeagent.local/busybox:1"
#: How long a pod may take to run, or to go (a loaded 2-CPU CI machine).
POD_WAIT_S = 120.0
#: A container that ends at once on SIGTERM (sh as PID 1 ignores it otherwise, until the grace period).
SLEEPER = 'trap "exit 0" TERM; sleep 3600 & wait'
CHURN = 20
T = TypeVar("T")


def say(text: str) -> None:
    print(f"pods-e2e: {text}", flush=True)


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 60.0, every: float = 0.3) -> T:
    """tests.daemon's wait, typed, at a pace that does not load the API server and the kubelet."""
    value: T = wait_until(what, check, timeout, every)
    return value


def more(count: Callable[[], int], than: int) -> Callable[[], bool]:
    """A check that ``count()`` went above ``than``."""
    return lambda: count() > than


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    started = time.monotonic()
    say(f"--- {name}")
    yield
    say(f"--- {name}: ok in {time.monotonic() - started:.1f}s")


class Kube:
    """kubectl against the harness's apiserver, as its admin."""

    def __init__(self, binary: Path, work: Path) -> None:
        self.argv = [str(binary), "--kubeconfig", str(work / "admin.kubeconfig"), "--request-timeout", "30s"]

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.argv, *args], input=stdin, capture_output=True, text=True, timeout=90, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def create(self, *pods: dict[str, Any]) -> None:
        self.run(
            "create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(pods)})
        )

    def found(self, *what: str) -> dict[str, Any] | None:
        """``kubectl get WHAT -o json``; None when the object does not exist."""
        done = self.run("get", *what, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(what)} failed: {done.stderr.strip()}")
        obj: dict[str, Any] = json.loads(done.stdout)
        return obj

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.found("pod", name, "-n", "default")

    def pods(self, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.json("get", "pods", "-n", "default", "-l", selector)["items"]
        return items

    def nrt(self) -> dict[str, Any] | None:
        """This node's NodeResourceTopology object, None while there is none."""
        return self.found("noderesourcetopology", NODE)

    def nrt_cpus_available(self) -> int:
        """Exclusive CPUs the NodeResourceTopology says are available, over its zones."""
        nrt = self.nrt() or {}
        return sum(
            int(r["available"]) for z in nrt.get("zones", []) for r in z["resources"] if r["name"] == "cpu"
        )

    def nrt_cpus_settled(self, timeout: float = 20.0) -> int:
        """:meth:`nrt_cpus_available` once two reads 1.5 s apart agree (the publisher writes at most
        once a second, so a change still on its way shows in the second)."""
        deadline = time.monotonic() + timeout
        last = self.nrt_cpus_available()
        while True:
            time.sleep(1.5)
            now = self.nrt_cpus_available()
            if now == last or time.monotonic() > deadline:
                return now
            last = now

    def allocatable(self, resource: str) -> str:
        node = self.json("get", "node", NODE)
        return str(node["status"].get("allocatable", {}).get(resource, "0"))

    def events(self, pod: str) -> list[str]:
        found = self.json("get", "events", "-n", "default", "--field-selector", f"involvedObject.name={pod}")
        return [f"{e.get('reason')}: {e.get('message', '')}" for e in found["items"]]

    def delete(self, *names: str, selector: str | None = None) -> None:
        what = ["-l", selector] if selector else list(names)
        self.run("delete", "pod", "-n", "default", "--wait=false", *what)

    def gone(self, *names: str, selector: str | None = None, timeout: float = POD_WAIT_S) -> None:
        """Wait until the kubelet has ended the pods and removed them from the API."""
        if selector:
            wait_for(f"pods {selector} to go", lambda: not self.pods(selector), timeout)
        for name in names:

            def absent(n: str = name) -> bool:
                return self.pod(n) is None

            wait_for(f"pod {name} to go", absent, timeout)


def pod_spec(
    name: str, resources: dict[str, Any], *, script: str = SLEEPER, label: str = "pods-e2e"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": label}},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": True,  # no CNI in the harness
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                    "resources": resources,
                }
            ],
        },
    }


GUARANTEED = {"requests": {"cpu": "1", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "64Mi"}}
BURSTABLE = {"requests": {"cpu": "100m", "memory": "32Mi"}, "limits": {"cpu": "200m", "memory": "64Mi"}}
SMALL_BURSTABLE = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}}
BEST_EFFORT: dict[str, Any] = {}
#: A Burstable pod without a CPU limit: online work that takes what it finds.
ONLINE = {"requests": {"cpu": "100m", "memory": "16Mi"}}
#: A container that spins on one CPU until it is told to stop.
SPINNER = 'trap "exit 0" TERM; while :; do :; done'


def container_id(pod: dict[str, Any]) -> str | None:
    """The running container's id (containerd's 64 hex digits), None while it does not run."""
    if pod.get("status", {}).get("phase") != "Running":
        return None
    statuses = pod["status"].get("containerStatuses") or []
    if not statuses or "running" not in statuses[0].get("state", {}):
        return None
    return str(statuses[0]["containerID"]).split("://", 1)[-1]


class Run:
    """What the steps share: the cluster's tools, the agent and its client, the shim."""

    def __init__(self, args: argparse.Namespace, daemon: DaemonProcess) -> None:
        self.args = args
        self.work: Path = args.work
        self.daemon = daemon
        self.kube = Kube(args.bin / "kubectl", args.work)
        self.cri = Crictl(args.bin / "crictl", args.work)
        self.client: httpx.Client | None = None
        self.shim_log = daemon.config.parent / "shim.log"
        self.resource = f"nodeagent.io/device-{Path(args.device).name}"

    @property
    def api(self) -> httpx.Client:
        assert self.client is not None, "the agent is not running"
        return self.client

    def slots(self) -> list[dict[str, Any]]:
        answer = self.api.get("/v1/slots")
        assert answer.status_code == 200, answer.text
        slots: list[dict[str, Any]] = answer.json()["slots"]
        return slots

    def slot_of(self, ctr: str) -> dict[str, Any]:
        name = slot_name(ctr)
        found = [s for s in self.slots() if s["name"] == name]
        assert found, f"container {ctr[:13]} has no slot {name[:20]}... (slots: {self.names()})"
        return found[0]

    def names(self) -> list[str]:
        return sorted(s["name"] for s in self.slots())

    def nri_slots(self) -> list[dict[str, Any]]:
        return [s for s in self.slots() if s["name"].startswith("nri-")]

    def running(self, *names: str, timeout: float = POD_WAIT_S) -> dict[str, str]:
        """Wait until each pod runs; their container ids."""
        ids: dict[str, str] = {}
        for name in names:

            def up(n: str = name) -> str | None:
                pod = self.kube.pod(n)
                return None if pod is None else container_id(pod)

            try:
                ids[name] = wait_for(f"pod {name} to run", up, timeout)
            except AssertionError:
                say(f"pod {name}: {json.dumps((self.kube.pod(name) or {}).get('status'))[:1500]}")
                say(f"events of {name}: {self.kube.events(name)}")
                raise
        return ids

    def pid(self, ctr: str) -> int:
        return int(json.loads(self.cri.run("inspect", ctr).stdout)["info"]["pid"])

    def cgroup_cpus(self, ctr: str) -> str:
        return cgroup_file(self.pid(ctr), "cpuset", "cpuset.cpus")

    def components_on(self) -> dict[str, set[int]]:
        """The CPUs each thread of the cluster's own processes (kubelet, kube-apiserver, kine,
        containerd and its shims: binaries of kube/build's bin directory) may run on, by name."""
        bin_dir = self.args.bin.resolve()
        found: dict[str, set[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                exe = (entry / "exe").resolve()
                if exe.parent != bin_dir:
                    continue
                for task in (entry / "task").iterdir():
                    status = (task / "status").read_text()
                    allowed = next(
                        line.split(":", 1)[1]
                        for line in status.splitlines()
                        if line.startswith("Cpus_allowed_list")
                    )
                    found.setdefault(f"{exe.name}[{entry.name}]", set()).update(parse_cpulist(allowed))
        return found

    def host_kept_off(self, cpus: list[int], timeout: float = 15.0) -> None:
        """The host partitioning the pods' CPUs: every thread of the cluster's components is off
        ``cpus`` (the agent's pass after the slot was placed)."""

        def off() -> dict[str, set[int]] | None:
            now = self.components_on()
            return now if now and not any(set(cpus) & on for on in now.values()) else None

        try:
            seen = wait_for(f"the host's tasks to be kept off CPU(s) {cpus}", off, timeout)
        except AssertionError:
            say(f"the components' CPUs: {self.components_on()}")
            raise
        say(
            f"host partitioned: {len(seen)} cluster processes on CPU(s) {sorted(set().union(*seen.values()))}"
        )

    def exclusive_disjoint(self) -> dict[str, list[int]]:
        """Every slot's exclusive CPUs; fails when any CPU is held by two slots."""
        held: dict[int, str] = {}
        out: dict[str, list[int]] = {}
        for slot in self.slots():
            a = slot.get("assignment") or {}
            if not a.get("exclusive"):
                continue
            for cpu in a.get("cpus", []):
                assert cpu not in held, f"CPU {cpu} held twice: by {held[cpu]} and {slot['name']}"
                held[cpu] = slot["name"]
            out[slot["name"]] = list(a.get("cpus", []))
        return out

    def agent_cgroups(self) -> set[str]:
        """The cgroup directories under the agent's parent, in every hierarchy."""
        found: set[str] = set()
        root = Path("/sys/fs/cgroup")
        for base in [root / PARENT, *root.glob(f"*/{PARENT}")]:
            for dirpath, _dirs, _files in os.walk(base):
                found.add(str(Path(dirpath).relative_to(root)))
        return found

    def pod_cgroups(self) -> set[str]:
        """The kubelet's pod cgroups (``pod<uid>``) under its cgroup root, in every hierarchy."""
        root = Path("/sys/fs/cgroup")
        found: set[str] = set()
        for base in [root / KUBE_CGROUP_ROOT, *root.glob(f"*/{KUBE_CGROUP_ROOT}")]:
            for dirpath, dirs, _files in os.walk(base):
                found.update(str(Path(dirpath, d).relative_to(root)) for d in dirs if d.startswith("pod"))
        return found

    def cdi_specs(self) -> set[str]:
        dirs = [self.daemon.config.parent / "cdi-specs", self.work / "cdi"]
        return {str(p) for d in dirs if d.is_dir() for p in d.iterdir()}

    def shared_pool(self) -> list[int]:
        """The agent's shared pool as it is now (the version GET /v1/nri/updates names)."""
        answer = self.api.get("/v1/nri/updates", params={"wait": 0})
        assert answer.status_code == 200, answer.text
        return sorted(parse_cpulist(answer.json()["version"]))

    def shared_cpus_follow(self, pods: dict[str, str], after: str, timeout: float = 10.0) -> list[int]:
        """Each shared pod's container cgroup runs on the agent's shared pool (within ``timeout``)."""
        pool = self.shared_pool()
        assert pool, f"after {after}: the agent's shared pool is empty"

        def on_pool() -> bool:
            return all(sorted(parse_cpulist(self.cgroup_cpus(ctr))) == pool for ctr in pods.values())

        try:
            wait_for(f"the shared pods to run on the pool {pool} after {after}", on_pool, timeout, every=0.05)
        except AssertionError:
            say(f"cpusets: { {pod: self.cgroup_cpus(ctr) for pod, ctr in pods.items()} }, pool {pool}")
            raise
        say(f"after {after}: shared pods {sorted(pods)} run on the shared pool {pool}")
        return pool

    def rest_slot_beside(self, pod_cpus: list[int], name: str = "pods-e2e-rest", cpus: int = 0) -> list[int]:
        """A REST guaranteed slot of ``cpus`` CPUs (0: every CPU the agent has left, on the 2-CPU
        host the one the pod does not hold); its CPUs, checked disjoint from the pod's. The caller
        releases it."""
        free = int(self.api.get("/v1/capacity").json()["resources"]["cpus"]["free"])
        assert free >= 1, f"the agent has no CPU left beside the Guaranteed pod's {pod_cpus} ({free})"
        free = cpus or free
        body = {
            "name": name,
            "qos": "guaranteed",
            "resources": {"cpus": free, "memory": "32Mi", "numa": "none"},
        }
        rest = self.api.post("/v1/slots", json=body)
        assert rest.status_code == 201, (
            f"a REST guaranteed slot of {free} CPU(s) beside the pod did not fit: {rest.text}"
        )
        theirs: list[int] = rest.json()["assignment"]["cpus"]
        assert not set(theirs) & set(pod_cpus), (
            f"the REST slot got CPU(s) {theirs}, the pod's slot holds {pod_cpus}"
        )
        self.exclusive_disjoint()
        return theirs

    def ledger_probe(self, pods_cpus: list[int]) -> str:
        """The ledger still counts the pods' CPUs: a REST slot of all that is left gets other CPUs,
        and with none left (the 2-CPU host) a REST slot of one is refused."""
        free = int(self.api.get("/v1/capacity").json()["resources"]["cpus"]["free"])
        if free:
            theirs = self.rest_slot_beside(pods_cpus, "pods-e2e-probe")
            answer = self.api.delete("/v1/slots/pods-e2e-probe")
            assert answer.status_code == 204, answer.text
            return f"a REST slot got CPU(s) {theirs}"
        body = {"name": "pods-e2e-probe", "qos": "guaranteed", "resources": {"cpus": 1, "memory": "32Mi"}}
        answer = self.api.post("/v1/slots", json=body)
        assert answer.status_code == 409, f"a REST slot got a CPU while pods hold {pods_cpus}: {answer.text}"
        assert answer.json()["error"]["code"] == "does_not_fit", answer.text
        return "a REST slot of 1 CPU refused (does_not_fit)"

    def plugin_registrations(self) -> int:
        """How often the agent's log says a device plugin registered with the kubelet."""
        return tail(self.daemon.log_path, 10**9).count("device plugin registered")

    def device_allocatable(self) -> bool:
        return self.kube.allocatable(self.resource) == "1"


def nrt_owned_by_the_node(r: Run) -> None:
    """The agent's NodeResourceTopology is on the API server, owned by this Node (deleting the Node
    deletes it)."""
    uid = r.kube.json("get", "node", NODE)["metadata"]["uid"]

    def owned() -> dict[str, Any] | None:
        nrt = r.kube.nrt()
        return nrt if nrt and nrt["metadata"].get("ownerReferences") else None

    nrt = wait_for("the NodeResourceTopology with the Node as its owner", owned, 30)
    owners = nrt["metadata"]["ownerReferences"]
    assert owners == [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid}], owners
    available = r.kube.nrt_cpus_available()
    say(f"NodeResourceTopology {NODE}: owned by the Node (uid {uid[:8]}...), cpu available {available}")


def step1_classes(r: Run) -> dict[str, str]:
    """Burstable and BestEffort pods on the shared pool, following it as a REST slot comes and goes;
    then a Guaranteed pod: a slot of its class, the exclusive CPU in its cgroup, the shared pods
    moved off it before it starts."""
    started = time.monotonic()
    r.kube.create(pod_spec("burstable", BURSTABLE), pod_spec("besteffort", BEST_EFFORT))
    ids = r.running("burstable", "besteffort")
    say(f"2 shared pods running {time.monotonic() - started:.1f}s after kubectl create")
    for pod, qos in (("burstable", "burstable"), ("besteffort", "best-effort")):
        s = r.slot_of(ids[pod])
        assert s["qos"] == qos, f"the {pod} pod's slot is of class {s['qos']}, not {qos}"
        assert not (s["assignment"] or {}).get("exclusive"), f"the {pod} pod's slot is exclusive: {s}"
        say(f"{pod}: slot {s['id']} class {s['qos']}, cpus {s['request']['resources'].get('cpus')}")
    whole = r.shared_cpus_follow(ids, "placed")
    # The shared pool shrinks under a guaranteed slot made through REST (the shim's long poll) and
    # grows back when it is released.
    theirs = r.rest_slot_beside([], "pods-e2e-pool", cpus=1)
    took = time.monotonic()
    pool = r.shared_cpus_follow(ids, f"a REST slot took CPU {theirs}")
    say(f"shared pods moved to CPU(s) {pool} {time.monotonic() - took:.2f}s after the REST slot")
    assert not set(pool) & set(theirs), f"the shared pool {pool} holds the REST slot's CPU(s) {theirs}"
    answer = r.api.delete("/v1/slots/pods-e2e-pool")
    assert answer.status_code == 204, answer.text
    assert r.shared_cpus_follow(ids, "the REST slot was released") == whole

    started = time.monotonic()
    nrt_before = r.kube.nrt_cpus_settled()  # after the REST slot's release is published
    r.kube.create(pod_spec("guaranteed", GUARANTEED))
    ids.update(r.running("guaranteed"))
    running = time.monotonic()
    say(f"guaranteed pod running {running - started:.1f}s after kubectl create")
    wait_for(
        "the NodeResourceTopology to show the Guaranteed pod's CPU taken",
        lambda: r.kube.nrt_cpus_available() == nrt_before - 1,
        10,
    )
    say(
        f"NodeResourceTopology cpu available {nrt_before} -> {nrt_before - 1}, seen "
        f"{time.monotonic() - running:.2f}s after the pod was seen running (kubectl polls included)"
    )
    g = r.slot_of(ids["guaranteed"])
    a = g["assignment"]
    assert g["qos"] == "guaranteed", f"the Guaranteed pod's slot is {g['qos']}, not guaranteed: {g}"
    assert a["exclusive"], f"the Guaranteed pod's slot has no exclusive CPU: {a}"
    pid = r.pid(ids["guaranteed"])
    cpuset = cgroup_file(pid, "cpuset", "cpuset.cpus")
    memory = cgroup_file(pid, "memory", "memory.limit_in_bytes")
    say(
        f"guaranteed: slot {g['id']} exclusive CPU {a['cpuset']}; container cgroup cpuset.cpus={cpuset} "
        f"memory limit={memory}"
    )
    assert sorted(parse_cpulist(cpuset)) == sorted(a["cpus"]), (
        f"the Guaranteed pod's container runs on CPUs {cpuset}, its slot holds {a['cpuset']}"
    )
    assert memory == str(64 << 20), f"the Guaranteed pod's memory limit is {memory}, not 64Mi"
    # Moved by the Guaranteed container's own CreateContainer answer: already when it runs.
    shared = {pod: ids[pod] for pod in ("burstable", "besteffort")}
    for pod, ctr in shared.items():
        now = sorted(parse_cpulist(r.cgroup_cpus(ctr)))
        assert not set(now) & set(a["cpus"]), (
            f"the {pod} pod still runs on the Guaranteed pod's CPU {a['cpuset']} (its cpuset: {now})"
        )
    r.shared_cpus_follow(shared, f"the Guaranteed pod took CPU {a['cpuset']}", timeout=1.0)
    r.exclusive_disjoint()
    # The rest of the host is kept off the exclusive CPU, the pods' containers left as NRI set them.
    r.host_kept_off(a["cpus"])
    assert sorted(parse_cpulist(r.cgroup_cpus(ids["guaranteed"]))) == sorted(a["cpus"]), (
        "host partitioning moved the Guaranteed pod's container"
    )
    return ids


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of one process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_rate(pid: int, seconds: float = 3.0) -> float:
    """CPUs the process used over the next ``seconds``."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def best_effort_quota() -> float | None:
    """The CFS quota on the kubelet's ``besteffort`` QoS cgroup, in CPUs (None: none)."""
    v1 = Path("/sys/fs/cgroup/cpu") / KUBE_CGROUP_ROOT / "kubepods/besteffort"
    if (v1 / "cpu.cfs_quota_us").exists():
        quota, period = (v1 / "cpu.cfs_quota_us").read_text().strip(), (v1 / "cpu.cfs_period_us").read_text()
    else:
        quota, period = (
            (Path("/sys/fs/cgroup") / KUBE_CGROUP_ROOT / "kubepods/besteffort/cpu.max").read_text().split()
        )
    return None if quota in ("-1", "max") else int(quota) / int(period)


def step1b_best_effort_under_online_load(r: Run) -> None:
    """A spinning BestEffort pod takes what online work leaves of the shared pool: the QoS loop
    holds the kubelet's ``besteffort`` cgroup to its allowance while a Burstable pod spins there,
    and gives the CPU back when it stops."""
    r.kube.create(pod_spec("be-spin", BEST_EFFORT, script=SPINNER))
    spinner = r.pid(r.running("be-spin")["be-spin"])
    time.sleep(4)  # the loop's release periods
    alone = cpu_rate(spinner)
    quota_alone = best_effort_quota()
    say(f"best-effort spinner alone: {alone:.2f} CPU (besteffort quota {quota_alone})")
    r.kube.create(pod_spec("online-spin", ONLINE, script=SPINNER))
    online = r.pid(r.running("online-spin")["online-spin"])

    def held() -> float | None:
        quota = best_effort_quota()
        return quota if quota is not None and quota <= 0.1 else None

    quota = wait_for("the QoS loop to hold the besteffort pods under online load", held, 30)
    loaded, online_rate = cpu_rate(spinner), cpu_rate(online)
    say(
        f"under online load ({online_rate:.2f} CPU): best-effort spinner {loaded:.2f} CPU, "
        f"besteffort quota {quota:.3f} CPU"
    )
    assert loaded <= 0.25, f"the best-effort pod took {loaded:.2f} CPU beside online work"
    assert alone > loaded, f"the best-effort pod took {alone:.2f} CPU alone, {loaded:.2f} under load"
    r.kube.delete("online-spin")
    r.kube.gone("online-spin")

    def given_back() -> float | bool | None:
        quota = best_effort_quota()
        return True if quota is None else (quota if quota > 0.1 else None)

    back = wait_for("the best-effort allowance to grow back when online work stops", given_back, 30)
    say(f"online pod gone: besteffort quota {back if back is not True else 'none'}")
    r.kube.delete("be-spin")
    r.kube.gone("be-spin")


def step2_one_ledger(r: Run, ids: dict[str, str]) -> None:
    """Deleted pods free their slots; REST and pods share one ledger; a refusal in the pod's events."""
    gone = {slot_name(ids["burstable"]), slot_name(ids["besteffort"])}
    r.kube.delete("burstable", "besteffort")
    wait_for("the deleted pods' slots to be released", lambda: not gone & set(r.names()), timeout=POD_WAIT_S)
    r.kube.gone("burstable", "besteffort")
    say("Burstable and BestEffort pods deleted: their slots released")

    pod_cpus = r.slot_of(ids["guaranteed"])["assignment"]["cpus"]
    theirs = r.rest_slot_beside(pod_cpus)
    say(f"a REST guaranteed slot got CPU(s) {theirs}, not the pod's {pod_cpus}")

    # The kubelet counts CPUs free (it does not see the REST slot) and admits the pod; the agent
    # has no whole CPU left and refuses its container: CreateContainer fails with the agent's reason.
    r.kube.create(pod_spec("toobig", GUARANTEED))

    def refusal() -> str | None:
        return next((e for e in r.kube.events("toobig") if "nodeagent refused" in e), None)

    try:
        event = wait_for("the agent's refusal in the pod's events", refusal, timeout=POD_WAIT_S, every=1.0)
    except AssertionError:
        say(f"events of toobig: {r.kube.events('toobig')}")
        raise
    say(f"pod toobig refused, event: {event[:600]}")
    assert "does_not_fit" in event, f"the refusal does not say does_not_fit: {event}"
    pod = r.kube.pod("toobig")
    assert pod is not None, "the refused pod is gone"
    assert container_id(pod) is None, "the refused pod runs"
    held = {s["name"] for s in r.nri_slots()}
    assert held == {slot_name(ids["guaranteed"])}, f"slots besides the Guaranteed pod's: {held}"
    r.kube.delete("toobig")
    r.kube.gone("toobig")
    answer = r.api.delete("/v1/slots/pods-e2e-rest")
    assert answer.status_code == 204, answer.text
    say("toobig deleted, REST slot released")


#: The container reads the device (the devices cgroup lets it), and says so in its log.
DEVICE_SCRIPT = (
    "if [ -b {dev} ] && cat {dev} >/dev/null; then echo device-readable; else echo device-missing; fi; "
    + SLEEPER
)


def step3_device(r: Run, guaranteed: str) -> str:
    """A Guaranteed pod asking for the stand-in device too: allocatable, admitted, the node in its
    container, an exclusive CPU of its own (on the 2-CPU host the last one)."""
    dev = r.args.device
    wait_for(f"the node to show {r.resource}: 1 allocatable", r.device_allocatable, timeout=60)
    say(f"node allocatable {r.resource}: 1")
    resources = {"requests": GUARANTEED["requests"], "limits": {**GUARANTEED["limits"], r.resource: "1"}}
    r.kube.create(pod_spec("device", resources, script=DEVICE_SCRIPT.format(dev=dev)))
    ctr = r.running("device")["device"]
    inside = Path(f"/proc/{r.pid(ctr)}/root{dev}")
    host = os.stat(dev)
    there = os.stat(inside)
    assert stat.S_ISBLK(there.st_mode), f"{dev} in the container is no block device ({there})"
    assert there.st_rdev == host.st_rdev, f"{dev} in the container is not the host's ({there})"

    last: list[str] = []

    def logged() -> str | None:
        done = r.kube.run("logs", "device", "-n", "default", check=False)
        last[:] = [done.stderr.strip()]
        return done.stdout if done.returncode == 0 and "device-" in done.stdout else None

    try:
        out = wait_for("the device pod's log", logged, timeout=30, every=1.0)
    except AssertionError as err:
        raise AssertionError(f"{err}: kubectl logs said {last}") from None
    assert "device-readable" in out, f"the container cannot read {dev}: {out!r}"
    others = Path(f"/proc/{r.pid(guaranteed)}/root{dev}")
    assert not others.exists(), f"the Guaranteed pod, which asked for no device, has {dev} too"
    slot = r.slot_of(ctr)
    assert slot["qos"] == "guaranteed", f"the device pod's slot is {slot['qos']}, not guaranteed"
    # The slot holds the device the kubelet gave the container (the shim forwards its device nodes):
    # one ledger for devices too, so a REST slot cannot take it.
    held = slot["request"]["resources"]["devices"]
    assert held == [dev], f"the device pod's slot holds devices {held}, not [{dev}]"
    # Through CDI: the kubelet handed containerd the agent's CDI name, which containerd resolved
    # from the agent's nodeagent.io/device spec.
    cdi_name = f"nodeagent.io/device={Path(dev).name}"
    assert cdi_name in r.cri.run("inspect", ctr).stdout, (
        f"the container's config names no CDI device {cdi_name}"
    )
    body = {"name": "pods-e2e-dev", "qos": "best-effort", "resources": {"devices": [dev]}}
    refused = r.api.post("/v1/slots", json=body)
    assert refused.status_code == 409, f"a REST slot got the device pod's {dev}: {refused.text}"
    cpus = r.cgroup_cpus(ctr)
    assert sorted(parse_cpulist(cpus)) == sorted(slot["assignment"]["cpus"]), (
        f"the device pod runs on CPUs {cpus}, its slot holds {slot['assignment']['cpuset']}"
    )
    r.exclusive_disjoint()
    say(
        f"device pod runs with {dev} (block {os.major(host.st_rdev)}:{os.minor(host.st_rdev)}), "
        f"through CDI {cdi_name}, slot {slot['id']} holding it, exclusive CPU "
        f"{slot['assignment']['cpuset']}, container cpuset.cpus={cpus}; a REST slot asking for {dev}: "
        f"{refused.json()['error']['code']}"
    )
    return ctr


def snapshot(r: Run, pods: dict[str, str]) -> dict[str, str]:
    """Each pod's slot id, checked against its running container."""
    out = {}
    for pod, ctr in pods.items():
        now = r.kube.pod(pod)
        assert now is not None, f"pod {pod} is gone"
        assert container_id(now) == ctr, f"pod {pod} no longer runs container {ctr[:13]}: {now.get('status')}"
        restarts = now["status"]["containerStatuses"][0].get("restartCount", 0)
        assert restarts == 0, f"pod {pod}'s container restarted ({restarts})"
        out[pod] = r.slot_of(ctr)["id"]
    return out


def step4_restarts(r: Run, pods: dict[str, str]) -> None:
    """kubelet, containerd and agent restarts: same containers, same slots, no CPU held twice."""
    before = snapshot(r, pods)
    held = {pod: sorted(r.slot_of(ctr)["assignment"]["cpus"]) for pod, ctr in pods.items()}
    env = dict(os.environ, NODEAGENT_KUBE_WORK=str(r.work))
    cluster = Path(__file__).resolve().parents[2] / "kube" / "cluster"

    def check(after: str) -> None:
        ids = snapshot(r, pods)
        assert ids == before, f"after {after}: slot ids changed from {before} to {ids}"
        r.exclusive_disjoint()
        for pod, cpus in held.items():
            now = r.cgroup_cpus(pods[pod])
            assert sorted(parse_cpulist(now)) == cpus, f"after {after}: pod {pod} runs on {now}, not {cpus}"
        wait_for(f"{r.resource} allocatable again after {after}", r.device_allocatable, timeout=60)
        say(
            f"after {after}: pods run on {held}, slots {sorted(ids.values())} kept, device allocatable, "
            f"{r.ledger_probe([c for cpus in held.values() for c in cpus])}"
        )

    for component in ("kubelet", "containerd"):
        started = time.monotonic()
        seen = {"shim": registrations(r.args), "plugin": r.plugin_registrations()}
        done = subprocess.run(
            [str(cluster), "restart", component],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, f"kube/cluster restart {component} failed: {done.stderr.strip()}"
        if component == "containerd":
            wait_for(
                "the shim to register with the new containerd",
                more(lambda: registrations(r.args), seen["shim"]),
                60,
            )
        else:
            # The new kubelet removed the plugins' sockets: the agent serves and registers again.
            wait_for(
                "the agent's device plugin to register with the new kubelet",
                more(r.plugin_registrations, seen["plugin"]),
                60,
            )
        check(f"{component} restart ({time.monotonic() - started:.1f}s)")

    started = time.monotonic()
    plugged = r.plugin_registrations()
    r.daemon.kill()
    r.client = r.daemon.start(timeout=180)
    wait_for(
        "the restarted agent's device plugin to register", lambda: r.plugin_registrations() > plugged, 60
    )
    check(f"agent SIGKILL and restart ({time.monotonic() - started:.1f}s)")


def step5_leave_nothing(r: Run, pods: dict[str, str], baseline: dict[str, set[str]]) -> None:
    """Deleted pods free their slots; 20 pods created and deleted leave nothing behind."""
    r.kube.delete(*pods)
    wait_for("the deleted pods' slots to be released", lambda: not r.nri_slots(), timeout=POD_WAIT_S)
    r.kube.gone(*pods)
    say("Guaranteed and device pods deleted: slots released")

    started = time.monotonic()
    churn = [
        pod_spec(f"churn-{i:02d}", SMALL_BURSTABLE if i % 2 else BEST_EFFORT, label="pods-e2e-churn")
        for i in range(CHURN)
    ]
    r.kube.create(*churn)
    ids = r.running(*(p["metadata"]["name"] for p in churn), timeout=240)
    ran = time.monotonic() - started
    classes = sorted(r.slot_of(c)["qos"] for c in ids.values())
    held = {
        "cgroups": len(r.agent_cgroups() - baseline["cgroups"]),
        "cdi": len(r.cdi_specs() - baseline["cdi"]),
    }
    assert classes == ["best-effort"] * (CHURN // 2) + ["burstable"] * (CHURN - CHURN // 2), classes
    r.exclusive_disjoint()
    say(
        f"{CHURN} pods running in {ran:.1f}s, {len(ids)} slots "
        f"({CHURN // 2} burstable, {CHURN // 2} best-effort), {held['cgroups']} cgroups under the agent's "
        f"parent and {held['cdi']} CDI specs beyond those before"
    )
    started = time.monotonic()
    r.kube.delete(selector="app=pods-e2e-churn")
    wait_for(f"the {CHURN} pods' slots to be released", lambda: not r.nri_slots(), timeout=240)
    r.kube.gone(selector="app=pods-e2e-churn", timeout=240)
    say(f"{CHURN} pods deleted and gone in {time.monotonic() - started:.1f}s")

    assert r.slots() == [], f"slots left: {r.names()}"
    wait_for(
        "the agent's cgroups to be as before the first pod",
        lambda: r.agent_cgroups() == baseline["cgroups"],
        30,
    )
    wait_for("the kubelet's pod cgroups to go", lambda: not r.pod_cgroups(), timeout=POD_WAIT_S, every=1.0)
    assert r.cdi_specs() == baseline["cdi"], f"CDI specs left: {sorted(r.cdi_specs() - baseline['cdi'])}"
    r.daemon.kill()
    r.client = r.daemon.start(timeout=180)
    assert r.slots() == [], f"slots in the agent's state after a restart: {r.names()}"
    say("nothing left: no slot (also after an agent restart), no agent or pod cgroup, no CDI spec")


def run(r: Run) -> None:
    with step("agent and shim"):
        # Pods created before the kubelet has its node synced may be refused at admission.
        wait_for(
            f"node {NODE} to report its allocatable CPUs",
            lambda: r.kube.allocatable("cpu") != "0",
            timeout=60,
        )
        # The NodeResourceTopology CRD first: the agent looks for it at start (then once a minute).
        r.kube.run(
            "apply", "-f", str(Path(__file__).resolve().parents[2] / "kube/noderesourcetopology-crd.yaml")
        )
        r.kube.run("wait", "--for", "condition=established", "--timeout=60s", f"crd/{NRT_CRD}")
        r.client = r.daemon.start(timeout=180)
        start_shim(r.args, r.daemon, r.shim_log)
        baseline = {"cgroups": r.agent_cgroups(), "cdi": r.cdi_specs()}
        say(f"agent up, shim registered; agent cgroups {sorted(baseline['cgroups'])}")
        # The kubelet's pod cgroups are where pods_cgroups says: partitioning leaves them alone.
        integrations = r.api.get("/v1/node").json()["integrations"]
        assert integrations.get("nri") == [], f"GET /v1/node integrations: {integrations}"
        nrt_owned_by_the_node(r)
    with step("1. Guaranteed, Burstable, BestEffort pods"):
        ids = step1_classes(r)
    with step("1b. best-effort under online load"):
        step1b_best_effort_under_online_load(r)
    with step("2. one ledger: pod deletes, a REST slot, a refused pod"):
        step2_one_ledger(r, ids)
    with step("3. a device pod"):
        dev = step3_device(r, ids["guaranteed"])
    pods = {"guaranteed": ids["guaranteed"], "device": dev}
    with step("4. kubelet, containerd and agent restarts"):
        step4_restarts(r, pods)
    with step(f"5. deletes free slots; {CHURN} pods created and deleted leave nothing"):
        step5_leave_nothing(r, pods, baseline)
    with step("6. the agent stopped and uninstalled: the host and the kubelet's cgroups are theirs again"):
        assert r.daemon.stop() == 0, "the agent did not stop cleanly"
        r.client = None
        affinity = sorted(os.sched_getaffinity(1))
        assert affinity == sorted(os.sched_getaffinity(0)) == list(range(os.cpu_count() or 1)), affinity
        # While the agent is away best-effort keeps the loop's last allowance (its own class too);
        # uninstalling lifts it.
        kept = best_effort_quota()
        done = subprocess.run(
            [
                *nodeagent_argv(),
                "uninstall",
                "--config",
                str(r.daemon.config),
                "--state-dir",
                str(r.daemon.state),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        quota = best_effort_quota()
        assert quota is None, f"the kubelet's besteffort cgroup keeps a quota of {quota} CPU after uninstall"
        say(f"agent stopped: init and this test on CPUs {affinity}; besteffort quota {kept} -> none")
    say("PASS")


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as err:
        return f"({err})"


def diagnose(r: Run) -> None:
    """What a failure needs to be understood: the pods, their events, the components' log tails."""
    with contextlib.suppress(Exception):
        say("--- pods\n" + r.kube.run("get", "pods", "-A", "-o", "wide", check=False).stdout)
        say("--- events\n" + r.kube.run("get", "events", "-A", check=False).stdout[-4000:])
    with contextlib.suppress(Exception):
        say(f"--- agent slots: {[(s['name'][:20], s['qos'], s['state']) for s in r.slots()]}")
    for name, path in (
        ("kubelet.log", r.work / "log" / "kubelet.log"),
        ("containerd.log", r.work / "log" / "containerd.log"),
        ("agent daemon.log", r.daemon.log_path),
        ("shim.log", r.shim_log),
    ):
        say(f"--- {name} (tail)\n{tail(path)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, required=True, help="kube/build's bin directory")
    parser.add_argument("--shim", type=Path, required=True, help="the nri-shim binary")
    parser.add_argument("--work", type=Path, required=True, help="kube/cluster's work directory")
    parser.add_argument("--device", required=True, help="the device node standing in for an accelerator")
    parser.add_argument(
        "--device-plugin-dir", type=Path, required=True, help="where the kubelet's kubelet.sock is"
    )
    args = parser.parse_args(argv)
    args.procs, args.pods = [], []
    agent_dir = Path(tempfile.mkdtemp(prefix="pods-e2e-agent-"))
    daemon = nri_agent(
        agent_dir,
        "np",
        PARENT,
        partitioning="auto",
        placement=f'allowed_devices = ["{args.device}"]',
        # Specs where containerd reads them: the device plugin answers the device's CDI name.
        cdi=f'dir = "{args.work / "cdi"}"\ndevice_specs = true',
        kubernetes=(
            f'device_plugin = true\ndevice_plugin_dir = "{args.device_plugin_dir}/"\n'
            f'pods_cgroups = ["{KUBE_CGROUP_ROOT}/kubepods"]\n'
            f'node_resource_topology = true\nkubeconfig = "{args.work / "admin.kubeconfig"}"\n'
            f'node_name = "{NODE}"\n'
        ),
    )
    r = Run(args, daemon)
    # A SIGTERM (a CI timeout) ends the run through ``finally``: the agent, its keeper and the shim
    # must not outlive it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    status = 1
    started = time.monotonic()
    try:
        run(r)
        status = 0
    except (
        AssertionError,
        OSError,
        KeyError,
        ValueError,
        subprocess.SubprocessError,
        httpx.HTTPError,
    ) as err:
        say(f"FAIL: {err}" if isinstance(err, AssertionError) else f"FAIL: {type(err).__name__}: {err}")
        diagnose(r)
    finally:
        clean_up(args, daemon, r.cri, tell=say)
        keep = os.environ.get("KUBE_KEEP_LOGS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for path in (daemon.log_path, r.shim_log):
                if path.exists():
                    shutil.copy(path, Path(keep) / f"agent-{path.name}")
        shutil.rmtree(agent_dir, ignore_errors=True)
        say(f"checks took {time.monotonic() - started:.1f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
