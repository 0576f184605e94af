"""What isolation needs to know about one slot, and how the host's isolation is configured.

isolation/ does not import the agent: the agent fills a :class:`SlotIsolationSpec` from a
placement Assignment, and :class:`~nodeagent.isolation.isolator.SlotIsolator` turns it into kernel
state. Both dataclasses are frozen and validated on construction, so a spec that exists is one the
isolator can act on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.cgroups import DEFAULT_PARENT, DeviceRule, Hierarchy
from nodeagent.cgroups.hierarchy import check_slot_name
from nodeagent.errors import ConfigError, InvalidRequest
from nodeagent.isolation.devices import GPU_CONTROL_NODES, SAFE_DEVICES
from nodeagent.isolation.network import (
    AllowedHostPort,
    Egress,
    SlotAccess,
    SlotNetworkConfig,
    validate_slot_id,
)
from nodeagent.isolation.qos import QOS_CLASSES, QosClassName, QosDefaults
from nodeagent.isolation.resctrl import DEFAULT_ROOT as RESCTRL_ROOT


# Slotted: one per slot with a network, inside its SlotIsolationSpec.
@dataclass(frozen=True, slots=True)
class SlotNetworkSpec:
    """A network namespace of the slot's own; ``bandwidth_mbit`` shapes its egress.

    What the slot may reach is ``egress`` and ``host_ports`` (:class:`SlotAccess`: nothing but
    replies to connections opened into it, unless listed).
    """

    bandwidth_mbit: float | None = None
    egress: Egress = "none"
    host_ports: tuple[AllowedHostPort, ...] = ()

    def __post_init__(self) -> None:
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise InvalidRequest(f"network bandwidth_mbit must be positive, got {self.bandwidth_mbit}")
        object.__setattr__(self, "host_ports", SlotAccess(self.egress, tuple(self.host_ports)).host_ports)

    @property
    def access(self) -> SlotAccess:
        return SlotAccess(self.egress, self.host_ports)


# Slotted: the isolation part keeps one per slot (derived once per change).
@dataclass(frozen=True, slots=True)
class SlotIsolationSpec:
    """One slot's isolation, as decided by placement.

    ``cpus``: the slot's exclusive CPUs when ``exclusive`` (guaranteed slots); for shared slots
    (burstable, best-effort) the pool at planning time, for the record only: their cpuset follows
    the live shared pool, narrowed to the CPUs of ``mems`` when the slot is NUMA-bound.
    ``mems``: the NUMA nodes the slot's memory is bound to (cpuset.mems); None leaves it unbound.
    ``cpu_quota``: CPUs' worth of CFS quota on the shared pool (burstable); None means no quota.
    ``device_paths``: device nodes the slot may open besides the safe set (GPU, MIG capability,
    FPGA and named devices); ``gpu`` adds the NVIDIA control nodes that exist on the host.
    """

    slot_id: str
    qos: QosClassName
    cpus: frozenset[int] = frozenset()
    exclusive: bool = False
    mems: frozenset[int] | None = None
    cpu_quota: float | None = None
    memory_bytes: int | None = None
    pids_max: int | None = None
    device_paths: tuple[str, ...] = ()
    gpu: bool = False
    network: SlotNetworkSpec | None = None
    l3: float | None = None
    #: The slot's worker is a container: its device cgroup also admits what an OCI runtime writes
    #: into the container's own device cgroup below it (isolation.devices.CONTAINER_RUNTIME_DEVICES).
    containers: bool = False
    #: A warm pool's standby (docs/pools.md): its start is background work, so it runs at the
    #: lowest CPU weight and yields the shared CPUs to every other task there (frozen once ready,
    #: it takes none). Taken as a slot, it gets its class's weight like any other.
    background: bool = False

    def __post_init__(self) -> None:
        validate_slot_id(self.slot_id)
        check_slot_name(self.slot_id)  # rejects the class parents' names
        if self.qos not in QOS_CLASSES:
            raise InvalidRequest(
                f"slot {self.slot_id}: unknown QoS class {self.qos!r}; use one of {', '.join(QOS_CLASSES)}"
            )
        object.__setattr__(self, "cpus", frozenset(self.cpus))
        object.__setattr__(self, "device_paths", tuple(self.device_paths))
        if self.mems is not None:
            object.__setattr__(self, "mems", frozenset(self.mems))
        self._check_cpus()
        self._check_limits()
        for path in self.device_paths:
            if not path.startswith("/"):
                raise InvalidRequest(
                    f"slot {self.slot_id}: device path {path!r} is not absolute; give the node under /dev"
                )

    def _check_cpus(self) -> None:
        guaranteed = self.qos == "guaranteed"
        if self.exclusive != guaranteed:
            raise InvalidRequest(
                f"slot {self.slot_id}: exclusive={self.exclusive} with QoS {self.qos}; only guaranteed "
                "slots hold exclusive CPUs, and they always do"
            )
        if guaranteed and not self.cpus:
            raise InvalidRequest(f"guaranteed slot {self.slot_id} has no CPUs; placement must give it some")
        if any(cpu < 0 for cpu in self.cpus):
            raise InvalidRequest(f"slot {self.slot_id}: CPU ids must be >= 0, got {sorted(self.cpus)}")
        if self.mems is not None and (not self.mems or any(node < 0 for node in self.mems)):
            raise InvalidRequest(
                f"slot {self.slot_id}: mems must name at least one NUMA node id >= 0 (or be None for "
                f"unbound memory), got {sorted(self.mems)}"
            )
        if self.cpu_quota is not None and not self.cpu_quota > 0:
            raise InvalidRequest(f"slot {self.slot_id}: cpu_quota must be positive, got {self.cpu_quota}")

    def _check_limits(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes < 0:
            raise InvalidRequest(f"slot {self.slot_id}: memory_bytes must be >= 0, got {self.memory_bytes}")
        if self.pids_max is not None and self.pids_max < 1:
            raise InvalidRequest(f"slot {self.slot_id}: pids_max must be at least 1, got {self.pids_max}")
        if self.l3 is not None and not self.l3 > 0:
            raise InvalidRequest(f"slot {self.slot_id}: l3 share must be positive, got {self.l3}")


@dataclass(frozen=True)
class IsolatorConfig:
    """How this host isolates slots.

    ``reserved_cpus`` are for the system and the agent: no slot ever runs on them, so the agent's
    parent cgroup holds the online CPUs minus these, and the shared pool is that minus every
    exclusive slot's CPUs. ``resctrl_prefix`` marks the resctrl groups the isolator owns (the
    network config's prefixes mark netns and veths the same way).
    ``allow_unfiltered_network``: where the slot firewall cannot run (no libnftables, a kernel
    without nf_tables), give slots a network anyway, without its default-deny; otherwise a slot
    that asks for a network is refused there.
    """

    cgroup_parent: str = DEFAULT_PARENT
    reserved_cpus: frozenset[int] = frozenset()
    network: SlotNetworkConfig = field(default_factory=SlotNetworkConfig)
    qos: QosDefaults = field(default_factory=QosDefaults)
    safe_devices: tuple[DeviceRule, ...] = SAFE_DEVICES
    gpu_control_nodes: tuple[str, ...] = GPU_CONTROL_NODES
    resctrl_prefix: str = "na-"
    resctrl_root: Path = RESCTRL_ROOT
    #: Where devices' discovery reads the CPU layout when the isolator is not given one (fake trees).
    sys_root: Path = Path("/sys")
    #: How long to wait for a slot's processes to die and its cgroups to drain.
    kill_timeout_s: float = 10.0
    allow_unfiltered_network: bool = False

    def __post_init__(self) -> None:
        Hierarchy(self.cgroup_parent)  # validates every component
        object.__setattr__(self, "reserved_cpus", frozenset(self.reserved_cpus))
        if any(cpu < 0 for cpu in self.reserved_cpus):
            raise ConfigError(f"reserved_cpus must be CPU ids >= 0, got {sorted(self.reserved_cpus)}")
        if not self.resctrl_prefix or "/" in self.resctrl_prefix:
            raise ConfigError(f"resctrl_prefix {self.resctrl_prefix!r} must be a non-empty name without '/'")
        if not self.kill_timeout_s > 0:
            raise ConfigError(f"kill_timeout_s must be positive, got {self.kill_timeout_s}")

    @property
    def hierarchy(self) -> Hierarchy:
        return Hierarchy(self.cgroup_parent)

    def resctrl_group(self, slot_id: str) -> str:
        return self.resctrl_prefix + slot_id


__all__ = [
    "AllowedHostPort",
    "Egress",
    "IsolatorConfig",
    "SlotAccess",
    "SlotIsolationSpec",
    "SlotNetworkSpec",
]
