"""Hotplug events: translation of pyudev devices, and real kernel uevents (veth pairs, loop devices)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodeagent.devices.hotplug import DeviceEvent, HotplugMonitor, default_source, event_from_device
from nodeagent.errors import Conflict, DiscoveryError

# How long a test waits for the kernel's uevents before declaring them missing (a bound for
# failure, not a timing assertion: they normally arrive within milliseconds).
EVENT_WAIT_S = 10.0


@dataclass
class FakeUdevDevice:
    """The attributes of a pyudev.Device that event_from_device reads."""

    action: str | None
    subsystem: str
    sys_path: str
    device_node: str | None = None
    properties: dict[str, str] = field(default_factory=dict)


XOCL_RENDER = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1/drm/renderD128"


@pytest.mark.parametrize(
    ("device", "fpga_bus_ids", "expected"),
    [
        pytest.param(
            FakeUdevDevice(
                "add",
                "pci",
                "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1",
                properties={"PCI_ID": "10EE:5005", "PCI_SLOT_NAME": "0000:3b:00.1", "SEQNUM": "77"},
            ),
            (),
            DeviceEvent(
                "add",
                "pci",
                "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1",
                None,
                "fpga",
                "0000:3b:00.1",
                77,
            ),
            id="pci-add-alveo",
        ),
        pytest.param(
            FakeUdevDevice(
                "bind",
                "pci",
                "/sys/devices/pci0000:00/0000:00:1e.0",
                properties={"PCI_ID": "10DE:2330", "PCI_CLASS": "30200", "DRIVER": "nvidia"},
            ),
            (),
            DeviceEvent("bind", "pci", "/sys/devices/pci0000:00/0000:00:1e.0", None, "gpu", "0000:00:1e.0"),
            id="pci-bind-nvidia-by-class",
        ),
        pytest.param(
            FakeUdevDevice(
                "remove",
                "pci",
                "/sys/devices/pci0000:00/0000:00:05.0",
                properties={"PCI_ID": "8086:0B30", "PCI_CLASS": "120000"},
            ),
            (),
            DeviceEvent(
                "remove", "pci", "/sys/devices/pci0000:00/0000:00:05.0", None, "fpga", "0000:00:05.0"
            ),
            id="pci-remove-intel-pac",
        ),
        pytest.param(
            FakeUdevDevice(
                "add",
                "pci",
                "/sys/devices/pci0000:00/0000:00:06.0",
                properties={"PCI_ID": "1D0F:8061", "PCI_CLASS": "120000"},
            ),
            (),
            DeviceEvent(
                "add", "pci", "/sys/devices/pci0000:00/0000:00:06.0", None, "accelerator", "0000:00:06.0"
            ),
            id="pci-processing-accelerator",
        ),
        pytest.param(
            FakeUdevDevice(
                "add",
                "pci",
                "/sys/devices/pci0000:00/0000:00:03.0",
                properties={"PCI_ID": "1AF4:1041", "PCI_CLASS": "20000"},
            ),
            (),
            DeviceEvent("add", "pci", "/sys/devices/pci0000:00/0000:00:03.0", None, "pci", "0000:00:03.0"),
            id="pci-nic",
        ),
        pytest.param(
            FakeUdevDevice("add", "drm", XOCL_RENDER, "/dev/dri/renderD128"),
            ("0000:3b:00.1",),
            DeviceEvent("add", "drm", XOCL_RENDER, "/dev/dri/renderD128", "fpga", "0000:3b:00.1"),
            id="drm-node-of-known-fpga",
        ),
        pytest.param(
            FakeUdevDevice("add", "drm", XOCL_RENDER, "/dev/dri/renderD128"),
            (),
            DeviceEvent("add", "drm", XOCL_RENDER, "/dev/dri/renderD128", "gpu", "0000:3b:00.1"),
            id="drm-node-of-other-card",
        ),
        pytest.param(
            FakeUdevDevice("add", "fpga_region", "/sys/devices/platform/soc/fpga-region/fpga_region/region0"),
            (),
            DeviceEvent(
                "add",
                "fpga_region",
                "/sys/devices/platform/soc/fpga-region/fpga_region/region0",
                None,
                "fpga",
                None,
            ),
            id="soc-fpga-region",
        ),
        pytest.param(
            FakeUdevDevice(
                "remove", "net", "/sys/devices/virtual/net/natest1a", properties={"INTERFACE": "natest1a"}
            ),
            (),
            DeviceEvent("remove", "net", "/sys/devices/virtual/net/natest1a", None, "net", None),
            id="net-remove",
        ),
        pytest.param(
            FakeUdevDevice(
                "change", "block", "/sys/devices/virtual/block/loop3", "/dev/loop3", {"SEQNUM": "x"}
            ),
            (),
            DeviceEvent("change", "block", "/sys/devices/virtual/block/loop3", "/dev/loop3", "block", None),
            id="block-change-bad-seqnum",
        ),
        pytest.param(
            FakeUdevDevice(None, "pci", "/sys/devices/pci0000:00/0000:00:03.0"), (), None, id="no-action"
        ),
        pytest.param(
            FakeUdevDevice("exploded", "pci", "/sys/devices/pci0000:00/0000:00:03.0"),
            (),
            None,
            id="unknown-action",
        ),
    ],
)
def test_event_from_device(device, fpga_bus_ids, expected):
    assert event_from_device(device, fpga_bus_ids) == expected


@pytest.mark.parametrize(("has_control", "expected"), [(True, "udev"), (False, "kernel")])
def test_default_source(tmp_path, has_control, expected):
    if has_control:
        (tmp_path / "control").write_text("")
    assert default_source(tmp_path) == expected


def test_monitor_needs_a_subsystem():
    with pytest.raises(DiscoveryError, match="at least one subsystem"):
        HotplugMonitor(())


# --------------------------------------------------------------------------- real uevents


def _open_fds() -> set[tuple[str, str]]:
    """This process's descriptors as (number, what it refers to), after a garbage collection.

    Collecting first keeps an earlier test's unreachable sockets from closing in the middle of
    the check; the target makes a leaked socket visible even when it reuses a number that such
    a collection freed."""
    gc.collect()
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the directory's own descriptor, closed by now
            continue
    return found


def _leaked(before: set[tuple[str, str]]) -> set[tuple[str, str]]:
    return _open_fds() - before


def _wait_for(
    next_event: Callable[[float], DeviceEvent | None], wanted: Callable[[DeviceEvent], bool], count: int
) -> list[DeviceEvent]:
    """Events that match ``wanted`` until ``count`` came or EVENT_WAIT_S passed; others (from
    parallel tests) are skipped."""
    deadline = time.monotonic() + EVENT_WAIT_S
    seen: list[DeviceEvent] = []
    while len(seen) < count and (left := deadline - time.monotonic()) > 0:
        event = next_event(left)
        if event is not None and wanted(event):
            seen.append(event)
    return seen


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def veth_names(request) -> Iterator[tuple[str, str]]:
    names = (f"natest{os.getpid()}a", f"natest{os.getpid()}b")
    yield names
    for name in names:
        if Path(f"/sys/class/net/{name}").exists():
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


@pytest.mark.root
def test_veth_pair_appearing_and_going(veth_names):
    a, b = veth_names

    def ours(event: DeviceEvent) -> bool:
        return event.sys_path.rsplit("/", 1)[-1] in veth_names

    with HotplugMonitor(("net",)) as monitor:
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        added = _wait_for(monitor.poll, ours, 2)
        _ip("link", "del", a)  # deleting one end deletes its peer
        removed = _wait_for(monitor.poll, ours, 2)
    assert sorted((e.action, e.subsystem, e.kind, e.sys_path) for e in added) == [
        ("add", "net", "net", f"/sys/devices/virtual/net/{a}"),
        ("add", "net", "net", f"/sys/devices/virtual/net/{b}"),
    ]
    assert sorted((e.action, e.sys_path) for e in removed) == [
        ("remove", f"/sys/devices/virtual/net/{a}"),
        ("remove", f"/sys/devices/virtual/net/{b}"),
    ]
    assert all(e.device_node is None and e.pci_bus_id is None and e.seqnum for e in added + removed)


@pytest.fixture
def backing_file(tmp_path) -> Path:
    path = tmp_path / f"natest{os.getpid()}.img"
    with path.open("wb") as f:
        f.truncate(1 << 20)
    return path


@pytest.fixture
def loop_device(backing_file) -> Iterator[Callable[[], str]]:
    """Attach on call, detach in the finalizer (also when the test failed half way)."""
    if shutil.which("losetup") is None:
        pytest.skip("losetup is not installed")
    attached: list[str] = []

    def attach() -> str:
        out = subprocess.run(
            ["losetup", "--find", "--show", str(backing_file)], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            pytest.skip(f"losetup cannot attach a loop device here: {out.stderr.strip()}")
        attached.append(out.stdout.strip())
        return attached[-1]

    yield attach
    for dev in attached:
        subprocess.run(["losetup", "--detach", dev], check=False, capture_output=True)


@pytest.mark.root
def test_loop_device_attach_and_detach_change_events(loop_device):
    with HotplugMonitor(("block",)) as monitor:
        node = loop_device()

        def ours(event: DeviceEvent) -> bool:
            return event.sys_path == f"/sys/devices/virtual/block/{os.path.basename(node)}"

        attached = _wait_for(monitor.poll, ours, 1)
        subprocess.run(["losetup", "--detach", node], check=True, capture_output=True)
        detached = _wait_for(monitor.poll, ours, 1)
    # The kernel announces both as "change" of the loop disk (media appears, media goes).
    assert [(e.action, e.subsystem, e.kind, e.device_node) for e in attached] == [
        ("change", "block", "block", node)
    ]
    assert [(e.action, e.device_node) for e in detached] == [("change", node)]


@pytest.mark.root
def test_thread_delivers_events_and_stops_cleanly(veth_names):
    a, b = veth_names
    fds_before, threads_before = _open_fds(), set(threading.enumerate())
    got: list[DeviceEvent] = []
    both_seen = threading.Event()

    def on_event(event: DeviceEvent) -> None:
        if event.sys_path.rsplit("/", 1)[-1] in veth_names:
            got.append(event)
            if len(got) == 2:
                both_seen.set()
        raise RuntimeError("a failing callback must not end the thread")

    monitor = HotplugMonitor(("net",))
    try:
        monitor.start(on_event)
        with pytest.raises(Conflict):
            monitor.poll(0)
        with pytest.raises(Conflict):
            monitor.start(on_event)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        assert both_seen.wait(EVENT_WAIT_S), f"saw only {got}"
    finally:
        monitor.stop()
    assert sorted(e.sys_path for e in got) == [
        f"/sys/devices/virtual/net/{a}",
        f"/sys/devices/virtual/net/{b}",
    ]
    assert monitor.closed
    assert not set(threading.enumerate()) - threads_before  # an earlier test's thread may end meanwhile
    assert not _leaked(fds_before)


@pytest.mark.root
def test_close_wakes_a_reader_blocked_in_another_thread():
    fds_before = _open_fds()
    monitor = HotplugMonitor(("net",))
    results: list[object] = []
    reader = threading.Thread(target=lambda: results.extend(monitor))
    reader.start()
    monitor.close()
    reader.join(EVENT_WAIT_S)
    assert not reader.is_alive()
    assert monitor.poll(0) is None
    assert not _leaked(fds_before)


@pytest.mark.root
def test_many_monitors_leak_no_descriptors():
    fds_before = _open_fds()
    for _ in range(50):
        with HotplugMonitor(("net", "block")) as monitor:
            monitor.poll(0)
    assert not _leaked(fds_before)
