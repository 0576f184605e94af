"""GPU health from NVML events: XID critical errors, double-bit ECC errors, GPUs that fall off the bus.

``GpuHealthMonitor`` turns events from a ``GpuEventSource`` (``NvmlBackend`` on a real host) into
per-GPU health. It has no thread of its own: ``poll_once(timeout_ms)`` waits for one batch of events,
so tests drive it step by step; ``GpuHealthThread`` runs it in the background until stopped.

Some XIDs report a fault of the application, not of the GPU (NVIDIA's device plugin for Kubernetes
ignores the same ones): 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout. They do
not mark a GPU unhealthy; the set is configurable. A GPU once unhealthy stays so until the agent
restarts: the faults that make it so need a GPU reset or a reboot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from nodeagent.devices.gpu import LOST, GpuEvent, GpuUnavailable
from nodeagent.devices.topology import Gpu
from nodeagent.errors import DiscoveryError

log = logging.getLogger(__name__)

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


class GpuEventSource(Protocol):
    def start_events(self) -> tuple[GpuEvent, ...]:
        """Start watching; returns one "watching", "unwatched" or "lost" event per GPU (plus any
        fault already present). Raises GpuUnavailable when there is no driver."""
        ...

    def wait_events(self, timeout_ms: int) -> tuple[GpuEvent, ...]:
        """Events arriving within timeout_ms; () on timeout. Raises DiscoveryError on failure."""
        ...

    def stop_events(self) -> None: ...


@dataclass(frozen=True, slots=True)
class GpuHealth:
    index: int
    uuid: str | None
    healthy: bool | None  #: None: not watched, health unknown
    events: tuple[str, ...] = ()  #: why it is unhealthy, e.g. "xid 79"
    ignored_events: int = 0  #: application XIDs and corrected ECC errors seen


def describe(event: GpuEvent) -> str:
    """The short reason shown in health_events."""
    if event.kind == "xid":
        text = f"xid {event.xid}"
    elif event.kind == "ecc_dbe":
        text = "ecc double-bit error"
    elif event.kind == "lost":
        text = LOST
    else:
        text = event.kind
    if event.gpu_instance_id is not None:
        text += f" on MIG gi {event.gpu_instance_id}"
        if event.compute_instance_id is not None:
            text += f" ci {event.compute_instance_id}"
    if event.detail and event.kind == "ecc_dbe":
        text += f" ({event.detail})"
    return text


class GpuHealthMonitor:
    """Per-GPU health, updated from the events of one source."""

    def __init__(
        self,
        source: GpuEventSource,
        *,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        on_change: Callable[[GpuHealth], None] | None = None,
    ) -> None:
        self._source = source
        self.ignored_xids = frozenset(ignored_xids)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._health: dict[int, GpuHealth] = {}
        self.available = False
        #: why the monitor is not watching, or the last failure while waiting; "" when fine
        self.status_message = ""

    def start(self) -> None:
        """Watch every GPU. Without a driver the monitor just stays unavailable."""
        try:
            events = self._source.start_events()
        except GpuUnavailable as err:
            self.status_message = str(err)
            return
        self.available = True
        self.status_message = ""
        for event in events:
            self._apply(event)

    def poll_once(self, timeout_ms: int) -> tuple[GpuEvent, ...]:
        """Wait up to ``timeout_ms`` for events and apply them; returns what arrived."""
        if not self.available:
            return ()
        try:
            events = self._source.wait_events(timeout_ms)
        except DiscoveryError as err:
            # Not a verdict on any one GPU: marking them all unhealthy would take the whole
            # host's capacity away on a monitoring hiccup.
            self.status_message = str(err)
            log.warning("GPU health: %s", err)
            raise
        for event in events:
            self._apply(event)
        return events

    def stop(self) -> None:
        if self.available:
            self.available = False
            self._source.stop_events()

    def health(self) -> Mapping[int, GpuHealth]:
        with self._lock:
            return dict(self._health)

    def apply_to(self, gpus: Iterable[Gpu]) -> tuple[Gpu, ...]:
        """The GPUs with health filled in from what the monitor has seen (matched by index)."""
        health = self.health()
        out = []
        for gpu in gpus:
            h = health.get(gpu.index)
            if h is None or (gpu.uuid is not None and h.uuid is not None and gpu.uuid != h.uuid):
                out.append(gpu)
                continue
            healthy = h.healthy if gpu.healthy is not False else False
            events = tuple(dict.fromkeys(gpu.health_events + h.events))
            out.append(replace(gpu, healthy=healthy, health_events=events))
        return tuple(out)

    # ----------------------------------------------------------------- state changes

    def _is_fault(self, event: GpuEvent) -> bool:
        if event.kind == "xid":
            return event.xid not in self.ignored_xids
        return event.kind in ("ecc_dbe", "lost")

    def _apply(self, event: GpuEvent) -> None:
        with self._lock:
            is_new = event.index not in self._health
            before = self._health.get(event.index) or GpuHealth(event.index, event.uuid, None)
            after = self._next(before, event)
            self._health[event.index] = after
        if is_new or (after.healthy, after.events) != (before.healthy, before.events):
            log.info("GPU %d health: %s (%s)", event.index, after.healthy, describe(event))
            if self._on_change is not None:
                self._on_change(after)

    def _next(self, h: GpuHealth, event: GpuEvent) -> GpuHealth:
        uuid = h.uuid or event.uuid
        if self._is_fault(event):
            # A fault on one MIG instance still marks the whole GPU: the topology has no
            # per-instance health yet, and handing out a faulty instance is worse than idling it.
            events = h.events if describe(event) in h.events else (*h.events, describe(event))
            return GpuHealth(h.index, uuid, False, events, h.ignored_events)
        if event.kind in ("xid", "ecc_sbe"):
            return replace(h, uuid=uuid, ignored_events=h.ignored_events + 1)
        if event.kind == "watching" and h.healthy is None:
            return replace(h, uuid=uuid, healthy=True)
        if event.kind == "unwatched" and h.healthy is not False:
            return replace(h, uuid=uuid, healthy=None)
        return replace(h, uuid=uuid)


class GpuHealthThread:
    """Runs a monitor's ``poll_once`` in a daemon thread until ``stop()``."""

    def __init__(self, monitor: GpuHealthMonitor, *, timeout_ms: int = 5000, retry_s: float = 5.0) -> None:
        self.monitor = monitor
        self.timeout_ms = timeout_ms
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the monitor and, when there are GPUs to watch, the thread."""
        self.monitor.start()
        if not self.monitor.available:
            return
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.monitor.poll_once(self.timeout_ms)
            except DiscoveryError:
                self._stop.wait(self.retry_s)  # do not spin on a persistent failure

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, join_timeout_s: float | None = None) -> None:
        """Stop polling; returns once the current wait (at most ``timeout_ms``) has ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_timeout_s)
            self._thread = None
        self.monitor.stop()
