"""``nodeagent serve``: the daemon's start-up, serving loop and shutdown.

Order of start-up: configuration -> state directory (0700) and API token (0600) -> topology ->
slot manager (reconcile) -> controller reporter, kubelet device plugins, NodeResourceTopology
publisher -> REST API on uvicorn (TCP and/or a unix socket) -> ``READY=1`` to systemd once the
sockets listen, then ``WATCHDOG=1`` pings when systemd asked for them. SIGTERM/SIGINT stop the
API, the reporter and supervision, but not the workers: they are the host keeper's children
(runtime/keeper.py, which outlives the agent too), and the next start re-attaches to the keeper
and re-adopts them (unless this is a stop, not a restart, and ``[workers] on_agent_stop =
"stop"``: agent/under_systemd.py).

Logs go to the journal as structured entries when systemd connected stdout to it (agent/journal.py),
else as JSON lines on stdout. Under systemd, cgroups go where a unit delegates them (agent/under_systemd.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from nodeagent.agent.ballast import Ballast
from nodeagent.agent.config import AgentConfig
from nodeagent.agent.journal import journal_handler
from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests, RecoveryMode
from nodeagent.agent.sandbox import SandboxPolicy
from nodeagent.agent.slot import Slot
from nodeagent.agent.slot_cdi import SlotCdiSpecs
from nodeagent.agent.state import StateStore
from nodeagent.agent.under_systemd import (
    CgroupLayout,
    cgroup_layout,
    check_slot_cgroups,
    stop_requested,
    stop_workers_with_agent,
    take_stopped_workers,
)
from nodeagent.atomicfile import write_atomic
from nodeagent.cgroups import CgroupHost, CgroupManager, CgroupStats, detect, open_manager
from nodeagent.devices.discovery import discover
from nodeagent.devices.topology import Topology
from nodeagent.errors import NO_SPACE, ConfigError, InsufficientStorage, NodeAgentError, translate_os_error
from nodeagent.isolation.backend import IsolationBackend, KernelIsolation, NoIsolation
from nodeagent.isolation.cdi import CdiSpecDir
from nodeagent.isolation.cpus import CpuLayout
from nodeagent.isolation.host import HostReport, validate_parts
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.partitioning import KernelHostPartitioning, build_host_partitioning, host_partitioner
from nodeagent.isolation.qos import QosDefaults
from nodeagent.isolation.slot_spec import IsolatorConfig
from nodeagent.libc import libc
from nodeagent.placement import placement_index
from nodeagent.runtime.container import PodmanConfig, default_runtime
from nodeagent.runtime.keeper_client import KeeperClient
from nodeagent.runtime.presets import find_program
from nodeagent.runtime.workers import KeeperRuntime

if TYPE_CHECKING:
    from nodeagent.agent.deviceplugin import DevicePlugins
    from nodeagent.agent.metrics import Metrics
    from nodeagent.agent.nrt import NrtPublisher
    from nodeagent.agent.qos_loop import QosLoop
    from nodeagent.agent.reporter import Reporter
    from nodeagent.isolation.api_guard import ApiGuard

log = logging.getLogger("nodeagent.daemon")

#: The API sockets' listen backlog.
ACCEPT_BACKLOG = 128
#: Accept bursts whose descriptors can be open at once before the connection limit closes any:
#: asyncio accepts up to ACCEPT_BACKLOG connections per loop iteration, and a rejected one holds
#: its descriptor for two more (the task that makes its transport, then connection_made where the
#: limit aborts it, then connection_lost where the socket closes), while a burst comes in each.
ACCEPT_BURSTS_IN_FLIGHT = 3

_STANDARD_RECORD_KEYS = frozenset(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_RECORD_KEYS and key not in ("message", "color_message"):
                body[key] = value
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def setup_logging(level: str) -> None:
    # systemd: the journal's native protocol when stdout is the journal stream (agent/journal.py).
    handler: logging.Handler | None = journal_handler()
    if handler is None:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


# =========================================================================== files


def ensure_state_dir(path: Path) -> Path:
    """Create the state directory (0700: it holds the token and the database)."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        (path / "workers").mkdir(exist_ok=True, mode=0o700)
    except OSError as err:
        raise translate_os_error(f"create the state directory {path}", err) from err
    return path


class StateDirectoryBusy(ConfigError):
    code = "state_dir_busy"


def lock_state_dir(state_dir: Path) -> int:
    """Take the state directory for this process (an exclusive lock on ``<dir>/agent.lock``, held
    until the process ends) before anything reads or changes state; returns the lock's descriptor.

    A second agent on the same directory stops here, naming the first: it must not reconcile a
    database another agent is working from."""
    path = state_dir / "agent.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise translate_os_error(f"open the state directory's lock {path}", err) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StateDirectoryBusy(
            f"another nodeagent (pid {holder}) is using the state directory {state_dir}; stop it first, "
            "or give this one another --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def ensure_token(path: Path) -> str:
    """The API token: read it, or create the file (0600) with a fresh random token.

    Written whole or not at all (a temporary file, flushed, then renamed): a full disk or a crash
    never leaves an empty token behind. An empty file (left by an older agent) gets a new token.
    """
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    except OSError as err:
        raise translate_os_error(f"read the API token {path}", err) from err
    if token:
        return token
    token = secrets.token_urlsafe(32)
    try:
        write_atomic(path, token + "\n", mode=0o600, durable=True)
    except OSError as err:
        if err.errno in NO_SPACE:
            raise InsufficientStorage(
                f"cannot create the API token {path}: its filesystem is full; free space there, then start "
                "the agent again"
            ) from err
        raise translate_os_error(f"create the API token {path}", err) from err
    return token


# =========================================================================== assembly


def build_isolation(
    config: AgentConfig, topology: Topology, host: CgroupHost, layout: CgroupLayout | None = None
) -> IsolationBackend:
    """The isolator when this host lets us create cgroups; else the unisolated stand-in, with why.

    ``layout`` (systemd: agent/under_systemd.py) says where slots go; without it,
    ``[isolation] cgroup_parent``.
    """
    # systemd: slots go below the delegated cgroup, or nowhere when systemd delegates none.
    if layout is not None and layout.refused is not None:
        return NoIsolation([layout.refused], host.mode)
    if layout is not None:
        host = layout.host
    if not host.can_write or os.geteuid() != 0:
        reason = (
            f"not running as root (cgroups {host.mode}): no cgroup, cpuset, device or network isolation"
            if os.geteuid() != 0
            else f"cgroups ({host.mode}) are not writable: no CPU, memory or device isolation"
        )
        return NoIsolation([reason], host.mode)
    options = config.placement_options()
    reserved = options.reserved_cpus
    if reserved is None:
        reserved = placement_index(topology).default_reserved()
    iso = config.isolation
    isolation = IsolatorConfig(
        cgroup_parent=iso.cgroup_parent if layout is None else layout.parent,
        reserved_cpus=reserved,
        network=SlotNetworkConfig(
            cidr=iso.network_cidr,
            netns_prefix=iso.netns_prefix,
            veth_prefix=iso.veth_prefix,
            nft_table=iso.firewall_table,
        ),
        qos=QosDefaults(pids_max=iso.pids_max, suppressed_cpus=config.qos.suppressed_cpus),
        allow_unfiltered_network=iso.allow_unfiltered_network,
    )
    # The isolator takes its CPU layout from the topology discovered at start-up: sysfs is read once.
    return KernelIsolation(SlotIsolator(host, isolation, layout=CpuLayout.of(topology)))


class SlotStats:
    """Per-slot cgroup statistics for the metrics scrape (None for a slot without a cgroup).

    The scrape hands over the slots it listed (``prepare``), so each slot's cgroup comes from that
    one listing instead of a database lookup per slot; a slot it did not list is looked up. The
    cgroup managers are kept from scrape to scrape (those of slots gone are dropped), so each
    slot's directories are checked once, not at every scrape; so is each slot's last snapshot:

    - a slot whose parent (its QoS class's cgroup) used no CPU and whose memory in use did not
      move since the last scrape is shown as then, and none of its files is read: nothing under
      the parent ran, and memory that moves without a task running (reclaim, a charge from
      outside) moves the parent's figure too;
    - otherwise a slot that used no CPU since has only its CPU time and memory in use read
      (``CgroupManager.stats(since=...)``).

    At 500 idle slots a scrape reads a handful of files instead of 2,500 (issue 23). Each parent
    is read before its slots, so a slot that runs after its snapshot shows in the next reading
    of its parent.
    """

    def __init__(self, manager: SlotManager) -> None:
        self._manager = manager
        self._host = detect()
        self._cgroups: dict[str, str | None] = {}
        self._managers: dict[str, tuple[CgroupManager, CgroupStats | None]] = {}
        self._parents: dict[str, _ParentFigures] = {}
        self._quiet: dict[str, bool] = {}  # this scrape's verdict per parent

    def prepare(self, slots: Sequence[Slot]) -> None:
        self._cgroups = {slot.id: slot.cgroup for slot in slots}
        wanted = {cgroup for cgroup in self._cgroups.values() if cgroup is not None}
        self._managers = {cgroup: kept for cgroup, kept in self._managers.items() if cgroup in wanted}
        parents = {cgroup.rpartition("/")[0] for cgroup in wanted}
        self._parents = {parent: kept for parent, kept in self._parents.items() if parent in parents}
        self._quiet = {}

    def __call__(self, slot_id: str) -> CgroupStats | None:
        if not self._host.can_write:
            return None
        cgroups = self._cgroups
        cgroup = cgroups[slot_id] if slot_id in cgroups else self._manager.get_slot(slot_id).cgroup
        if cgroup is None:
            return None
        kept = self._managers.get(cgroup)
        quiet = self._parent_quiet(cgroup.rpartition("/")[0])
        if kept is not None and kept[1] is not None and quiet:
            return kept[1]
        manager, last = (open_manager(self._host, cgroup), None) if kept is None else kept
        stats = manager.stats(pids=False, since=last)  # /metrics shows no pid counts
        self._managers[cgroup] = (manager, stats)
        return stats

    def _parent_quiet(self, parent: str) -> bool:
        """Whether ``parent`` used no CPU and its memory in use did not move since the last scrape
        (read once per scrape, before the first of its slots)."""
        verdict = self._quiet.get(parent)
        if verdict is not None:
            return verdict
        verdict = False
        if parent:  # a slot directly under the root has no parent of its own to read
            try:
                figures = self._parents.get(parent)
                if figures is None:
                    group = open_manager(self._host, parent)
                    figures = self._parents[parent] = _ParentFigures(group, group.counts_children_memory())
                stats = figures.group.stats(pids=False)
            except NodeAgentError as err:  # each slot is then read on its own
                log.debug("metrics: parent cgroup %s unreadable: %s", parent, err)
            else:
                now = (stats.cpu_usage_ns, stats.memory_current)
                verdict = figures.hierarchical and None not in now and now == figures.last
                figures.last = now
        self._quiet[parent] = verdict
        return verdict


@dataclass(slots=True)
class _ParentFigures:
    group: CgroupManager
    hierarchical: bool  # its memory in use counts its children's
    last: tuple[int | None, int | None] = (None, None)  # CPU time and memory in use, last scrape


def _slot_stats(manager: SlotManager) -> Callable[[str], CgroupStats | None]:
    return SlotStats(manager)


def build_host(
    config: AgentConfig, host: CgroupHost, isolation: IsolationBackend
) -> KernelHostPartitioning | None:
    """Host partitioning and foreign-CPU measurement, for an agent that isolates slots (None otherwise).

    ``auto`` partitions the host whenever the agent isolates slots (it runs as root); ``off`` still
    measures foreign CPU time, which is how an operator sees what partitioning would remove."""
    if not isinstance(isolation, KernelIsolation):
        return None
    iso = config.isolation
    return build_host_partitioning(
        host,
        enabled=iso.host_partitioning == "auto",
        state_dir=config.state_dir,
        cgroup_parent=iso.cgroup_parent,
        left_alone=config.kubernetes.partitioning_left_alone(),
        parts=validate_parts(iso.host_partitioning_parts),
        sweep_seconds=iso.host_sweep_seconds,
    )


def restore_host(config: AgentConfig) -> HostReport:
    """``nodeagent serve --restore-host``: put back everything the host record names, and exit.

    Takes the state directory first, so it refuses while an agent runs there (that agent would
    confine the host again on its next sweep): stop the agent, then restore."""
    ensure_state_dir(config.state_dir)
    lock_state_dir(config.state_dir)
    partitioner = host_partitioner(
        detect(),
        state_dir=config.state_dir,
        cgroup_parent=config.isolation.cgroup_parent,
        left_alone=config.kubernetes.partitioning_left_alone(),
    )
    return partitioner.restore()


def build_manager(
    config: AgentConfig,
    topology: Topology | None = None,
    *,
    recovery: RecoveryMode = RecoveryMode.REFUSE,
    layout: CgroupLayout | None = None,
) -> SlotManager:
    """Everything the manager needs, from the configuration (the state directory must exist).

    ``layout``: where cgroups and the agent's helpers go (``cgroup_layout``); without it, slots go
    under ``[isolation] cgroup_parent`` and helpers stay where they start.
    """
    topo = topology or discover()
    host = detect() if layout is None else layout.host
    isolation = build_isolation(config, topo, host, layout)
    store = StateStore(
        config.database_path,
        manifests=Manifests(config.state_dir / "slots"),
        reserve=config.state.reserve_bytes,
        ballast=Ballast(config.state_dir),
    )
    if isinstance(isolation, KernelIsolation) and layout is not None:
        try:
            check_slot_cgroups(store, layout.parent)  # systemd: slots made elsewhere are refused
        except BaseException:
            store.close()
            raise
    return SlotManager(
        store,
        topo,
        isolation,
        KeeperRuntime(
            config.state_dir / "workers",
            host if isinstance(isolation, KernelIsolation) else None,
            KeeperClient(config.state_dir / "keeper", placement=None if layout is None else layout.placement),
            podman_config(config, host),
            log_reserve_bytes=config.state.reserve_bytes,
        ),
        options=config.placement_options(),
        node_id=config.controller.resolved_node_id,
        allow_unisolated=config.isolation.allow_unisolated,
        tick_seconds=config.workers.tick_seconds,
        port_range=config.workers.port_bounds,
        find_program=find_program,
        log_retention_seconds=config.workers.log_retention_seconds,
        recovery=recovery,
        host=build_host(config, host, isolation),  # host partitioning (docs/host-partitioning.md)
        sandbox=build_sandbox(config, can_isolate=isolation.isolates),
        cdi=build_cdi(config, can_isolate=isolation.isolates),
    )


def podman_config(config: AgentConfig, host: CgroupHost) -> PodmanConfig:
    """How container workers call podman ([containers]; runtime/container.py)."""
    # On pure v2 the worker (podman) runs in a leaf of the slot's cgroup and the container below
    # another child of it (runtime/workers.py): nothing to refuse.
    runtime = config.containers.runtime or default_runtime(host.mode != "v2")
    return PodmanConfig(podman=config.containers.podman, runtime=runtime)


def build_cdi(config: AgentConfig, *, can_isolate: bool) -> SlotCdiSpecs | None:
    """The slots' CDI specs ([cdi]); none where slots are not isolated (their devices are not the
    slot's alone, and the dynamic CDI directory is root's)."""
    if not config.cdi.enabled or not can_isolate:
        return None
    return SlotCdiSpecs(
        CdiSpecDir(Path(config.cdi.dir), config.cdi.prefix),
        config.state_dir / "cdi",
        device_specs=config.cdi.device_specs,
        allowed_devices=config.placement.allowed_devices,
    )


def build_sandbox(config: AgentConfig, *, can_isolate: bool) -> SandboxPolicy:
    """The workers' sandbox policy: the state directory (database, API token, keeper, every slot's
    files) and the token files hidden from every worker."""
    hidden = [config.state_dir, config.token_path]
    if config.controller.token_file:
        hidden.append(Path(config.controller.token_file))
    return SandboxPolicy.for_host(config.sandbox, hidden, can_isolate=can_isolate)


def controller_token(config: AgentConfig) -> str | None:
    """The controller's token from ``[controller] token_file`` (read before the agent touches the
    kernel, so a bad file stops the start before anything changed)."""
    path = config.controller.token_file
    if not config.controller.url or not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as err:
        raise ConfigError(
            f"[controller] token_file {path}: cannot read it ({err.strerror}); create it or leave the key out"
        ) from err
    if not token:
        raise ConfigError(f"[controller] token_file {path} is empty; write the controller's token into it")
    return token


class _ManagerDevices:
    """What the device plugins read from the manager (agent/deviceplugin.py's DeviceSource)."""

    def __init__(self, manager: SlotManager) -> None:
        self._manager = manager

    def topology(self) -> Topology:
        return self._manager.topology()

    def free_cpus_by_numa(self) -> dict[int, float]:
        by_numa = self._manager.capacity().get("by_numa", {})
        return {int(node): float(r.get("cpu", {}).get("free", 0)) for node, r in by_numa.items()}


def _device_plugins(config: AgentConfig, manager: SlotManager) -> DevicePlugins | None:
    """The kubelet device plugins ([kubernetes] device_plugin), started: they serve on their own
    threads, and a kubelet that is absent or refuses is logged and retried, never fatal."""
    if not config.kubernetes.device_plugin:
        return None
    # Only now: grpc and protobuf add ~19 MB to the daemon's RSS, which an agent without the
    # plugins should not carry.
    from nodeagent.agent.deviceplugin import DevicePlugins  # noqa: PLC0415

    plugins = DevicePlugins(
        _ManagerDevices(manager),
        Path(config.kubernetes.device_plugin_dir),
        allowed_devices=config.placement.allowed_devices,
        cdi=config.cdi.enabled and config.cdi.device_specs and manager.isolation.isolates,
    )
    # e.g. a directory it cannot write: the agent serves without the plugins
    return (
        plugins if _started(manager, "device_plugin", "the device plugins", plugins, plugins.start) else None
    )


def _watch_nri(config: AgentConfig, manager: SlotManager) -> None:
    """NRI in ``GET /v1/node``'s integrations (and `nodeagent doctor`): while host partitioning is
    on, whether the kubelet's pod cgroups it must leave alone are where ``pods_cgroups`` says."""
    if not config.kubernetes.nri:
        return
    from nodeagent.agent.nri import pods_cgroups_problems  # noqa: PLC0415

    isolation = manager.isolation
    if not isinstance(isolation, KernelIsolation) or config.isolation.host_partitioning != "auto":
        manager.watch_integration("nri", tuple)
        return
    roots = isolation.isolator.host.controller_roots()
    pods = config.kubernetes.pods_cgroups
    manager.watch_integration("nri", lambda: pods_cgroups_problems(pods, roots))


class _Integration(Protocol):
    def problems(self) -> tuple[str, ...]: ...
    def close(self) -> None: ...


def _started(
    manager: SlotManager, name: str, what: str, part: _Integration, start: Callable[[], None]
) -> bool:
    """Start a Kubernetes integration beside the manager and show it in ``node()``; one that does
    not start is closed, logged and shown with why, and the agent serves without it."""
    try:
        start()
    except Exception as err:
        log.exception("%s did not start", what)
        part.close()
        failed = (f"{what} did not start: {err}",)
        manager.watch_integration(name, lambda: failed)
        return False
    manager.watch_integration(name, part.problems)
    return True


def _nrt_publisher(config: AgentConfig, manager: SlotManager) -> NrtPublisher | None:
    """The NodeResourceTopology publisher ([kubernetes] node_resource_topology), started: it works
    on its own thread, does nothing while the CRD is absent, and logs and retries every failure."""
    k = config.kubernetes
    if not k.node_resource_topology:
        return None
    # Only here: the module brings the kubernetes client, which an agent without the key never loads.
    from nodeagent.agent.nrt import KubernetesNrtApi, NrtPublisher, client_installed  # noqa: PLC0415

    if not client_installed():
        missing = (
            "[kubernetes] node_resource_topology is on but the kubernetes Python client is not installed: "
            "nothing is published; install it with the agent (pip install 'nodeagent[kubernetes]') or "
            "set node_resource_topology = false"
        )
        log.error(missing)
        manager.watch_integration("node_resource_topology", lambda: (missing,))
        return None
    publisher = NrtPublisher(
        manager,
        k.resolved_node_name,
        lambda: KubernetesNrtApi(k.kubeconfig),
        devices=k.device_plugin,  # the device classes mean something to pods only with the plugin
    )

    def start() -> None:
        publisher.start()
        manager.subscribe(publisher.notify_change)

    if not _started(
        manager, "node_resource_topology", "the NodeResourceTopology publisher", publisher, start
    ):
        return None
    log.info("NodeResourceTopology publisher started", extra={"node": publisher.node_name})
    return publisher


def _reporter(
    config: AgentConfig, manager: SlotManager, metrics: Metrics, token: str | None
) -> Reporter | None:
    """The controller reporter, when a controller URL is configured."""
    ctl = config.controller
    if not ctl.url:
        return None
    # Imported only when reporting: the reporter brings httpx (with httpcore, h11, anyio's client
    # side and, where installed, its command line's rich and pygments), 3-5 MB of an agent's RSS.
    from nodeagent.agent.reporter import Reporter, ReporterConfig  # noqa: PLC0415

    reporter_config = ReporterConfig(
        url=ctl.url,
        interval_seconds=ctl.interval_seconds,
        timeout_seconds=ctl.timeout_seconds,
        backoff_initial=ctl.backoff_initial_seconds,
        backoff_max=ctl.backoff_max_seconds,
        coalesce_seconds=ctl.coalesce_seconds,
        token=token,
        node_id=ctl.resolved_node_id,
        epoch_file=config.state_dir / "reporter.epoch",
    )
    return Reporter(
        reporter_config,
        manager,
        on_success=lambda: metrics.reporter_last_success.set(time.time()),
        on_failure=metrics.reporter_failures.inc,
    )


def _qos_loop(config: AgentConfig, manager: SlotManager, metrics: Metrics) -> QosLoop | None:
    """The QoS loop (best-effort in what online slots leave), started, when this agent isolates."""
    from nodeagent.agent.qos_loop import build_qos_loop  # noqa: PLC0415 - not on the CLI's import path

    loop = build_qos_loop(config, manager)
    if loop is None:
        return None
    manager.attach_qos(loop)
    metrics.registry.register(loop.collector())
    loop.start()
    return loop


def _listen_sockets(config: AgentConfig) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    if config.api.listen:
        host, port = config.api.host, config.api.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio enables TCP_NODELAY only on sockets that say they are TCP, and
        # without it every small JSON answer waits ~40 ms for a delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            raise translate_os_error(f"listen on {config.api.listen} (--listen / [api] listen)", err) from err
        sockets.append(sock)
    if config.api.unix_socket:
        path = Path(config.api.unix_socket)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: the token is not its only guard
        try:
            unix.bind(str(path))
        finally:
            os.umask(old)
        sockets.append(unix)
    for sock in sockets:
        sock.listen(ACCEPT_BACKLOG)
        sock.set_inheritable(False)
    return sockets


@contextlib.contextmanager
def _terminate_cleanly(received: list[int]) -> Iterator[list[int]]:
    """Turn SIGTERM/SIGINT into a clean shutdown (uvicorn re-raises them after its own stop); the
    signals that came are appended to ``received``."""
    previous = {
        sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: mallopt(3)'s M_ARENA_MAX, and how many malloc arenas the daemon's threads share.
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Have the daemon's threads share ``arenas`` glibc malloc arenas instead of up to 8 per CPU.

    Each thread that allocates while another holds the main arena gets an arena of its own, and
    freed memory stays in the arena it came from: the supervision, QoS, pools and API worker
    threads each kept a partly used one. Two measured 1.5-1.7 MB less RSS at 500 slots (issue 23
    item 7); the threads are idle most of the time, so sharing costs them no measurable waiting.
    Called before any thread starts (arenas made already stay). False where the C library has no
    mallopt (not glibc) or refused."""
    try:
        mallopt = libc.mallopt
    except AttributeError:
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


def without_pydantic_v1() -> bool:
    """Keep ``pydantic.v1`` out of the daemon: RSS it would never use (issue 23 item 7; measured
    1.4-1.6 MB at rest, 2.4 MB at 500 slots).

    FastAPI asks of each route's types, as it builds the routes, whether they are pydantic v1
    models, and imports ``pydantic.v1`` to find out; the agent has none. A None in
    ``sys.modules`` makes that import fail, which FastAPI answers as it does where pydantic has no
    v1 ("not a v1 model"). Only the daemon's own process does this, before anything imports it;
    where something has already (a test process), it stays. False then."""
    if "pydantic.v1" in sys.modules:
        return False
    # The import system's own way to refuse a module: a None entry raises ModuleNotFoundError.
    cast("dict[str, ModuleType | None]", sys.modules)["pydantic.v1"] = None
    return True


def raise_nofile_limit() -> None:
    """Raise the soft descriptor limit to the hard one: every API connection, worker pipe and
    cgroup file is a descriptor, and the usual soft 1024 is a limit for select(), not for us."""
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _uvicorn_config(config: AgentConfig, app: Any, metrics: Metrics) -> Any:
    """uvicorn's settings, its HTTP protocol behind the API's connection limits (agent/connguard.py)."""
    import resource  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # noqa: PLC0415

    from nodeagent.agent.connguard import Counters, Limits, guarded_protocol  # noqa: PLC0415

    # Every connection is a descriptor from accept() on, and asyncio accepts up to ``backlog``
    # connections in one go before the limit can cut any, with up to ACCEPT_BURSTS_IN_FLIGHT such
    # bursts open at once under a flood: open connections may use at most half of what is left
    # after the agent's own descriptors and those bursts, the other half stays for the agent's
    # growth (workers' pipes, cgroup files). Past the descriptor limit accept() fails with EMFILE
    # for everyone, the agent's own health checks included. (With one burst reserved, a flood on
    # a loaded machine still ran a 512-descriptor agent out: 72 accept errors.)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    total = config.api.max_connections
    if nofile != resource.RLIM_INFINITY:
        reserved = ACCEPT_BURSTS_IN_FLIGHT * ACCEPT_BACKLOG
        room = max((nofile - len(os.listdir("/proc/self/fd")) - reserved) // 2, 1)
        if total > room:
            total = room
            log.warning(
                "[api] max_connections lowered to fit the descriptor limit",
                extra={"configured": config.api.max_connections, "used": total, "nofile": nofile},
            )
    limits = Limits(
        max_connections=total,
        max_connections_per_peer=config.api.max_connections_per_peer,
        header_timeout=config.api.header_timeout_s,
    )
    counters = Counters(
        rejected=lambda reason: metrics.api_connections_rejected.labels(reason).inc(),
        accept_error=metrics.api_accept_errors.inc,
    )
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        # No X-Forwarded-* rewriting: the API is reached directly (a unix socket, or a listen
        # address a proxy in front would have to be configured for), and that middleware is one
        # more layer every request crosses.
        proxy_headers=False,
        # AutoHTTPProtocol is uvicorn's httptools protocol (a dependency: about a third less of
        # the framework's cost per request than h11's), h11's only where httptools is missing.
        http=guarded_protocol(AutoHTTPProtocol, limits, counters),
        backlog=ACCEPT_BACKLOG,  # also the most connections asyncio accepts in one go
    )


def _server_class(uvicorn: Any) -> Any:
    """uvicorn's Server with its housekeeping tick at 1 Hz instead of 10 Hz.

    uvicorn wakes every 0.1 s to refresh the Date header (it does so once a second anyway) and to
    look at ``should_exit``: ten wake-ups a second that were a measurable part of an idle agent's
    CPU at 500 slots (issue 23). The exit flag is a property here, so that a signal setting it
    still ends the wait at once rather than up to a second later.
    """

    class Server(uvicorn.Server):  # type: ignore[misc]
        def __init__(self, config: Any) -> None:
            self._exit_wake: asyncio.Event | None = None
            self._should_exit = False
            super().__init__(config)

        @property
        def should_exit(self) -> bool:
            return self._should_exit

        @should_exit.setter
        def should_exit(self, value: bool) -> None:
            self._should_exit = value
            wake = self._exit_wake
            if value and wake is not None:
                # Set from a signal handler too: hand it to the loop rather than touching it here.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(wake.set)

        async def main_loop(self) -> None:
            self._loop = asyncio.get_running_loop()
            self._exit_wake = asyncio.Event()
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                # on_tick refreshes the Date header when the counter is a multiple of 10.
                counter = (counter + 10) % 864000
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._exit_wake.wait(), 1.0)
                should_exit = await self.on_tick(counter)

    return Server


def _guard_api(config: AgentConfig) -> ApiGuard | None:
    """Keep sandboxed slots off the TCP API unless ``[api] slots_may_connect``, and, with
    ``[isolation] local_default_deny`` (the default), off every local address, every listener of
    another uid and every slot with a network (isolation/api_guard.py); where nftables is missing
    the agent runs without the rules and says so."""
    from nodeagent.isolation.api_guard import ApiGuard, LocalDeny, table_name  # noqa: PLC0415
    from nodeagent.isolation.firewall import LibNftables  # noqa: PLC0415

    api_port = config.api.port if config.api.listen else None
    iso = config.isolation
    if not config.sandbox.enabled or (
        not iso.local_default_deny and (api_port is None or config.api.slots_may_connect)
    ):
        return None
    local_deny = None
    if iso.local_default_deny:
        open_ports = tuple(
            (protocol, int(number))
            for number, _, protocol in (entry.partition("/") for entry in iso.local_open_ports)
        )
        local_deny = LocalDeny(open_ports=open_ports, network_cidr=iso.network_cidr)
    guard = ApiGuard(LibNftables(), table_name(iso.firewall_table))
    try:
        guard.install(
            config.sandbox.uid_bounds(),
            api_port=api_port,
            api_open=config.api.slots_may_connect,
            local_deny=local_deny,
        )
    except (NodeAgentError, OSError) as err:
        log.warning(
            "sandboxed slots can reach the API, local services and each other: the firewall rules failed",
            extra={"error": str(err)},
        )
        return None
    return guard


def _accept_error_handler(metrics: Metrics) -> Any:
    from nodeagent.agent.connguard import AcceptErrorHandler, Counters  # noqa: PLC0415

    return AcceptErrorHandler(Counters(accept_error=metrics.api_accept_errors.inc))


# =========================================================================== serve


def serve(config: AgentConfig, *, recovery: RecoveryMode = RecoveryMode.REFUSE) -> None:
    """Run the daemon until SIGTERM/SIGINT.

    Start-up checks everything it can before it touches the kernel: the state directory is taken
    (one agent per directory), the API token and the controller's token are read, and the API's
    sockets are bound; only then are the slots reconciled with the kernel.
    """
    import uvicorn  # noqa: PLC0415 - only the daemon pays for the web stack

    from nodeagent.agent import notify  # noqa: PLC0415
    from nodeagent.agent.api import create_app  # noqa: PLC0415
    from nodeagent.agent.metrics import Metrics  # noqa: PLC0415
    from nodeagent.agent.pools import Pools  # noqa: PLC0415

    setup_logging(config.log.level)
    started = time.monotonic()
    without_pydantic_v1()
    limit_malloc_arenas()
    raise_nofile_limit()
    ensure_state_dir(config.state_dir)
    lock_state_dir(config.state_dir)  # held until the process ends, whatever way it ends
    token = ensure_token(config.token_path)
    reporter_token = controller_token(config)
    sockets = _listen_sockets(config)
    api_guard = _guard_api(config)
    try:
        # systemd: where cgroups go, the agent moved into its leaf; workers stopped with the last agent.
        layout = cgroup_layout(config, detect())
        manager = build_manager(config, recovery=recovery, layout=layout)
        # Before start-up: standbys a restart relaunches get their pool's thread counts.
        pools = Pools(manager, manager.store) if manager.isolation.isolates else None
        if pools is not None:
            pools.load()
        report = manager.start(restart_workers=take_stopped_workers(config.state_dir))
    except BaseException:
        for sock in sockets:
            sock.close()
        if api_guard is not None:
            with contextlib.suppress(NodeAgentError, OSError):
                api_guard.remove()
        raise
    log.info(
        "reconciled",
        extra={
            "report": report.to_dict(),
            "degraded": list(manager.node().degraded),
            "state_dir": str(config.state_dir),
        },
    )
    metrics = Metrics(manager, stats_provider=_slot_stats(manager))
    qos = _qos_loop(config, manager, metrics)
    reporter = _reporter(config, manager, metrics, reporter_token)
    plugins = _device_plugins(config, manager)
    nrt = _nrt_publisher(config, manager)
    _watch_nri(config, manager)
    watchdog = notify.Watchdog.from_environment()
    received: list[int] = []
    try:
        if reporter is not None:
            reporter.start()
        if pools is not None:
            pools.start()
        app = create_app(
            manager,
            token=token,
            metrics=metrics,
            nri=config.kubernetes.nri,
            nri_devices=config.placement.allowed_devices,
            pools=pools,
        )
        server = _server_class(uvicorn)(_uvicorn_config(config, app, metrics))

        async def run() -> None:
            asyncio.get_running_loop().set_exception_handler(_accept_error_handler(metrics))
            task = asyncio.create_task(server.serve(sockets=sockets))
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            if server.started:
                notify.ready(f"serving on {config.api.listen or config.api.unix_socket}")
                if watchdog is not None:
                    watchdog.start()
                log.info(
                    "serving",
                    extra={
                        "listen": config.api.listen,
                        "unix_socket": config.api.unix_socket,
                        "startup_seconds": round(time.monotonic() - started, 3),
                    },
                )
            await task

        with _terminate_cleanly(received):
            asyncio.run(run())
    finally:
        # systemd: a stop (not a restart, crash or systemctl kill) may take the workers with it.
        signum = received[-1] if received else None
        if config.workers.on_agent_stop == "stop" and stop_requested(layout.unit, signum):
            stop_workers_with_agent(config.state_dir, manager)
        else:
            notify.stopping("shutting down; workers keep running")
        if watchdog is not None:
            watchdog.stop()
        if qos is not None:
            qos.stop()
        if reporter is not None:
            reporter.stop()
        if plugins is not None:
            plugins.close()
        if nrt is not None:
            nrt.close()  # the object stays: the scheduler keeps the last numbers through a restart
        if pools is not None:
            pools.close()
        manager.close()
        if api_guard is not None:
            with contextlib.suppress(NodeAgentError, OSError):
                api_guard.remove()
        if config.api.unix_socket:
            with contextlib.suppress(OSError):
                Path(config.api.unix_socket).unlink()
        log.info("stopped")


__all__ = [
    "JsonFormatter",
    "SlotStats",
    "StateDirectoryBusy",
    "build_host",
    "build_isolation",
    "build_manager",
    "build_sandbox",
    "controller_token",
    "ensure_state_dir",
    "ensure_token",
    "lock_state_dir",
    "restore_host",
    "serve",
    "setup_logging",
]
