"""Device hotplug: kernel uevents, through pyudev, as typed :class:`DeviceEvent` values.

A :class:`HotplugMonitor` opens its netlink socket when it is built, so no event between building
it and the first :meth:`~HotplugMonitor.poll` is lost. Consume it one of two ways: ``poll`` /
iteration in the caller's thread, or ``start(callback)`` which runs a thread until ``stop()``.
A monitor is single-use: ``close()`` (also ``stop()`` and leaving a ``with`` block) ends the
thread, closes the socket and its wake-up pipe.

Events come from udev (after its rules ran and created /dev nodes) when a udev daemon runs, and
straight from the kernel otherwise (containers, minimal VMs). The kernel drops uevents when a
listener's socket buffer is full (e.g. enabling many VFs at once); each such loss is counted in
``overflows`` and the consumer should then rescan sysfs rather than trust its picture.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

import pyudev

from nodeagent.devices.pci import is_fpga_function, pci_parent
from nodeagent.errors import Conflict, DiscoveryError, os_error_message

log = logging.getLogger(__name__)

Action = Literal["add", "remove", "change", "bind", "unbind", "move", "online", "offline"]
_ACTIONS: frozenset[str] = frozenset(get_args(Action))

Source = Literal["auto", "udev", "kernel"]

#: What the agent follows by default: PCI functions (GPUs, FPGAs, NICs' VFs coming and going),
#: DRM nodes, FPGA managers/regions, and vfio groups (a VF bound to vfio-pci).
DEFAULT_SUBSYSTEMS: tuple[str, ...] = ("pci", "drm", "fpga_manager", "fpga_region", "vfio")

# Big enough for a burst of a few hundred events (e.g. 256 VFs appearing); needs CAP_NET_ADMIN.
_RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024

_PCI_CLASS_DISPLAY = 0x03
_PCI_CLASS_ACCELERATOR = 0x12


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    action: Action
    subsystem: str
    sys_path: str  #: "/sys/devices/pci0000:00/0000:3b:00.1/drm/renderD128"
    device_node: str | None  #: "/dev/dri/renderD128"; None for devices without a node (net, pci)
    #: "fpga", "gpu", "accelerator", "pci" (other PCI functions), else the subsystem ("net", "block", ...)
    kind: str
    pci_bus_id: str | None  #: the PCI function the device belongs to, when there is one
    seqnum: int | None = None  #: the kernel's uevent sequence number


def event_from_device(device: Any, fpga_bus_ids: Iterable[str] = ()) -> DeviceEvent | None:
    """Translate a pyudev Device (or anything with its attributes) into a DeviceEvent.

    Uses ``action``, ``subsystem``, ``sys_path``, ``device_node`` and ``properties``. Returns None
    for actions this module does not know. ``fpga_bus_ids`` marks PCI functions known to be
    FPGAs, so that e.g. an XRT render node is told apart from a GPU's.
    """
    action = device.action
    if action not in _ACTIONS:
        return None
    subsystem = str(device.subsystem or "")
    sys_path = str(device.sys_path)
    props: Mapping[str, str] = device.properties
    bus_id = props.get("PCI_SLOT_NAME") or pci_parent(sys_path)
    seqnum = props.get("SEQNUM")
    return DeviceEvent(
        action=action,
        subsystem=subsystem,
        sys_path=sys_path,
        device_node=device.device_node or None,
        kind=_kind(subsystem, props, bus_id, frozenset(fpga_bus_ids)),
        pci_bus_id=bus_id,
        seqnum=int(seqnum) if seqnum and seqnum.isdigit() else None,
    )


def _kind(subsystem: str, props: Mapping[str, str], bus_id: str | None, fpga_bus_ids: frozenset[str]) -> str:
    if subsystem in ("fpga_manager", "fpga_region") or (bus_id is not None and bus_id in fpga_bus_ids):
        return "fpga"
    if subsystem == "drm":
        return "gpu"
    if subsystem != "pci":
        return subsystem or "unknown"
    vendor, _, device = props.get("PCI_ID", "").lower().partition(":")
    # uevents write ids without "0x" and without leading zeros in the class ("30000")
    if vendor and is_fpga_function(f"0x{vendor}", f"0x{device}", props.get("DRIVER")):
        return "fpga"
    try:
        base_class = int(props.get("PCI_CLASS", ""), 16) >> 16
    except ValueError:
        return "pci"
    if base_class == _PCI_CLASS_DISPLAY:
        return "gpu"
    if base_class == _PCI_CLASS_ACCELERATOR:
        return "accelerator"
    return "pci"


def default_source(udev_run_dir: Path = Path("/run/udev")) -> Literal["udev", "kernel"]:
    """udev's events when a udev daemon runs (its control socket exists), the kernel's otherwise."""
    return "udev" if (udev_run_dir / "control").exists() else "kernel"


class HotplugMonitor:
    """Typed device events for a set of subsystems; see the module docstring for the lifecycle."""

    def __init__(
        self,
        subsystems: Iterable[str] = DEFAULT_SUBSYSTEMS,
        *,
        source: Source = "auto",
        fpga_bus_ids: Iterable[str] = (),
    ) -> None:
        self.subsystems = tuple(subsystems)
        if not self.subsystems:
            raise DiscoveryError("a hotplug monitor needs at least one subsystem, e.g. 'pci'")
        self.source = default_source() if source == "auto" else source
        self.fpga_bus_ids = frozenset(fpga_bus_ids)
        self.overflows = 0
        self._monitor: Any = self._open_monitor()
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._closing = threading.Event()
        self._lock = threading.Lock()  # held while a reader waits on the socket
        self._thread: threading.Thread | None = None

    def _open_monitor(self) -> Any:
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
            for subsystem in self.subsystems:
                monitor.filter_by(subsystem)
            monitor.start()
        except OSError as err:
            raise DiscoveryError(
                os_error_message(f"opening a {self.source} uevent netlink socket for {self.subsystems}", err)
            ) from err
        try:
            monitor.set_receive_buffer_size(_RECEIVE_BUFFER_BYTES)
        except OSError as err:
            log.debug("uevent socket buffer left at its default: %s", err)
        return monitor

    # ------------------------------------------------------------------ reading in the caller's thread

    def poll(self, timeout: float | None = None) -> DeviceEvent | None:
        """The next event, waiting up to ``timeout`` seconds (None: until one comes or the monitor closes).

        Returns None on timeout and once the monitor is closed from another thread.
        """
        if self._thread is not None:
            raise Conflict("this hotplug monitor is consumed by its start() thread; call stop() first")
        return self._next(timeout)

    def __iter__(self) -> Iterator[DeviceEvent]:
        """Events as they come, until the monitor is closed (from another thread)."""
        while (event := self.poll(None)) is not None:
            yield event

    def _next(self, timeout: float | None) -> DeviceEvent | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._closing.is_set():
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                readable, _, _ = select.select([self._monitor.fileno(), self._wake_read], [], [], remaining)
                if self._wake_read in readable:
                    return None
                if readable:
                    event = self._receive()
                    if event is not None:
                        return event
                if deadline is not None and time.monotonic() >= deadline:
                    return None
            return None

    def _receive(self) -> DeviceEvent | None:
        try:
            device = self._monitor.poll(timeout=0)
        except OSError as err:
            if err.errno != errno.ENOBUFS:
                raise DiscoveryError(os_error_message("receiving a uevent", err)) from err
            self.overflows += 1
            log.warning("uevents were lost (socket buffer full); rescan devices to catch up")
            return None
        if device is None:
            return None
        return event_from_device(device, self.fpga_bus_ids)

    # ------------------------------------------------------------------ reading in a thread

    def start(self, callback: Callable[[DeviceEvent], object]) -> None:
        """Call ``callback`` with each event from a background thread until :meth:`stop`.

        An exception from the callback is logged and the thread goes on with the next event.
        """
        if self._closing.is_set():
            raise Conflict("this hotplug monitor is closed; build a new one")
        if self._thread is not None:
            raise Conflict("this hotplug monitor is already started")
        self._thread = threading.Thread(
            target=self._run, args=(callback,), name="nodeagent-hotplug", daemon=True
        )
        self._thread.start()

    def _run(self, callback: Callable[[DeviceEvent], object]) -> None:
        while True:
            try:
                event = self._next(None)
            except DiscoveryError:
                log.exception("hotplug monitor stopped: the uevent socket failed; rescan devices")
                return
            if event is None:
                return
            try:
                callback(event)
            except Exception:
                log.exception("hotplug callback failed on %s %s", event.action, event.sys_path)

    def stop(self) -> None:
        """End the thread (if any) and close the socket; same as :meth:`close`."""
        self.close()

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        os.write(self._wake_write, b"x")
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:  # wait for a reader in another thread to leave select()
            # libudev closes the socket when the last reference goes (CPython frees it here).
            self._monitor = None
            os.close(self._wake_read)
            os.close(self._wake_write)

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def __enter__(self) -> HotplugMonitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
