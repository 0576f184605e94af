"""This node's per-NUMA capacity as a NodeResourceTopology object ([kubernetes] node_resource_topology).

The topology-aware scheduler plugin (kubernetes-sigs/scheduler-plugins, NodeResourceTopologyMatch)
reads one ``NodeResourceTopology`` (``topology.node.k8s.io/v1alpha2``, a cluster-scoped custom
resource named after the Node) per node and sends a Guaranteed pod only to a node where one NUMA
zone has room for each of its containers. This module is the agent's side of that:

- ``node_resource_topology``, pure: the topology and the ledger's typed capacity
  (``SlotManager.capacity_report``) -> a ``NodeResourceTopology`` record, one zone per NUMA node
  (``node-<n>``, type ``Node``) with ``cpu`` (exclusive CPUs), ``memory`` and the device plugin's
  resources (``nodeagent.io/gpu``, ``nodeagent.io/mig-<profile>``, ``nodeagent.io/fpga``), the SLIT
  distances as costs, and the placement policy as attributes; ``to_json`` is the object's body.
- ``NrtPublisher``: a thread that keeps that object on the API server while the CRD is installed:
  it looks for the CRD (absent: nothing is written, and it looks again every minute), then reads the
  object and creates it (404) or replaces it with the resourceVersion it read (a 409 reads again),
  only when its content differs. A ledger change wakes it (at most one write a second); it also
  passes every minute, which puts back an object someone deleted. A failure is logged, kept in
  ``problems`` and retried with a doubling backoff; the agent never waits on it.
- ``KubernetesNrtApi``: the API server through the official ``kubernetes`` client (kubeconfig and
  in-cluster service-account loading, TLS, token refresh are its), imported only when the feature
  is on (the optional extra ``nodeagent[kubernetes]``). Only its dict-based custom-object calls are
  used, so no generated model parses the CRD's schema.

The object is left in place when the agent stops: the scheduler keeps the last numbers through a
restart (the next start rewrites them at once), as it keeps a kubelet's node status. It names the
Node as its owner (``ownerReferences``, the Node's uid read on each timer pass), so deleting the
Node deletes it too (the garbage collector's cascade); where the Node cannot be read (not yet
registered, or no ``get`` on nodes) it is written without an owner and the owner added later.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nodeagent.agent.deviceplugin import resource_label, resource_name
from nodeagent.devices.topology import Topology
from nodeagent.errors import NodeAgentError
from nodeagent.placement import Capacity, ResourceCapacity

log = logging.getLogger(__name__)

GROUP = "topology.node.k8s.io"
VERSION = "v1alpha2"
PLURAL = "noderesourcetopologies"
CRD_NAME = f"{PLURAL}.{GROUP}"
KIND = "NodeResourceTopology"
ZONE_TYPE = "Node"
#: What the agent's placement does, in the kubelet Topology Manager's words the scheduler plugin
#: reads: each container is its own slot (scope ``container``), and a guaranteed slot's CPUs,
#: memory and devices come from one NUMA node whenever one has room. ``single-numa-node`` makes
#: the scheduler send a Guaranteed pod only to a node where one zone fits each container, so the
#: agent's one-node placement always finds its node.
TOPOLOGY_MANAGER_POLICY = "single-numa-node"
TOPOLOGY_MANAGER_SCOPE = "container"
#: The same, in v1alpha2's deprecated field that older scheduler plugins still read.
LEGACY_TOPOLOGY_POLICY = "SingleNUMANodeContainerLevel"


# =========================================================================== the object (pure)


@dataclass(frozen=True)
class ZoneResource:
    """One resource of a zone, in the resource's unit (CPUs, bytes, devices)."""

    name: str
    capacity: int | float
    allocatable: int | float
    available: int | float


@dataclass(frozen=True)
class NumaZone:
    name: str
    resources: tuple[ZoneResource, ...]
    #: (zone name, SLIT distance) to every zone, itself included; empty when the host gives none
    costs: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class NodeResourceTopology:
    node_name: str
    zones: tuple[NumaZone, ...]
    policy: str = TOPOLOGY_MANAGER_POLICY
    scope: str = TOPOLOGY_MANAGER_SCOPE

    def to_json(self, node_uid: str | None = None) -> dict[str, Any]:
        """The object's body as the API server takes it (metadata without a resourceVersion);
        ``node_uid``: the Node's, to name it as the owner."""
        metadata: dict[str, Any] = {"name": self.node_name}
        if node_uid:
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node_uid}
            metadata["ownerReferences"] = [owner]
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": metadata,
            "topologyPolicies": [LEGACY_TOPOLOGY_POLICY],
            "attributes": [
                {"name": "topologyManagerPolicy", "value": self.policy},
                {"name": "topologyManagerScope", "value": self.scope},
            ],
            "zones": [
                {
                    "name": zone.name,
                    "type": ZONE_TYPE,
                    **({"costs": [{"name": n, "value": v} for n, v in zone.costs]} if zone.costs else {}),
                    "resources": [
                        {
                            "name": r.name,
                            "capacity": quantity(r.capacity),
                            "allocatable": quantity(r.allocatable),
                            "available": quantity(r.available),
                        }
                        for r in zone.resources
                    ],
                }
                for zone in self.zones
            ],
        }


def quantity(value: int | float) -> str:
    """A Kubernetes quantity: whole numbers as they are, fractions in thousandths ("1500m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def zone_name(numa: int) -> str:
    return f"node-{numa}"


def node_resource_topology(
    node_name: str, topology: Topology, capacity: Capacity, *, devices: bool
) -> NodeResourceTopology:
    """This node's zones from the topology and the ledger's capacity.

    ``cpu`` is the agent's exclusive CPUs (capacity: the node's CPUs; allocatable: without the
    reserved ones; available: not held by a slot), the unit a Guaranteed pod's CPUs come in.
    ``memory`` is the node's memory and what no slot bound to it holds (absent where the host
    does not say the node's size). ``devices``: the device plugin serves this node's accelerators,
    so each class with a device on the node is listed under the plugin's name; what the agent's
    own slots hold is not available (devices the kubelet gave to pods are not known here).
    """
    zones = []
    for node in topology.numa_nodes:
        cap = capacity.by_numa.get(node.id, {})
        resources = []
        if "cpus" in cap:
            resources.append(_resource("cpu", cap["cpus"]))
        if node.memory_bytes is not None and "memory_bytes" in cap:
            resources.append(_resource("memory", cap["memory_bytes"]))
        if devices:
            resources += _devices(topology, capacity, node.id)
        costs: tuple[tuple[str, int], ...] = ()
        if node.distances is not None:
            costs = tuple(
                (zone_name(other.id), distance)
                for other, distance in zip(topology.numa_nodes, node.distances, strict=True)
            )
        zones.append(NumaZone(zone_name(node.id), tuple(resources), costs))
    return NodeResourceTopology(node_name, tuple(zones))


def _resource(name: str, cap: ResourceCapacity, total: int | float | None = None) -> ZoneResource:
    return ZoneResource(name, cap.total if total is None else total, cap.allocatable, cap.free)


def _devices(topology: Topology, capacity: Capacity, numa: int) -> list[ZoneResource]:
    out = []
    cap = capacity.by_numa.get(numa, {})
    # Whole GPUs: those in MIG mode are offered as their instances (agent/deviceplugin.py), so
    # they are not part of nodeagent.io/gpu's capacity; unhealthy ones are, but not allocatable.
    whole = sum(1 for g in topology.gpus if g.numa == numa and not (g.mig is not None and g.mig.enabled))
    if whole and "gpus" in cap:
        out.append(_resource(resource_name("gpu"), cap["gpus"], whole))
    for profile, mig in sorted(capacity.mig_by_numa.get(numa, {}).items()):
        out.append(_resource(resource_name(f"mig-{resource_label(profile)}"), mig))
    if "fpgas" in cap and cap["fpgas"].total:
        out.append(_resource(resource_name("fpga"), cap["fpgas"]))
    return out


# =========================================================================== the API server


class NrtApiError(NodeAgentError):
    code = "kubernetes_api"


class NrtClientConfigError(NrtApiError):
    """The client or its configuration (kubeconfig, service account) cannot be loaded."""


class NrtConflict(NrtApiError):
    """409: the object changed (or was created) since it was read."""


class NrtNotServed(NrtApiError):
    """404 on the resource type itself: the CRD was removed."""


@dataclass(frozen=True)
class StoredNrt:
    """The object as the API server has it: what a replace must name, and what it says."""

    resource_version: str
    body: Mapping[str, Any]

    def says(self, body: Mapping[str, Any]) -> bool:
        """Whether it already says what ``body`` says (then there is nothing to write); an owner
        ``body`` does not name is not taken away."""
        same = all(self.body.get(k) == body.get(k) for k in ("zones", "attributes", "topologyPolicies"))
        owners = body.get("metadata", {}).get("ownerReferences")
        return same and (owners is None or self.body.get("metadata", {}).get("ownerReferences") == owners)


class NrtApi(Protocol):
    """The calls the publisher makes; each raises NrtApiError (or a subclass) on failure."""

    def crd_served(self) -> bool:
        """Whether the CRD is installed and serves v1alpha2."""
        ...

    def read(self, name: str) -> StoredNrt | None:
        """The object, or None when there is none."""
        ...

    def create(self, body: Mapping[str, Any]) -> None: ...

    def replace(self, name: str, body: Mapping[str, Any]) -> None: ...

    def node_uid(self, name: str) -> str | None:
        """The Node's uid, or None when there is no such Node."""
        ...

    def close(self) -> None:
        """Let go of its connections."""
        ...


def client_installed() -> bool:
    return importlib.util.find_spec("kubernetes") is not None


class KubernetesNrtApi:
    """NrtApi through the official client: ``kubeconfig`` is a kubeconfig file, or "" for the
    pod's in-cluster service account. Raises NrtApiError when that configuration cannot be loaded."""

    def __init__(self, kubeconfig: str, *, timeout_s: float = 10.0) -> None:
        if not client_installed():
            raise NrtClientConfigError(
                "[kubernetes] node_resource_topology is on but the kubernetes Python client is not "
                "installed; install it with the agent (pip install 'nodeagent[kubernetes]') or set "
                "node_resource_topology = false"
            )
        # Lazily: the client and its generated models cost the daemon memory it only pays here.
        from kubernetes import client, config  # noqa: PLC0415
        from kubernetes.client.rest import ApiException  # noqa: PLC0415
        from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415

        configuration = client.Configuration()
        where = kubeconfig or "the in-cluster service account"
        try:
            if kubeconfig:
                config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            else:
                config.load_incluster_config(client_configuration=configuration)
        except (ConfigException, OSError, ValueError, TypeError, KeyError) as err:
            raise NrtClientConfigError(
                f"[kubernetes] kubeconfig: cannot load {where}: {err}; "
                + (
                    "check the file, or leave the key empty inside a pod"
                    if kubeconfig
                    else "outside a pod, set [kubernetes] kubeconfig to a kubeconfig file"
                )
            ) from err
        # The publisher has its own backoff: one try per call, bounded in time.
        configuration.retries = False
        self._where = where
        # Every call bounded (connect, read), so close() never waits long on a hung server.
        self._bounded: dict[str, Any] = {"_request_timeout": (timeout_s, timeout_s)}
        self._api_exception: type[Exception] = ApiException
        self._client = client.ApiClient(configuration)
        self._objects = client.CustomObjectsApi(self._client)
        self._core = client.CoreV1Api(self._client)

    def close(self) -> None:
        self._client.close()

    def crd_served(self) -> bool:
        try:
            crd = self._call(
                lambda: self._objects.get_cluster_custom_object(
                    "apiextensions.k8s.io", "v1", "customresourcedefinitions", CRD_NAME, **self._bounded
                ),
                f"read the CRD {CRD_NAME}",
            )
        except NrtNotServed:
            return False
        versions = crd.get("spec", {}).get("versions", [])
        return any(v.get("name") == VERSION and v.get("served") for v in versions)

    def read(self, name: str) -> StoredNrt | None:
        try:
            body = self._call(
                lambda: self._objects.get_cluster_custom_object(
                    GROUP, VERSION, PLURAL, name, **self._bounded
                ),
                f"read {KIND} {name}",
            )
        except NrtNotServed:
            return None
        return StoredNrt(str(body.get("metadata", {}).get("resourceVersion", "")), body)

    def create(self, body: Mapping[str, Any]) -> None:
        self._call(
            lambda: self._objects.create_cluster_custom_object(
                GROUP, VERSION, PLURAL, dict(body), **self._bounded
            ),
            f"create {KIND} {body['metadata']['name']}",
        )

    def replace(self, name: str, body: Mapping[str, Any]) -> None:
        self._call(
            lambda: self._objects.replace_cluster_custom_object(
                GROUP, VERSION, PLURAL, name, dict(body), **self._bounded
            ),
            f"replace {KIND} {name}",
        )

    def node_uid(self, name: str) -> str | None:
        try:
            # The raw answer: no generated model is built for a whole Node (its status is large).
            answer = self._call(
                lambda: self._core.read_node(name, _preload_content=False, **self._bounded),
                f"read Node {name}",
            )
        except NrtNotServed:
            return None
        uid = json.loads(answer.data).get("metadata", {}).get("uid")
        return str(uid) if uid else None

    def _call(self, call: Callable[[], Any], what: str) -> Any:
        try:
            return call()
        except self._api_exception as err:
            status = getattr(err, "status", None)
            text = f"{what} on the API server ({self._where}): {status} {getattr(err, 'reason', '')}"
            if status == 404:
                raise NrtNotServed(text) from err
            if status == 409:
                raise NrtConflict(text) from err
            if status in (401, 403):
                text += (
                    "; the agent's identity needs get, create and update on "
                    f"{PLURAL}.{GROUP}, get on the CRD {CRD_NAME} and get on nodes (docs/kubernetes.md)"
                )
            raise NrtApiError(text) from err
        except Exception as err:  # urllib3's connection, TLS and timeout errors: all mean "retry later"
            raise NrtApiError(f"{what}: the API server ({self._where}) did not answer: {err}") from err


# =========================================================================== the publisher


class CapacitySource(Protocol):
    """What the publisher reads (SlotManager provides both)."""

    def topology(self) -> Topology: ...

    def capacity_report(self) -> Capacity: ...


@dataclass(frozen=True)
class PublisherTiming:
    #: a pass even without a change: puts back a deleted object, catches a missed write
    resync_s: float = 60.0
    #: how often an absent CRD is looked for again
    crd_check_s: float = 60.0
    #: the least time between two writes, so a burst of ledger changes is one write
    min_interval_s: float = 1.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    #: tries of read-then-write when each write meets a conflict
    conflict_tries: int = 3


class NrtPublisher:
    """Keeps this node's NodeResourceTopology on the API server; ``start``, ``notify_change``,
    ``close``. ``connect`` makes the API (called on the publisher's thread, again after a failure
    to connect), so a missing kubeconfig is a retried problem, not a failed start."""

    def __init__(
        self,
        source: CapacitySource,
        node_name: str,
        connect: Callable[[], NrtApi],
        *,
        devices: bool = False,
        timing: PublisherTiming | None = None,
    ) -> None:
        self._source = source
        self._node = node_name
        self._connect = connect
        self._devices = devices
        self._timing = timing or PublisherTiming()
        self._api: NrtApi | None = None
        self._crd_served = False
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._problem: str | None = None
        self._note: str | None = None
        #: the body last found on the server as it should be (None: not yet, or the CRD went away)
        self._last_body: dict[str, Any] | None = None
        #: the Node's uid as last read (None: not found): the object's owner; read yet or not
        self._node_uid: str | None = None
        self._node_read = False
        self._owner_note: str | None = None  # what was last logged of the owner, said once
        self._failures = 0
        self._published = 0
        self._thread: threading.Thread | None = None

    @property
    def node_name(self) -> str:
        return self._node

    @property
    def publishes(self) -> int:
        """How many passes found the object as it should be (written or already so)."""
        with self._lock:
            return self._published

    def problems(self) -> tuple[str, ...]:
        """What keeps the object from being current now (empty when it is, or when the CRD is
        simply not installed: that is a choice of the cluster, not a fault)."""
        with self._lock:
            return () if self._problem is None else (self._problem,)

    def crd_served(self) -> bool:
        with self._lock:
            return self._crd_served

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nrt-publisher", daemon=True)
        self._thread.start()

    def notify_change(self) -> None:
        """The ledger changed: publish soon. Never blocks (the manager calls it)."""
        self._changed.set()

    def close(self) -> None:
        """Stop the thread (a call in flight ends within its timeout); the object stays."""
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join()
        api, self._api = self._api, None
        if api is not None:
            api.close()

    def _run(self) -> None:
        t = self._timing
        now = time.monotonic()
        next_pass = now  # the first pass at once
        hold_until = 0.0  # after a failure or with no CRD, changes wait for this too
        last_pass = now - t.min_interval_s
        while True:
            self._changed.wait(max(0.0, next_pass - time.monotonic()))
            if self._stop.is_set():
                return
            now = time.monotonic()
            if self._changed.is_set():
                earliest = max(hold_until, last_pass + t.min_interval_s)
                if now < earliest and self._stop.wait(earliest - now):
                    return
            elif now < next_pass:
                continue
            # A pass woken by a change may skip the API server when the numbers did not move; a
            # timer's pass always reads the object (a deleted or edited object is put right).
            resync = not self._changed.is_set()
            self._changed.clear()
            last_pass = time.monotonic()
            delay, held = self.publish_once(resync=resync)
            next_pass = time.monotonic() + delay
            hold_until = next_pass if held else 0.0

    def publish_once(self, *, resync: bool = True) -> tuple[float, bool]:
        """One pass; returns the seconds until the next, and whether ledger changes must wait for
        it too (a failure's backoff, or no CRD to write to). Without ``resync``, a body equal to
        the one last published is not sent (no request at all)."""
        t = self._timing
        try:
            if self._api is None:
                self._api = self._connect()
            if not self._crd_served:
                served = self._api.crd_served()
                with self._lock:
                    self._crd_served = served
                if not served:
                    self._settle(
                        None,
                        f"the {CRD_NAME} CRD (serving {VERSION}) is not installed: nothing published; "
                        f"looking again every {t.crd_check_s:g} s",
                    )
                    return t.crd_check_s, True
            if resync or not self._node_read:
                self._node_uid = self._read_node_uid(self._api)
                self._node_read = True
            body = node_resource_topology(
                self._node, self._source.topology(), self._source.capacity_report(), devices=self._devices
            ).to_json(self._node_uid)
            if resync or body != self._last_body:
                self._last_body = None
                self._write(self._api, body)
                self._last_body = body
        except NrtNotServed as err:
            with self._lock:
                self._crd_served = False
            self._settle(
                None, f"the {CRD_NAME} CRD went away ({err}); looking again every {t.crd_check_s:g} s"
            )
            return t.crd_check_s, True
        except Exception as err:  # noqa: BLE001 - every failure: kept, logged once, retried with backoff
            # (a failed connect leaves no API: the next pass loads the configuration again)
            delay = self._backoff()
            self._settle(f"NodeResourceTopology {self._node} not published: {err}", retry_s=delay)
            return delay, True
        with self._lock:
            self._published += 1
        self._failures = 0
        self._settle(None)
        return t.resync_s, False

    def _read_node_uid(self, api: NrtApi) -> str | None:
        """The Node's uid, read again on each timer pass (a Node deleted and registered again has a
        new one, and an owner of the old uid would have the object collected); the last one known
        when the read fails, since the object is worth publishing without an owner."""
        uid: str | None
        note: str | None
        try:
            uid = api.node_uid(self._node)
        except NrtApiError as err:
            uid, note = self._node_uid, f"the Node could not be read ({err})"
        else:
            note = None if uid is not None else "there is no such Node (yet)"
        if note != self._owner_note and uid is None:
            log.warning(
                "NodeResourceTopology %s published without the Node as its owner: %s", self._node, note
            )
        self._owner_note = note
        return uid

    def _backoff(self) -> float:
        t = self._timing
        delay = min(t.backoff_max_s, t.backoff_initial_s * 2.0**self._failures)
        self._failures += 1
        return delay

    def _write(self, api: NrtApi, body: Mapping[str, Any]) -> None:
        for _ in range(self._timing.conflict_tries):
            stored = api.read(self._node)
            try:
                if stored is None:
                    api.create(body)
                    log.info("NodeResourceTopology created", extra={"node": self._node})
                elif not stored.says(body):
                    metadata = {**body["metadata"], "resourceVersion": stored.resource_version}
                    api.replace(self._node, {**body, "metadata": metadata})
            except NrtConflict:
                continue  # changed or created by someone else since the read: read again
            return
        raise NrtApiError(
            f"{KIND} {self._node}: every one of {self._timing.conflict_tries} writes met a conflict "
            "(another writer keeps changing it)"
        )

    def _settle(self, problem: str | None, note: str | None = None, *, retry_s: float = 0.0) -> None:
        """Record the current problem (None: none) and log each new problem or note once."""
        with self._lock:
            previous, self._problem = self._problem, problem
            fresh_note = note is not None and note != self._note
            self._note = note
        if problem is not None and problem != previous:
            log.warning("%s (retrying with backoff, next in %g s)", problem, retry_s)
        elif problem is None and previous is not None and note is None:
            log.info("NodeResourceTopology published again", extra={"node": self._node})
        if fresh_note:
            log.info("%s", note)


__all__ = [
    "CRD_NAME",
    "GROUP",
    "PLURAL",
    "VERSION",
    "CapacitySource",
    "KubernetesNrtApi",
    "NodeResourceTopology",
    "NrtApi",
    "NrtApiError",
    "NrtClientConfigError",
    "NrtConflict",
    "NrtNotServed",
    "NrtPublisher",
    "NumaZone",
    "PublisherTiming",
    "StoredNrt",
    "ZoneResource",
    "client_installed",
    "node_resource_topology",
    "quantity",
    "zone_name",
]
