"""``nodeagent serve``: the daemon's start-up, serving loop and shutdown.

Order of start-up: configuration -> state directory (0700) and API token (0600) -> topology ->
slot manager (reconcile) -> controller reporter -> REST API on uvicorn (TCP and/or a unix socket)
-> ``READY=1`` to systemd once the sockets listen, then ``WATCHDOG=1`` pings when systemd asked
for them. SIGTERM/SIGINT stop the API, the reporter and supervision, but never the workers: they
are not our children and outlive the agent, and the next start re-adopts them.

Logs are JSON lines on stdout (journald keeps them as they are).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeagent.agent.config import AgentConfig
from nodeagent.agent.manager import IsolatorKernel, SlotKernel, SlotManager, SpawnerRuntime, UnisolatedKernel
from nodeagent.agent.placement import placement_index
from nodeagent.agent.service import SlotView
from nodeagent.agent.state import StateStore
from nodeagent.cgroups import CgroupStats, detect, open_manager
from nodeagent.devices.discovery import discover
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError, translate_os_error
from nodeagent.isolation.cpus import CpuLayout
from nodeagent.isolation.network import SlotNetworkConfig
from nodeagent.isolation.slot import SlotIsolator
from nodeagent.isolation.spec import IsolationConfig

if TYPE_CHECKING:
    from nodeagent.agent.metrics import Metrics
    from nodeagent.agent.reporter import Reporter

log = logging.getLogger("nodeagent.daemon")

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


def ensure_token(path: Path) -> str:
    """The API token: read it, or create the file (0600) with a fresh random token."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            token = path.read_text().strip()
        except OSError as err:
            raise translate_os_error(f"read the API token {path}", err) from err
        if not token:
            raise ConfigError(
                f"the API token file {path} is empty; write a token into it or delete it"
            ) from None
        return token
    except OSError as err:
        raise translate_os_error(f"create the API token {path}", err) from err
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


# =========================================================================== assembly


def build_kernel(config: AgentConfig, topology: Topology) -> SlotKernel:
    """The isolator when this host lets us create cgroups; else the unisolated stand-in, with why."""
    host = detect()
    if not host.can_write or os.geteuid() != 0:
        reason = (
            f"not running as root (cgroups {host.mode}): no cgroup, cpuset, device or network isolation"
            if os.geteuid() != 0
            else f"cgroups ({host.mode}) are not writable: no CPU, memory or device isolation"
        )
        return UnisolatedKernel([reason], host.mode)
    options = config.placement_options()
    reserved = options.reserved_cpus
    if reserved is None:
        reserved = placement_index(topology).default_reserved()
    iso = config.isolation
    isolation = IsolationConfig(
        cgroup_parent=iso.cgroup_parent,
        reserved_cpus=reserved,
        network=SlotNetworkConfig(
            cidr=iso.network_cidr, netns_prefix=iso.netns_prefix, veth_prefix=iso.veth_prefix
        ),
    )
    # The isolator takes its CPU layout from the topology discovered at start-up: sysfs is read once.
    isolator = SlotIsolator(host, isolation, layout=CpuLayout.of(topology))
    return IsolatorKernel(isolator, topology, pids_max=iso.pids_max)


class SlotStats:
    """Per-slot cgroup statistics for the metrics scrape (None for a slot without a cgroup).

    The scrape hands over the slots it listed (``prepare``), so each slot's cgroup comes from that
    one listing instead of a database lookup per slot; a slot it did not list is looked up.
    """

    def __init__(self, manager: SlotManager) -> None:
        self._manager = manager
        self._host = detect()
        self._cgroups: dict[str, str | None] = {}

    def prepare(self, slots: Sequence[SlotView]) -> None:
        self._cgroups = {slot.id: slot.cgroup for slot in slots}

    def __call__(self, slot_id: str) -> CgroupStats | None:
        if not self._host.can_write:
            return None
        cgroups = self._cgroups
        cgroup = cgroups[slot_id] if slot_id in cgroups else self._manager.get_slot(slot_id).cgroup
        return None if cgroup is None else open_manager(self._host, cgroup).stats()


def _slot_stats(manager: SlotManager) -> Callable[[str], CgroupStats | None]:
    return SlotStats(manager)


def build_manager(config: AgentConfig, topology: Topology | None = None) -> SlotManager:
    """Everything the manager needs, from the configuration (the state directory must exist)."""
    topo = topology or discover()
    return SlotManager(
        StateStore(config.database_path),
        topo,
        build_kernel(config, topo),
        SpawnerRuntime(config.state_dir / "workers"),
        options=config.placement_options(),
        node_id=config.controller.resolved_node_id,
        allow_unisolated=config.isolation.allow_unisolated,
        tick_seconds=config.workers.tick_seconds,
    )


def _reporter(config: AgentConfig, manager: SlotManager, metrics: Metrics) -> Reporter | None:
    """The controller reporter, when a controller URL is configured."""
    from nodeagent.agent.reporter import Reporter, ReporterConfig  # noqa: PLC0415 - only when reporting

    ctl = config.controller
    if not ctl.url:
        return None
    token = None
    if ctl.token_file:
        try:
            token = Path(ctl.token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(
                f"[controller] token_file {ctl.token_file}: cannot read it ({err.strerror}); "
                "create it or leave the key out"
            ) from err
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
        sock.listen(128)
        sock.set_inheritable(False)
    return sockets


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[list[int]]:
    """Turn SIGTERM/SIGINT into a clean shutdown (uvicorn re-raises them after its own stop)."""
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# =========================================================================== serve


def serve(config: AgentConfig) -> None:
    """Run the daemon until SIGTERM/SIGINT."""
    import uvicorn  # noqa: PLC0415 - only the daemon pays for the web stack

    from nodeagent.agent import notify  # noqa: PLC0415
    from nodeagent.agent.api import create_app  # noqa: PLC0415
    from nodeagent.agent.metrics import Metrics  # noqa: PLC0415

    setup_logging(config.log.level)
    ensure_state_dir(config.state_dir)
    token = ensure_token(config.token_path)
    started = time.monotonic()
    manager = build_manager(config)
    report = manager.start()
    log.info(
        "reconciled",
        extra={
            "report": report.to_dict(),
            "degraded": list(manager.node().degraded),
            "state_dir": str(config.state_dir),
        },
    )
    metrics = Metrics(manager, stats_provider=_slot_stats(manager))
    reporter = _reporter(config, manager, metrics)
    watchdog = notify.Watchdog.from_environment()
    try:
        if reporter is not None:
            reporter.start()
        app = create_app(manager, token=token, metrics=metrics)
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
        sockets = _listen_sockets(config)

        async def run() -> None:
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

        with _terminate_cleanly():
            asyncio.run(run())
    finally:
        notify.stopping("shutting down; workers keep running")
        if watchdog is not None:
            watchdog.stop()
        if reporter is not None:
            reporter.stop()
        manager.close()
        if config.api.unix_socket:
            with contextlib.suppress(OSError):
                Path(config.api.unix_socket).unlink()
        log.info("stopped")


__all__ = [
    "JsonFormatter",
    "SlotStats",
    "build_kernel",
    "build_manager",
    "ensure_state_dir",
    "ensure_token",
    "serve",
    "setup_logging",
]
