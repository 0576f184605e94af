"""Capacity reports to the controller: registration, then heartbeats on change and periodically.

The protocol is written down in docs/controller-protocol.md. In short::

    POST {url}/v1/nodes/register               once per agent start (and again when told 404)
    POST {url}/v1/nodes/{node_id}/heartbeat    every ``interval_seconds`` and after changes

Every body carries ``instance`` = {id, epoch} and a ``sequence``. ``epoch`` grows with every agent
start (persisted in ``epoch_file``, and never below the wall clock in milliseconds), ``sequence``
grows with every report of one instance, so the controller keeps, per node, the report with the
largest ``(epoch, sequence)`` and drops anything older that arrives late.

All network I/O happens on the reporter's own thread. ``notify_change()`` only flips a flag and
sets an event, so the REST API never waits for the controller. Reports are snapshots taken when
they are sent: there is no queue, a slow or absent controller costs nothing but the latest state.
Changes within ``coalesce_seconds`` of the first one go out as one report. While the controller
fails, attempts are spaced by exponential backoff with full jitter and changes do not cut the
backoff short (a recovering controller is not hammered by a busy node).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from nodeagent import __version__
from nodeagent.agent.service import SlotService
from nodeagent.agent.slot import Slot
from nodeagent.atomicfile import write_atomic
from nodeagent.cpulist import format_cpulist
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError

log = logging.getLogger(__name__)

REGISTER_SCHEMA = "nodeagent.register/v1"
HEARTBEAT_SCHEMA = "nodeagent.heartbeat/v1"
#: The QoS actions each slot summary carries (the newest; GET /v1/slots/{id} has more).
SUMMARY_QOS_ACTIONS = 5


@dataclass(frozen=True)
class ReporterConfig:
    """Where and how often to report. Maps onto the ``[controller]`` section of the config file."""

    url: str  #: controller base URL, e.g. "https://controller.example:8443"
    interval_seconds: float = 30.0  #: heartbeat period when nothing changes
    timeout_seconds: float = 5.0  #: per request (connect, read, write and pool each)
    backoff_initial: float = 1.0  #: cap of the first retry delay after a failure
    backoff_max: float = 60.0  #: cap of every later retry delay
    coalesce_seconds: float = 0.5  #: changes this close together become one report
    token: str | None = None  #: sent as "Authorization: Bearer <token>"
    node_id: str | None = None  #: None: the service's node id
    epoch_file: Path | None = None  #: persists the instance epoch; None: wall clock only

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"controller url {self.url!r} is not an http(s) URL; "
                "set [controller] url to something like https://controller.example:8443"
            )
        for name in ("interval_seconds", "timeout_seconds", "backoff_initial", "backoff_max"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"controller {name} must be positive, got {getattr(self, name)!r}")
        if self.coalesce_seconds < 0:
            raise ConfigError(f"controller coalesce_seconds must be >= 0, got {self.coalesce_seconds!r}")
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(
                f"controller backoff_max ({self.backoff_max}) is below backoff_initial "
                f"({self.backoff_initial}); raise backoff_max"
            )


def backoff_delay(failures: int, initial: float, maximum: float, rand: float) -> float:
    """Full jitter: uniform in [0, min(maximum, initial * 2**(failures-1))), ``rand`` in [0, 1).

    Full rather than equal jitter because a fleet of agents that lost the same controller would
    otherwise come back in synchronised waves.
    """
    if failures <= 0:
        return 0.0
    # Past 2**63 the float is already far above any sane maximum; stop doubling there.
    cap = min(maximum, initial * 2.0 ** min(failures - 1, 63))
    return cap * rand


def next_epoch(epoch_file: Path | None, now_ms: int) -> int:
    """This start's epoch: above the stored one and not below the clock; stored again if possible."""
    previous = 0
    if epoch_file is not None:
        try:
            previous = int(epoch_file.read_text().strip() or 0)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as err:
            log.warning("cannot read reporter epoch from %s (%s); using the clock", epoch_file, err)
    epoch = max(previous + 1, now_ms)
    if epoch_file is not None:
        _write_atomically(epoch_file, f"{epoch}\n")
    return epoch


def _write_atomically(path: Path, text: str) -> None:
    try:
        write_atomic(path, text, durable=True)
    except OSError as err:
        log.warning("cannot store reporter epoch in %s (%s); a restart relies on the clock", path, err)


# --------------------------------------------------------------------------- report bodies


def topology_summary(topo: Topology) -> dict[str, Any]:
    """What a scheduler needs to know about the host's shape, without per-CPU detail."""
    online = topo.online_cpus
    return {
        "hostname": topo.hostname,
        "sockets": len(topo.sockets),
        "numa_nodes": [
            {
                "id": n.id,
                "cpus": sum(1 for c in n.cpus if c in online),
                "memory_bytes": n.memory_bytes,
            }
            for n in topo.numa_nodes
        ],
        "cpus": len(online),
        "cores": sum(1 for ids in topo.cores.values() if any(c in online for c in ids)),
        "threads_per_core": max((len(ids) for ids in topo.cores.values()), default=0),
        "memory_bytes": topo.memory_bytes,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "numa": g.numa,
                "memory_bytes": g.memory_bytes,
                "mig": None
                if g.mig is None
                else {
                    "enabled": g.mig.enabled,
                    "instances": [{"profile": m.profile, "uuid": m.uuid} for m in g.mig.instances],
                },
            }
            for g in topo.gpus
        ],
        "fpgas": [
            {"id": f.id, "vendor": f.vendor, "device": f.device, "pci_bus_id": f.pci_bus_id, "numa": f.numa}
            for f in topo.fpgas
        ],
    }


def device_health(topo: Topology) -> list[dict[str, Any]]:
    """One entry per accelerator; ``healthy`` None means the agent cannot tell."""
    gpus = [
        {"kind": "gpu", "id": g.uuid or str(g.index), "healthy": g.healthy, "events": list(g.health_events)}
        for g in topo.gpus
    ]
    fpgas: list[dict[str, Any]] = [
        {"kind": "fpga", "id": f.id, "healthy": f.healthy, "events": []} for f in topo.fpgas
    ]
    return gpus + fpgas


def slot_summary(slot: Slot) -> dict[str, Any]:
    a = slot.assignment
    return {
        "id": slot.id,
        "name": slot.name,
        "qos": slot.qos,
        "state": str(slot.state),
        "cpus": None if a is None else format_cpulist(a.cpus),
        "exclusive": None if a is None else a.exclusive,
        "numa_nodes": [] if a is None else list(a.numa_nodes),
        "memory_bytes": None if a is None else a.memory_bytes,
        "gpus": [] if a is None else list(a.gpu_uuids or a.gpus),
        "mig": [] if a is None else [m.uuid or m.profile for m in a.mig],
        "fpgas": [] if a is None else list(a.fpgas),
        "worker_phase": None if slot.worker is None else str(slot.worker.phase),
        "endpoints": [e.to_json() for e in slot.endpoints],
        "reason": slot.reason,
        # The QoS loop's recent actions (their "seq" grows, so repeats across heartbeats are seen).
        "qos_actions": [dict(action) for action in slot.qos_actions[-SUMMARY_QOS_ACTIONS:]],
        "qos_evicted": slot.qos_evicted,
    }


# --------------------------------------------------------------------------- the reporter


class ReportFailed(Exception):
    """One attempt did not reach the controller or was refused; retried with backoff, never raised
    out of the reporter thread."""


class _NodeUnknown(ReportFailed):
    """The controller answered 404 to a heartbeat: it lost (or never had) our registration."""


def _default_wait(event: threading.Event, timeout: float) -> bool:
    return event.wait(timeout)


class Reporter:
    """Registers with the controller and keeps it informed, from one daemon thread.

    ``clock`` (monotonic seconds), ``wait(event, timeout) -> bool`` and ``rand() -> [0, 1)`` are
    injectable so tests control time and jitter; ``transport`` lets tests swap httpx's transport.
    ``on_success`` / ``on_failure`` are called after each attempt (the daemon wires them to the
    Prometheus metrics), from the reporter thread.
    """

    def __init__(
        self,
        config: ReporterConfig,
        service: SlotService,
        *,
        on_success: Callable[[], None] | None = None,
        on_failure: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Event, float], bool] = _default_wait,
        rand: Callable[[], float] = random.random,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        self._service = service
        self._on_success = on_success
        self._on_failure = on_failure
        self._clock = clock
        self._wait = wait
        self._rand = rand
        self._transport = transport
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.instance_id = str(uuid.uuid4())
        self.epoch = 0
        self._started_at = 0.0
        self._sequence = 0
        self._registered = False
        self._change_since: float | None = None
        self._next_attempt = 0.0
        self._failures = 0
        self._last_success: float | None = None
        self._last_error: str | None = None
        self._node_id = config.node_id

    # -- control, from any thread

    def start(self) -> None:
        """Start reporting: the thread registers at once. Also subscribes to the service's changes."""
        if self._thread is not None:
            return
        self.epoch = next_epoch(self.config.epoch_file, int(time.time() * 1000))
        self._started_at = time.time()
        self._next_attempt = self._clock()
        self._stop.clear()
        self._service.subscribe(self.notify_change)
        self._thread = threading.Thread(target=self._run, name="nodeagent-reporter", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread. Returns at once unless a request is in flight, which is bounded by
        ``timeout_seconds`` (httpx cannot cancel a request from another thread)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.config.timeout_seconds * 4 + 1 if timeout is None else timeout)
            if thread.is_alive():
                log.warning("reporter thread still waiting on the controller; leaving it (daemon thread)")

    def notify_change(self) -> None:
        """Slots or capacity changed: report soon. Never blocks on the network."""
        with self._lock:
            if self._change_since is None:
                self._change_since = self._clock()
        self._wake.set()

    def status(self) -> dict[str, Any]:
        """The reporter's view for GET /v1/node and for people debugging a silent controller."""
        with self._lock:
            wait_s = max(0.0, self._next_attempt - self._clock())
            return {
                "url": self.config.url,
                "node_id": self._node_id,
                "instance_id": self.instance_id,
                "epoch": self.epoch,
                "sequence": self._sequence,
                "registered": self._registered,
                "last_success": self._last_success,
                "last_error": self._last_error,
                "consecutive_failures": self._failures,
                "next_attempt": None if self._thread is None else time.time() + wait_s,
            }

    # -- the reporter thread

    def _run(self) -> None:
        headers = {"User-Agent": f"nodeagent/{__version__}"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        timeout = httpx.Timeout(self.config.timeout_seconds)
        with httpx.Client(timeout=timeout, headers=headers, transport=self._transport) as client:
            while not self._stop.is_set():
                self._wake.clear()
                remaining = self._deadline() - self._clock()
                if remaining > 0:
                    self._wait(self._wake, remaining)
                    continue
                self._attempt(client)

    def _deadline(self) -> float:
        with self._lock:
            if self._failures or self._change_since is None:
                return self._next_attempt
            return min(self._next_attempt, self._change_since + self.config.coalesce_seconds)

    def _attempt(self, client: httpx.Client) -> None:
        with self._lock:
            self._change_since = None
        try:
            self._report(client)
        except ReportFailed as err:
            self._failed(str(err))
        except Exception as err:
            # A bug in building the body (a service method raising) must not end reporting.
            log.exception("building the controller report failed")
            self._failed(f"building the report failed: {err}")
        else:
            self._succeeded()

    def _report(self, client: httpx.Client) -> None:
        if not self._registered:
            self._register(client)
        try:
            self._post(client, self._heartbeat_path(), self._heartbeat_body())
        except _NodeUnknown:
            log.info("controller does not know node %s; registering again", self._node_id)
            with self._lock:
                self._registered = False
            self._register(client)
            self._post(client, self._heartbeat_path(), self._heartbeat_body())

    def _register(self, client: httpx.Client) -> None:
        self._post(client, "/v1/nodes/register", self._register_body())
        with self._lock:
            self._registered = True
        log.info("registered with controller %s as node %s", self.config.url, self._node_id)

    def _post(self, client: httpx.Client, path: str, body: dict[str, Any]) -> None:
        url = self.config.url.rstrip("/") + path
        try:
            response = client.post(url, json=body)
        except httpx.HTTPError as err:
            raise ReportFailed(f"POST {url}: {type(err).__name__}: {err}") from err
        if response.status_code == 404 and path != "/v1/nodes/register":
            raise _NodeUnknown(f"POST {url}: 404, controller does not know this node")
        if not response.is_success:
            raise ReportFailed(f"POST {url}: HTTP {response.status_code} {response.text[:200]!r}")

    def _succeeded(self) -> None:
        with self._lock:
            recovered = self._failures
            self._failures = 0
            self._last_success = time.time()
            self._last_error = None
            self._next_attempt = self._clock() + self.config.interval_seconds
        if recovered:
            log.info("controller %s reachable again after %d failed attempts", self.config.url, recovered)
        if self._on_success is not None:
            self._on_success()

    def _failed(self, error: str) -> None:
        with self._lock:
            self._failures += 1
            delay = backoff_delay(
                self._failures, self.config.backoff_initial, self.config.backoff_max, self._rand()
            )
            self._next_attempt = self._clock() + delay
            self._last_error = error
            failures = self._failures
        # The first failure and then every tenth: a long outage must not flood the journal.
        if failures == 1 or failures % 10 == 0:
            log.warning("controller report failed (%d in a row, next in %.1fs): %s", failures, delay, error)
        if self._on_failure is not None:
            self._on_failure()

    # -- bodies

    def _next_sequence(self) -> int:
        with self._lock:
            self._sequence += 1
            return self._sequence

    def _identity(self) -> dict[str, Any]:
        node = self._service.node()
        if self._node_id is None:
            self._node_id = node.node_id
        return {
            "node_id": self._node_id,
            "instance": {"id": self.instance_id, "epoch": self.epoch, "started_at": self._started_at},
            "sequence": self._next_sequence(),
            "sent_at": time.time(),
        }

    def _register_body(self) -> dict[str, Any]:
        node = self._service.node()
        return {
            "schema": REGISTER_SCHEMA,
            **self._identity(),
            "hostname": node.hostname,
            "agent_version": node.agent_version,
            "cgroup_mode": node.cgroup_mode,
            "degraded": list(node.degraded),
            "topology": topology_summary(self._service.topology()),
        }

    def _heartbeat_body(self) -> dict[str, Any]:
        # Gather state before taking the sequence number: a later number never describes older state.
        capacity = self._service.capacity()
        health = device_health(self._service.topology())
        slots = [slot_summary(s) for s in self._service.list_slots()]
        return {
            "schema": HEARTBEAT_SCHEMA,
            **self._identity(),
            "capacity": capacity,
            "device_health": health,
            "slots": slots,
        }

    def _heartbeat_path(self) -> str:
        if self._node_id is None:
            self._node_id = self._service.node().node_id
        return f"/v1/nodes/{quote(self._node_id, safe='')}/heartbeat"
