"""The agent's configuration: TOML (``/etc/nodeagent/config.toml`` or ``--config``) into frozen dataclasses.

Every key has a default, so ``nodeagent serve`` with no file runs standalone. The loader is strict:
an unknown section or key, or a value of the wrong type, is a ConfigError naming the key and the
file, so a typo never silently falls back to a default. docs/configuration.md lists every key.

::

    config = load_config(Path("/etc/nodeagent/config.toml"))     # missing default file: defaults
    config = apply_overrides(config, listen="0.0.0.0:7070", state_dir=Path("/tmp/na"))
    config.api.host, config.api.port, config.token_path, config.placement_options()
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import re
import socket
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.agent.sandbox_config import SandboxConfig
from nodeagent.cpulist import parse_cpulist
from nodeagent.defaults import DEFAULT_LISTEN, TOKEN_FILE_NAME, default_state_dir
from nodeagent.errors import ConfigError, InvalidRequest
from nodeagent.isolation.cdi import DEFAULT_CDI_DIR, DEFAULT_PREFIX
from nodeagent.isolation.colocation import ColocationConfig
from nodeagent.isolation.host import validate_parts
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.placement import PlacementOptions
from nodeagent.runtime.ports import DEFAULT_PORT_RANGE, parse_port_range
from nodeagent.schema.quantity import parse_quantity

DEFAULT_CONFIG_PATH = Path("/etc/nodeagent/config.toml")
LOG_LEVELS = ("debug", "info", "warning", "error")
ON_AGENT_STOP = ("keep", "stop")
DELEGATION_MODES = ("auto", "off")
BEST_EFFORT_ADMISSION = ("allocatable", "batch")


# =========================================================================== sections


@dataclass(frozen=True)
class ApiConfig:
    listen: str = DEFAULT_LISTEN  #: HOST:PORT of the REST API; an empty string serves only the unix socket
    unix_socket: str = ""  #: also serve on this unix socket path ("" = no socket)
    token_file: str = ""  #: bearer token file; "" = <state dir>/token
    max_connections: int = 1024  #: open API connections at once, all clients together
    max_connections_per_peer: int = 128  #: open API connections from one address (unix socket: one uid)
    header_timeout_s: float = 10.0  #: a connection with no request in progress for this long is closed
    slots_may_connect: bool = False  #: sandboxed workers may open TCP connections to ``listen``

    @property
    def host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return parse_listen(self.listen)[1]


@dataclass(frozen=True)
class StateConfig:
    dir: str = ""  #: "" = /var/lib/nodeagent as root, else $XDG_STATE_HOME/nodeagent
    #: free space on the state file system kept for the agent's own records (a quantity): below
    #: it allocate refuses, slot logs are dropped and /v1/node says degraded
    reserve: str = "64Mi"

    @property
    def reserve_bytes(self) -> int:
        return parse_quantity(self.reserve)


@dataclass(frozen=True)
class PlacementConfig:
    whole_cores: bool = True
    round_up_to_cores: bool = True
    distribute_across_numa: bool = False
    reserved_cpus: str | None = None  #: a cpulist; absent = the first physical core on hosts with >= 4 CPUs
    use_isolated_cpus: bool = False
    burstable_overcommit: float = 1.0
    best_effort_overcommit: float = 4.0
    shareable_gpus: tuple[str, ...] = ()
    max_shares_per_gpu: int = 4
    allowed_devices: tuple[str, ...] = ()
    shared_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class IsolationConfig:
    cgroup_parent: str = "nodeagent.slice"
    #: Without root (or delegation) no slot can be isolated; allow slots anyway, unisolated, when true.
    allow_unisolated: bool = False
    network_cidr: str = "10.231.0.0/16"
    netns_prefix: str = "na-"
    veth_prefix: str = "nah"
    #: The agent's nftables table (family inet) with the slots' default-deny rules.
    firewall_table: str = "nodeagent"
    #: Where that firewall cannot run (no nftables), give slots a network anyway, unfiltered.
    allow_unfiltered_network: bool = False
    pids_max: int = 4096  #: per-slot pids limit
    #: sandboxed slots without a network may not open connections to any local address (the
    #: host's loopback and addresses, other slots' ports, slots with a network) but to listeners
    #: of their own uid and ``local_open_ports`` (isolation/api_guard.py)
    local_default_deny: bool = True
    #: "PORT/tcp" or "PORT/udp" that local_default_deny leaves open; 53 for a resolver on 127.0.0.53
    local_open_ports: tuple[str, ...] = ("53/udp", "53/tcp")
    #: keep every task the agent does not own, kernel threads and interrupts off exclusive CPUs:
    #: "auto" (when the agent runs as root and isolates slots) or "off"
    host_partitioning: str = "auto"
    #: what host partitioning moves (docs/host-partitioning.md)
    host_partitioning_parts: tuple[str, ...] = ("processes", "kernel-threads", "workqueue", "irqs")
    #: how often tasks that widened their affinity (and interrupts moved back) are confined again
    host_sweep_seconds: float = 10.0


HOST_PARTITIONING_MODES = ("auto", "off")


@dataclass(frozen=True)
class ControllerConfig:
    url: str = ""  #: "" = standalone, no reports
    interval_seconds: float = 30.0
    node_id: str = ""  #: "" = this host's name
    timeout_seconds: float = 5.0
    token_file: str = ""  #: file holding the bearer token the controller expects ("" = none)
    backoff_initial_seconds: float = 1.0  #: first retry delay while the controller is down
    backoff_max_seconds: float = 60.0  #: retry delays grow (with full jitter) up to this
    coalesce_seconds: float = 0.5  #: changes within this window are sent as one report

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or socket.gethostname()


@dataclass(frozen=True)
class GpuConfig:
    ignored_xids: tuple[int, ...] = ()  #: NVIDIA Xid errors that do not mark a GPU unhealthy


@dataclass(frozen=True)
class WorkersConfig:
    #: the longest the supervision loop sleeps (exits wake it at once, probes when due); also the
    #: poll interval for a worker without a pidfd
    tick_seconds: float = 0.5
    #: what ``systemctl stop nodeagent`` (a stop, not a restart or a crash) does to running workers:
    #: "keep" leaves them running and the next agent re-adopts them; "stop" stops each one gracefully
    #: before the agent exits (slots and their cgroups stay) and the next agent starts them again
    on_agent_stop: str = "keep"
    #: host ports workers' named ports are assigned from ("FIRST-LAST"; runtime/ports.py)
    port_range: str = DEFAULT_PORT_RANGE
    #: how long a released slot's worker logs stay readable (seconds; 0: removed with the slot)
    log_retention_seconds: float = 3600.0

    @property
    def port_bounds(self) -> tuple[int, int]:
        return parse_port_range(self.port_range)


@dataclass(frozen=True)
class SystemdConfig:
    #: "auto": where systemd is the service manager, create cgroups only in the subtree a unit
    #: delegates to the agent (docs/systemd.md); "off": use [isolation] cgroup_parent as on hosts
    #: without systemd (systemd may undo what the agent does there)
    delegation: str = "auto"
    #: the delegated service that holds slots, workers and the keeper when the agent's own unit does not
    slots_unit: str = "nodeagent-slots.service"


@dataclass(frozen=True)
class QosConfig:
    """The QoS loop (agent/qos_loop.py, docs/colocation.md): best-effort work in what online slots leave."""

    enabled: bool = True
    period_seconds: float = 1.0
    cpu_margin: float = 0.1  #: share of the shared pool kept free above online use
    #: count the host's CPU use outside the agent's slots as online work (best-effort then gets what
    #: everything leaves, not what the online slots leave)
    host_cpu_as_online: bool = False
    cpu_release_periods: int = 3  #: online use is the peak of this many periods: cut now, give back later
    cpu_pressure_threshold: float = 0.1  #: online CPU stall share (PSI, cgroup v2) that suppresses fully
    io_pressure_threshold: float = 0.2
    suppressed_cpus: float = 0.01  #: the least CPU quota best-effort keeps
    smt_busy_threshold: float = 0.1  #: a CPU this busy with online work keeps best-effort off its siblings
    memory_throttle_percent: float = 80.0
    memory_evict_percent: float = 90.0
    memory_evict_target_percent: float = 85.0
    memory_pressure_threshold: float = 0.1  #: online memory stall share that evicts
    restore_after_seconds: float = 60.0
    evict_grace_seconds: float = 5.0  #: after SIGTERM, how long an evicted worker has before it is killed
    batch_window_seconds: float = 300.0
    best_effort_admission: str = "allocatable"  #: or "batch": bound best-effort allocations by batch
    best_effort_l3_share: float = 0.1  #: best-effort's share of the L3 cache where resctrl exists
    best_effort_mb_percent: int = 20  #: best-effort's memory bandwidth percentage where MBA exists
    #: where there is no MBA but the CPU counts cache misses: the memory traffic (MB/s) best-effort
    #: slots may cause while online work runs; a slot that would cause more has its CPU cut (0: off)
    best_effort_bandwidth_mb_per_s: float = 1000.0


@dataclass(frozen=True)
class CdiConfig:
    #: write a CDI spec per slot (nodeagent.io/slot=NAME) for container runtimes
    enabled: bool = True
    #: where runtimes look for specs generated at run time (the CDI standard's dynamic directory)
    dir: str = DEFAULT_CDI_DIR
    #: the agent's spec files are <prefix><slot id>.json; start-up removes those of slots it does not hold
    prefix: str = DEFAULT_PREFIX
    #: also one spec per kind of device the agent manages (nodeagent.io/gpu, nodeagent.io/fpga)
    device_specs: bool = False


@dataclass(frozen=True)
class ContainersConfig:
    #: the podman binary container workers run through ("" = podman on PATH)
    podman: str = ""
    #: the OCI runtime podman uses ("" = podman's default); runc on a v1 or hybrid host (crun refuses hybrid)
    runtime: str = ""


@dataclass(frozen=True)
class KubernetesConfig:
    #: place containers the NRI shim (kube/nri-shim) forwards as slots (POST /v1/nri/...); slot
    #: names starting with "nri-" are then reserved for them
    nri: bool = False
    #: serve a kubelet device plugin (API v1beta1) per accelerator class (agent/deviceplugin.py)
    device_plugin: bool = False
    #: where the kubelet's kubelet.sock is and the plugins' sockets go
    device_plugin_dir: str = "/var/lib/kubelet/device-plugins/"
    #: publish this node's per-NUMA capacity as a NodeResourceTopology object (agent/nrt.py) while
    #: that CRD is installed; needs the optional kubernetes client (nodeagent[kubernetes])
    node_resource_topology: bool = False
    #: how to reach the API server: "" is the pod's in-cluster service account, else a kubeconfig path
    kubeconfig: str = ""
    #: the Node's name, which names the object; "" is the host name, lowercased as the kubelet does
    node_name: str = ""
    #: with ``nri``: the kubelet's pod cgroups (relative to the cgroup root: its ``--cgroup-root``
    #: then ``kubepods``, ``kubepods.slice`` with the systemd driver), whose containers get their
    #: cpusets through NRI; host partitioning leaves these subtrees alone
    pods_cgroups: tuple[str, ...] = ("kubepods", "kubepods.slice")

    def best_effort_cgroups(self) -> tuple[str, ...]:
        """The kubelet's best-effort QoS cgroups under ``pods_cgroups`` while NRI places the pods
        (cgroupfs driver: ``<pods>/besteffort``; systemd: ``<pods>.slice/<pods>-besteffort.slice``):
        the QoS loop counts and limits them with its best-effort class."""
        found = []
        for path in self.partitioning_left_alone():
            name = path.rsplit("/", 1)[-1]
            if name.endswith(".slice"):
                found.append(f"{path}/{name.removesuffix('.slice')}-besteffort.slice")
            else:
                found.append(f"{path}/besteffort")
        return tuple(found)

    def partitioning_left_alone(self) -> tuple[str, ...]:
        """The cgroup subtrees host partitioning must not confine: the pods' while NRI places them."""
        return tuple(path.strip("/") for path in self.pods_cgroups) if self.nri else ()

    @property
    def resolved_node_name(self) -> str:
        """The Node's name: ``node_name``, else the host name lowercased (the kubelet's default)."""
        return self.node_name or socket.gethostname().lower()


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True)
class AgentConfig:
    api: ApiConfig = field(default_factory=ApiConfig)
    state: StateConfig = field(default_factory=StateConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    systemd: SystemdConfig = field(default_factory=SystemdConfig)
    qos: QosConfig = field(default_factory=QosConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    cdi: CdiConfig = field(default_factory=CdiConfig)
    containers: ContainersConfig = field(default_factory=ContainersConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    #: The file this came from (None: built-in defaults).
    source: str | None = None

    @property
    def state_dir(self) -> Path:
        return Path(self.state.dir) if self.state.dir else default_state_dir()

    @property
    def token_path(self) -> Path:
        return Path(self.api.token_file) if self.api.token_file else self.state_dir / TOKEN_FILE_NAME

    @property
    def database_path(self) -> Path:
        return self.state_dir / "state.db"

    def colocation(self) -> ColocationConfig:
        """The QoS loop's thresholds; ConfigError naming the [qos] key that is out of range."""
        q = self.qos
        return ColocationConfig(
            period_seconds=q.period_seconds,
            cpu_margin=q.cpu_margin,
            host_cpu_as_online=q.host_cpu_as_online,
            cpu_release_periods=q.cpu_release_periods,
            cpu_pressure_threshold=q.cpu_pressure_threshold,
            io_pressure_threshold=q.io_pressure_threshold,
            min_cpus=q.suppressed_cpus,
            smt_busy_threshold=q.smt_busy_threshold,
            memory_throttle_percent=q.memory_throttle_percent,
            memory_evict_percent=q.memory_evict_percent,
            memory_evict_target_percent=q.memory_evict_target_percent,
            memory_pressure_threshold=q.memory_pressure_threshold,
            restore_after_seconds=q.restore_after_seconds,
            batch_window_seconds=q.batch_window_seconds,
            best_effort_bandwidth_mb_per_s=q.best_effort_bandwidth_mb_per_s,
        )

    def placement_options(self) -> PlacementOptions:
        p = self.placement
        return PlacementOptions(
            whole_cores=p.whole_cores,
            round_up_to_cores=p.round_up_to_cores,
            distribute_across_numa=p.distribute_across_numa,
            reserved_cpus=None if p.reserved_cpus is None else frozenset(parse_cpulist(p.reserved_cpus)),
            use_isolated_cpus=p.use_isolated_cpus,
            burstable_overcommit=p.burstable_overcommit,
            best_effort_overcommit=p.best_effort_overcommit,
            shareable_gpus=frozenset(p.shareable_gpus),
            max_shares_per_gpu=p.max_shares_per_gpu,
            allowed_devices=frozenset(p.allowed_devices),
            shared_devices=frozenset(p.shared_devices),
        )


_SECTIONS: dict[str, type[Any]] = {
    "api": ApiConfig,
    "state": StateConfig,
    "placement": PlacementConfig,
    "isolation": IsolationConfig,
    "controller": ControllerConfig,
    "gpu": GpuConfig,
    "workers": WorkersConfig,
    "systemd": SystemdConfig,
    "qos": QosConfig,
    "log": LogConfig,
    "sandbox": SandboxConfig,
    "cdi": CdiConfig,
    "containers": ContainersConfig,
    "kubernetes": KubernetesConfig,
}


# =========================================================================== value checks


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); ConfigError otherwise."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"listen address {value!r} is not HOST:PORT; e.g. 127.0.0.1:7070 or [::1]:7070")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        _check_ip(host, value)
    elif ":" in host:
        raise ConfigError(f"listen address {value!r}: write an IPv6 host in brackets, e.g. [::1]:7070")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ConfigError(f"listen address {value!r}: port {port} is outside 1-65535")
    return host, port


def _check_ip(host: str, value: str) -> None:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"listen address {value!r}: {host!r} is not an IP address") from None


def _where(source: str | None, key: str) -> str:
    return f"{source}: {key}" if source else key


def _convert(value: Any, annotation: str, key: str, source: str | None) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{_where(source, key)} is {value!r}; expected {expected}")

    if annotation == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("a whole number")
        return value
    if annotation == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise bad("a number")
        return float(value)
    if annotation in ("str", "str | None"):
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if annotation == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return tuple(value)
    if annotation == "tuple[int, ...]":
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise bad("a list of whole numbers")
        return tuple(value)
    raise AssertionError(f"no converter for {annotation}")  # pragma: no cover - a new field type


MIN_RESERVE_BYTES = 16 << 20
MAX_RESERVE_BYTES = 1 << 40


def _port_range_ok(text: str) -> bool:
    try:
        parse_port_range(text)
    except ConfigError:
        return False
    return True


def _validate(config: AgentConfig) -> None:
    """Cross-field and range checks, with the key named."""
    src = config.source
    checks: list[tuple[str, bool, str]] = [
        ("controller.interval_seconds", config.controller.interval_seconds > 0, "a number above 0"),
        ("controller.timeout_seconds", config.controller.timeout_seconds > 0, "a number above 0"),
        ("workers.tick_seconds", 0 < config.workers.tick_seconds <= 60, "a number of seconds in (0, 60]"),
        ("workers.port_range", _port_range_ok(config.workers.port_range), 'FIRST-LAST such as "20000-29999"'),
        (
            "workers.log_retention_seconds",
            0 <= config.workers.log_retention_seconds <= 365 * 86400,
            "a number of seconds from 0 to 31536000",
        ),
        ("isolation.pids_max", config.isolation.pids_max > 0, "a whole number above 0"),
        ("api.max_connections", config.api.max_connections > 0, "a whole number above 0"),
        ("api.max_connections_per_peer", config.api.max_connections_per_peer > 0, "a whole number above 0"),
        ("api.header_timeout_s", 0 < config.api.header_timeout_s <= 3600, "a number of seconds in (0, 3600]"),
        (
            "isolation.host_partitioning",
            config.isolation.host_partitioning in HOST_PARTITIONING_MODES,
            "one of " + ", ".join(HOST_PARTITIONING_MODES),
        ),
        (
            "isolation.host_sweep_seconds",
            0.1 <= config.isolation.host_sweep_seconds <= 3600,
            "a number of seconds in [0.1, 3600]",
        ),
        ("log.level", config.log.level in LOG_LEVELS, "one of " + ", ".join(LOG_LEVELS)),
        (
            "workers.on_agent_stop",
            config.workers.on_agent_stop in ON_AGENT_STOP,
            '"keep" (workers outlive the agent) or "stop" (the agent stops them when it is stopped)',
        ),
        (
            "systemd.delegation",
            config.systemd.delegation in DELEGATION_MODES,
            '"auto" (use the cgroup systemd delegates) or "off" (use [isolation] cgroup_parent)',
        ),
        (
            "systemd.slots_unit",
            config.systemd.slots_unit.endswith(".service") and "/" not in config.systemd.slots_unit,
            'a service unit name such as "nodeagent-slots.service"',
        ),
        (
            "controller.url",
            config.controller.url == "" or config.controller.url.startswith(("http://", "https://")),
            "an http:// or https:// URL, or an empty string",
        ),
    ]
    for key, ok, expected in checks:
        if not ok:
            value = getattr(getattr(config, key.split(".")[0]), key.split(".")[1])
            raise ConfigError(f"{_where(src, key)} is {value!r}; expected {expected}")
    try:
        reserve = config.state.reserve_bytes
    except ValueError as err:
        raise ConfigError(f"{_where(src, 'state.reserve')}: {err}") from None
    if not MIN_RESERVE_BYTES <= reserve <= MAX_RESERVE_BYTES:
        raise ConfigError(
            f"{_where(src, 'state.reserve')} is {config.state.reserve!r}; expected from 16Mi (what one "
            "release and a restart write) to 1Ti"
        )
    if config.api.listen:
        try:
            parse_listen(config.api.listen)
        except ConfigError as err:
            raise ConfigError(f"{_where(src, 'api.listen')}: {err}") from None
    elif not config.api.unix_socket:
        raise ConfigError(
            f"{_where(src, 'api.listen')} is empty and api.unix_socket is unset: nothing to serve on"
        )
    if not config.cdi.prefix or "/" in config.cdi.prefix or config.cdi.prefix.startswith("."):
        raise ConfigError(
            f"{_where(src, 'cdi.prefix')} is {config.cdi.prefix!r}; expected a file name prefix "
            "(not empty, no '/', not starting with '.')"
        )
    if config.cdi.enabled and not config.cdi.dir:
        raise ConfigError(f"{_where(src, 'cdi.dir')} is empty; give a directory or set cdi.enabled = false")
    for key in ("state.dir", "api.token_file", "api.unix_socket", "cdi.dir", "containers.podman"):
        value = getattr(getattr(config, key.split(".")[0]), key.split(".")[1])
        if value and not Path(value).is_absolute():
            raise ConfigError(f"{_where(src, key)} is {value!r}; expected an absolute path")
    _check_kubernetes(config)
    try:
        config.placement_options()
        _check_placement(config)
    except (InvalidRequest, ValueError) as err:
        raise ConfigError(f"{_where(src, 'placement')}: {err}") from None
    _check_network(config)
    for entry in config.isolation.local_open_ports:
        number, _, protocol = entry.partition("/")
        if not (number.isdigit() and 1 <= int(number) <= 65535 and protocol in ("tcp", "udp")):
            raise ConfigError(
                f"{_where(src, 'isolation.local_open_ports')} has {entry!r}; expected PORT/tcp or PORT/udp "
                'with PORT in 1-65535, such as "53/udp"'
            )
    try:
        validate_parts(config.isolation.host_partitioning_parts)
    except ConfigError as err:
        raise ConfigError(f"{_where(src, 'isolation.host_partitioning_parts')}: {err}") from None
    try:
        config.sandbox.check()  # its messages name the key (sandbox.uid_range)
    except ConfigError as err:
        raise ConfigError(f"{src}: {err}" if src else str(err)) from None
    _check_qos(config)


#: A Kubernetes object name (a DNS-1123 subdomain), which a Node's name is.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _check_kubernetes(config: AgentConfig) -> None:
    k, src = config.kubernetes, config.source
    if k.kubeconfig and not Path(k.kubeconfig).is_absolute():
        raise ConfigError(
            f"{_where(src, 'kubernetes.kubeconfig')} is {k.kubeconfig!r}; expected an absolute path to a "
            'kubeconfig file, or "" for the service account of the pod the agent runs in'
        )
    if k.node_name and (len(k.node_name) > 253 or not _DNS_SUBDOMAIN.fullmatch(k.node_name)):
        raise ConfigError(
            f"{_where(src, 'kubernetes.node_name')} is {k.node_name!r}; expected the Node's name as "
            "`kubectl get nodes` shows it (lowercase letters, digits, '-' and '.', at most 253), or \"\" "
            "for this host's name"
        )
    for path in k.pods_cgroups:
        if not path.strip("/") or ".." in path.split("/"):
            raise ConfigError(
                f"{_where(src, 'kubernetes.pods_cgroups')} has {path!r}; expected a cgroup path below the "
                'root, such as "kubepods" (the kubelet\'s --cgroup-root, then kubepods)'
            )


def _check_qos(config: AgentConfig) -> None:
    q, src = config.qos, config.source
    try:
        config.colocation()
    except ConfigError as err:
        # The thresholds' own messages name the key (qos.<name>); say which file too.
        raise ConfigError(f"{src}: {err}" if src else str(err)) from None
    checks: list[tuple[str, bool, str]] = [
        ("qos.evict_grace_seconds", 0 <= q.evict_grace_seconds <= 300, "seconds in [0, 300]"),
        (
            "qos.best_effort_admission",
            q.best_effort_admission in BEST_EFFORT_ADMISSION,
            " or ".join(repr(a) for a in BEST_EFFORT_ADMISSION),
        ),
        ("qos.best_effort_l3_share", 0 < q.best_effort_l3_share < 1, "a fraction of the cache in (0, 1)"),
        ("qos.best_effort_mb_percent", 1 <= q.best_effort_mb_percent <= 100, "a percentage in [1, 100]"),
    ]
    for key, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{_where(src, key)} is {getattr(q, key.split('.')[1])!r}; expected {expected}")


def _check_placement(config: AgentConfig) -> None:
    p = config.placement
    items = [
        f"{f.name}={_option_text(getattr(p, f.name))}"
        for f in dataclasses.fields(p)
        if getattr(p, f.name) is not None
    ]
    # The CLI's parser owns the ranges (ratios, share counts); reuse it so both agree.
    try:
        PlacementOptions.from_strings(items)
    except ConfigError as err:
        raise ConfigError(f"{_where(config.source, 'placement')}: {err}") from None


def _option_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _check_network(config: AgentConfig) -> None:
    iso = config.isolation
    try:
        SlotNetworkConfig(
            cidr=iso.network_cidr,
            netns_prefix=iso.netns_prefix,
            veth_prefix=iso.veth_prefix,
            nft_table=iso.firewall_table,
        )
    except ConfigError as err:
        raise ConfigError(f"{_where(config.source, 'isolation')}: {err}") from None


# =========================================================================== loading


def parse_config(data: Mapping[str, Any], source: str | None = None) -> AgentConfig:
    """Build an AgentConfig from decoded TOML; ConfigError names the first bad key."""
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in _SECTIONS:
            raise ConfigError(
                f"{_where(source, name)}: unknown section; known sections: {', '.join(sorted(_SECTIONS))}"
                + _closest(name, _SECTIONS)
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, name)} must be a table ([{name}])")
        sections[name] = _section(_SECTIONS[name], name, value, source)
    config = AgentConfig(**sections, source=source)
    _validate(config)
    return config


def _section(cls: type[Any], name: str, values: Mapping[str, Any], source: str | None) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"{_where(source, f'{name}.{key}')}: unknown key; known keys in [{name}]: "
                f"{', '.join(sorted(fields))}{_closest(key, fields)}"
            )
        kwargs[key] = _convert(value, str(fields[key].type), f"{name}.{key}", source)
    return cls(**kwargs)


def _closest(given: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(given, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def load_config(path: Path | None = None) -> AgentConfig:
    """Read ``path`` (or the default file, whose absence means defaults); ConfigError on any problem."""
    explicit = path is not None
    target = path if path is not None else DEFAULT_CONFIG_PATH
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {target} does not exist; create it or drop --config") from None
        return parse_config({})
    except OSError as err:
        raise ConfigError(f"cannot read config file {target}: {err.strerror}") from err
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{target}: not valid TOML: {err}") from err
    return parse_config(data, str(target))


def apply_overrides(
    config: AgentConfig,
    *,
    listen: str | None = None,
    state_dir: Path | None = None,
    on_agent_stop: str | None = None,
    systemd_delegation: str | None = None,
) -> AgentConfig:
    """The command line wins over the file: ``--listen HOST:PORT``, ``--state-dir DIR``,
    ``--on-agent-stop keep|stop`` and ``--systemd-delegation auto|off``."""
    if on_agent_stop is not None:
        if on_agent_stop not in ON_AGENT_STOP:
            expected = ", ".join(ON_AGENT_STOP)
            raise ConfigError(f"--on-agent-stop is {on_agent_stop!r}; expected one of {expected}")
        workers = dataclasses.replace(config.workers, on_agent_stop=on_agent_stop)
        config = dataclasses.replace(config, workers=workers)
    if systemd_delegation is not None:
        if systemd_delegation not in DELEGATION_MODES:
            expected = ", ".join(DELEGATION_MODES)
            raise ConfigError(f"--systemd-delegation is {systemd_delegation!r}; expected one of {expected}")
        systemd = dataclasses.replace(config.systemd, delegation=systemd_delegation)
        config = dataclasses.replace(config, systemd=systemd)
    if listen is not None:
        try:
            parse_listen(listen)
        except ConfigError as err:
            raise ConfigError(f"--listen: {err}") from None
        config = dataclasses.replace(config, api=dataclasses.replace(config.api, listen=listen))
    if state_dir is not None:
        absolute = state_dir.expanduser().absolute()
        config = dataclasses.replace(config, state=dataclasses.replace(config.state, dir=str(absolute)))
    return config


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "AgentConfig",
    "ApiConfig",
    "CdiConfig",
    "ContainersConfig",
    "ControllerConfig",
    "GpuConfig",
    "IsolationConfig",
    "KubernetesConfig",
    "LogConfig",
    "PlacementConfig",
    "QosConfig",
    "StateConfig",
    "SystemdConfig",
    "WorkersConfig",
    "apply_overrides",
    "default_state_dir",
    "load_config",
    "parse_config",
    "parse_listen",
]
