"""The host's topology as plain frozen dataclasses, and its JSON form ``nodeagent.topology/v1``.

The JSON field names are a contract (``nodeagent topology --json``, ``nodeagent plan --topology``,
``GET /v1/topology``): extend, never rename. Unknown or missing values are ``null``, never guessed.
Fields beyond design.md's list (``isolated_cpus``, a GPU's ``minor``/``healthy``/``health_events``,
an FPGA's ``driver``/``healthy``/``sriov``, MIG instance details) are additions to the v1 format;
readers ignore fields they do not know.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from nodeagent.errors import InvalidRequest

SCHEMA = "nodeagent.topology/v1"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Cpu:
    id: int
    core: int  #: host-wide unique physical core index; hyperthread siblings share it
    socket: int
    numa: int
    l3: int | None  #: host-wide L3 cache id (None when the kernel does not say)
    online: bool


@dataclass(frozen=True, slots=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    memory_bytes: int | None
    distances: tuple[int, ...] | None  #: row of the SLIT, indexed by position in numa_nodes


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG GPU instance with its compute instance (the unit a slot receives)."""

    gpu_instance_id: int
    compute_instance_id: int | None
    profile: str  #: e.g. "1g.10gb", "3g.40gb"
    placement_start: int | None
    placement_size: int | None
    uuid: str | None  #: "MIG-..." UUID, what CUDA_VISIBLE_DEVICES takes
    memory_bytes: int | None
    device_nodes: tuple[str, ...] = ()  #: /dev/nvidia-caps/nvidia-capN nodes granting access


@dataclass(frozen=True, slots=True)
class MigState:
    enabled: bool
    instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str
    numa: int | None
    memory_bytes: int | None
    mig: MigState | None
    minor: int | None = None  #: /dev/nvidia<minor>
    healthy: bool | None = None  #: None: health unknown
    health_events: tuple[str, ...] = ()  #: why it is unhealthy, e.g. "xid 79"


@dataclass(frozen=True, slots=True)
class Sriov:
    total_vfs: int
    num_vfs: int


@dataclass(frozen=True, slots=True)
class Fpga:
    id: str
    vendor: str  #: PCI vendor id, "0x10ee"
    device: str  #: PCI device id
    pci_bus_id: str
    numa: int | None
    device_nodes: tuple[str, ...]
    driver: str | None = None
    healthy: bool | None = None
    sriov: Sriov | None = None


@dataclass(frozen=True)
class Topology:
    hostname: str
    cpus: tuple[Cpu, ...]
    numa_nodes: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...] = ()
    fpgas: tuple[Fpga, ...] = ()
    memory_bytes: int | None = None
    isolated_cpus: frozenset[int] = field(default_factory=frozenset)

    # Derived indexes: computed once, the dataclass is frozen.
    @cached_property
    def cpu_by_id(self) -> Mapping[int, Cpu]:
        return {c.id: c for c in self.cpus}

    @cached_property
    def online_cpus(self) -> frozenset[int]:
        return frozenset(c.id for c in self.cpus if c.online)

    @cached_property
    def cores(self) -> Mapping[int, tuple[int, ...]]:
        """Physical core -> its CPUs (hyperthread siblings), online or not, sorted."""
        out: dict[int, list[int]] = {}
        for c in self.cpus:
            out.setdefault(c.core, []).append(c.id)
        return {core: tuple(sorted(ids)) for core, ids in sorted(out.items())}

    @cached_property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted({c.socket for c in self.cpus}))

    def numa_node(self, node_id: int) -> NumaNode:
        for n in self.numa_nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def distance(self, a: int, b: int) -> int | None:
        """SLIT distance between two NUMA nodes (None when unknown)."""
        ids = [n.id for n in self.numa_nodes]
        row = self.numa_node(a).distances
        if row is None or b not in ids or ids.index(b) >= len(row):
            return None
        return row[ids.index(b)]


# --------------------------------------------------------------------------- JSON out


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "hostname": topo.hostname,
        "cpus": [
            {"id": c.id, "core": c.core, "socket": c.socket, "numa": c.numa, "l3": c.l3, "online": c.online}
            for c in topo.cpus
        ],
        "numa_nodes": [
            {
                "id": n.id,
                "cpus": list(n.cpus),
                "memory_bytes": n.memory_bytes,
                "distances": list(n.distances) if n.distances is not None else None,
            }
            for n in topo.numa_nodes
        ],
        "gpus": [_gpu_to_dict(g) for g in topo.gpus],
        "fpgas": [_fpga_to_dict(f) for f in topo.fpgas],
        "memory_bytes": topo.memory_bytes,
        "isolated_cpus": sorted(topo.isolated_cpus),
    }


def _gpu_to_dict(g: Gpu) -> dict[str, Any]:
    mig: dict[str, Any] | None = None
    if g.mig is not None:
        mig = {
            "enabled": g.mig.enabled,
            "instances": [
                {
                    "gpu_instance_id": m.gpu_instance_id,
                    "compute_instance_id": m.compute_instance_id,
                    "profile": m.profile,
                    "placement": (
                        None
                        if m.placement_start is None
                        else {"start": m.placement_start, "size": m.placement_size}
                    ),
                    "uuid": m.uuid,
                    "memory_bytes": m.memory_bytes,
                    "device_nodes": list(m.device_nodes),
                }
                for m in g.mig.instances
            ],
        }
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "pci_bus_id": g.pci_bus_id,
        "numa": g.numa,
        "memory_bytes": g.memory_bytes,
        "mig": mig,
        "minor": g.minor,
        "healthy": g.healthy,
        "health_events": list(g.health_events),
    }


def _fpga_to_dict(f: Fpga) -> dict[str, Any]:
    return {
        "id": f.id,
        "vendor": f.vendor,
        "device": f.device,
        "pci_bus_id": f.pci_bus_id,
        "numa": f.numa,
        "device_nodes": list(f.device_nodes),
        "driver": f.driver,
        "healthy": f.healthy,
        "sriov": None if f.sriov is None else {"total_vfs": f.sriov.total_vfs, "num_vfs": f.sriov.num_vfs},
    }


# --------------------------------------------------------------------------- JSON in


class _Reader:
    """Strict field access on decoded JSON that names the offending path in its errors."""

    def __init__(self, obj: Any, path: str) -> None:
        if not isinstance(obj, dict):
            raise _bad(path, "an object", obj)
        self.obj: dict[str, Any] = obj
        self.path = path

    def _get(self, key: str, required: bool) -> Any:
        if key not in self.obj:
            if required:
                raise InvalidRequest(f"topology: {self.path}.{key} is missing; it is required by {SCHEMA}")
            return None
        return self.obj[key]

    def integer(self, key: str, *, required: bool = True, nullable: bool = False) -> Any:
        v = self._get(key, required)
        if v is None and (nullable or not required):
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _bad(f"{self.path}.{key}", "a non-negative integer" + (" or null" if nullable else ""), v)
        return v

    def string(self, key: str, *, required: bool = True, nullable: bool = False) -> Any:
        v = self._get(key, required)
        if v is None and (nullable or not required):
            return None
        if not isinstance(v, str):
            raise _bad(f"{self.path}.{key}", "a string" + (" or null" if nullable else ""), v)
        return v

    def boolean(self, key: str, *, required: bool = True, nullable: bool = False) -> Any:
        v = self._get(key, required)
        if v is None and (nullable or not required):
            return None
        if not isinstance(v, bool):
            raise _bad(f"{self.path}.{key}", "true or false", v)
        return v

    def array(self, key: str, *, required: bool = True, nullable: bool = False) -> list[Any] | None:
        v = self._get(key, required)
        if v is None and (nullable or not required):
            return None
        if not isinstance(v, list):
            raise _bad(f"{self.path}.{key}", "a list", v)
        return v

    def integers(self, key: str, *, required: bool = True, nullable: bool = False) -> tuple[int, ...] | None:
        items = self.array(key, required=required, nullable=nullable)
        if items is None:
            return None
        for i, v in enumerate(items):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise _bad(f"{self.path}.{key}[{i}]", "a non-negative integer", v)
        return tuple(items)

    def objects(self, key: str, parse: Callable[[_Reader], T], *, required: bool = True) -> tuple[T, ...]:
        items = self.array(key, required=required) or []
        return tuple(parse(_Reader(item, f"{self.path}.{key}[{i}]")) for i, item in enumerate(items))


def _bad(path: str, expected: str, got: Any) -> InvalidRequest:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InvalidRequest(f"topology: {path} must be {expected}, got {shown}")


def _cpu(r: _Reader) -> Cpu:
    return Cpu(
        id=r.integer("id"),
        core=r.integer("core"),
        socket=r.integer("socket"),
        numa=r.integer("numa"),
        l3=r.integer("l3", nullable=True),
        online=r.boolean("online"),
    )


def _numa(r: _Reader) -> NumaNode:
    return NumaNode(
        id=r.integer("id"),
        cpus=r.integers("cpus") or (),
        memory_bytes=r.integer("memory_bytes", nullable=True),
        distances=r.integers("distances", nullable=True),
    )


def _mig_instance(r: _Reader) -> MigInstance:
    placement = r.obj.get("placement")
    start = size = None
    if placement is not None:
        p = _Reader(placement, f"{r.path}.placement")
        start, size = p.integer("start"), p.integer("size")
    return MigInstance(
        gpu_instance_id=r.integer("gpu_instance_id"),
        compute_instance_id=r.integer("compute_instance_id", required=False, nullable=True),
        profile=r.string("profile"),
        placement_start=start,
        placement_size=size,
        uuid=r.string("uuid", required=False, nullable=True),
        memory_bytes=r.integer("memory_bytes", required=False, nullable=True),
        device_nodes=tuple(_strings(r, "device_nodes")),
    )


def _strings(r: _Reader, key: str, *, required: bool = False) -> list[str]:
    items = r.array(key, required=required) or []
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise _bad(f"{r.path}.{key}[{i}]", "a string", v)
    return items


def _gpu(r: _Reader) -> Gpu:
    mig_obj = r.obj.get("mig")
    mig = None
    if mig_obj is not None:
        m = _Reader(mig_obj, f"{r.path}.mig")
        mig = MigState(
            enabled=m.boolean("enabled"), instances=m.objects("instances", _mig_instance, required=False)
        )
    return Gpu(
        index=r.integer("index"),
        uuid=r.string("uuid", nullable=True),
        name=r.string("name", nullable=True),
        pci_bus_id=r.string("pci_bus_id"),
        numa=r.integer("numa", nullable=True),
        memory_bytes=r.integer("memory_bytes", nullable=True),
        mig=mig,
        minor=r.integer("minor", required=False, nullable=True),
        healthy=r.boolean("healthy", required=False, nullable=True),
        health_events=tuple(_strings(r, "health_events")),
    )


def _fpga(r: _Reader) -> Fpga:
    sriov_obj = r.obj.get("sriov")
    sriov = None
    if sriov_obj is not None:
        s = _Reader(sriov_obj, f"{r.path}.sriov")
        sriov = Sriov(total_vfs=s.integer("total_vfs"), num_vfs=s.integer("num_vfs"))
    return Fpga(
        id=r.string("id"),
        vendor=r.string("vendor"),
        device=r.string("device"),
        pci_bus_id=r.string("pci_bus_id"),
        numa=r.integer("numa", nullable=True),
        device_nodes=tuple(_strings(r, "device_nodes", required=True)),
        driver=r.string("driver", required=False, nullable=True),
        healthy=r.boolean("healthy", required=False, nullable=True),
        sriov=sriov,
    )


def topology_from_dict(obj: Any) -> Topology:
    """Build a Topology from decoded ``nodeagent.topology/v1`` JSON, checking every field.

    Raises InvalidRequest naming the first offending field and what it should be.
    """
    r = _Reader(obj, "$")
    schema = r.string("schema")
    if schema != SCHEMA:
        raise InvalidRequest(f"topology: schema is {schema!r}; this agent reads {SCHEMA!r}")
    topo = Topology(
        hostname=r.string("hostname"),
        cpus=r.objects("cpus", _cpu),
        numa_nodes=r.objects("numa_nodes", _numa),
        gpus=r.objects("gpus", _gpu),
        fpgas=r.objects("fpgas", _fpga),
        memory_bytes=r.integer("memory_bytes", nullable=True),
        isolated_cpus=frozenset(r.integers("isolated_cpus", required=False) or ()),
    )
    _check_consistency(topo)
    return topo


def _check_consistency(topo: Topology) -> None:
    ids = [c.id for c in topo.cpus]
    if len(ids) != len(set(ids)):
        raise InvalidRequest("topology: a CPU id appears twice in $.cpus; each CPU must be listed once")
    node_ids = {n.id for n in topo.numa_nodes}
    if len(node_ids) != len(topo.numa_nodes):
        raise InvalidRequest("topology: a NUMA node id appears twice in $.numa_nodes")
    for c in topo.cpus:
        if node_ids and c.numa not in node_ids:
            raise InvalidRequest(
                f"topology: CPU {c.id} is on NUMA node {c.numa}, "
                f"which is not in $.numa_nodes {sorted(node_ids)}"
            )
    known = set(ids)
    for n in topo.numa_nodes:
        stray = set(n.cpus) - known
        if stray:
            raise InvalidRequest(
                f"topology: NUMA node {n.id} lists CPUs {sorted(stray)} that are not in $.cpus"
            )
        if n.distances is not None and len(n.distances) != len(topo.numa_nodes):
            raise InvalidRequest(
                f"topology: NUMA node {n.id} has {len(n.distances)} distances for "
                f"{len(topo.numa_nodes)} nodes; give one per node, in $.numa_nodes order"
            )
