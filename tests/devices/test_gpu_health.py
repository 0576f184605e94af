"""GPU health from NVML events, driven by the fake pynvml."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pynvml
import pytest

from nodeagent.devices.gpu import GpuEvent, NvmlBackend
from nodeagent.devices.gpu_health import (
    DEFAULT_IGNORED_XIDS,
    GpuHealth,
    GpuHealthMonitor,
    GpuHealthThread,
)
from nodeagent.devices.topology import Gpu
from nodeagent.errors import DiscoveryError
from tests.fakes import fake_nvml
from tests.fakes.fake_nvml import FakeHost, FakeNvml


@pytest.fixture
def started() -> Iterator[Callable[..., tuple[GpuHealthMonitor, FakeNvml]]]:
    """Builds a started monitor over a fake host; stops it and checks NVML is released afterwards."""
    made: list[tuple[GpuHealthMonitor, FakeNvml]] = []

    def make(host: FakeHost | None = None, **options: object) -> tuple[GpuHealthMonitor, FakeNvml]:
        nvml = FakeNvml(host or fake_nvml.h100_8x_mixed_mig())
        monitor = GpuHealthMonitor(NvmlBackend(nvml), **options)  # type: ignore[arg-type]
        monitor.start()
        made.append((monitor, nvml))
        return monitor, nvml

    yield make
    for monitor, nvml in made:
        monitor.stop()
        assert nvml.open_event_sets == 0
        assert not nvml.initialised


def healthy_map(monitor: GpuHealthMonitor) -> dict[int, bool | None]:
    return {i: h.healthy for i, h in monitor.health().items()}


def test_start_watches_every_gpu(started) -> None:
    monitor, nvml = started()
    assert monitor.available
    assert healthy_map(monitor) == dict.fromkeys(range(8), True)
    assert nvml.calls.count("nvmlDeviceRegisterEvents") == 8


@pytest.mark.parametrize(
    ("xid", "ignored", "healthy", "events"),
    [
        pytest.param(79, DEFAULT_IGNORED_XIDS, False, ("xid 79",), id="79-fallen-off-bus-is-fatal"),
        pytest.param(48, DEFAULT_IGNORED_XIDS, False, ("xid 48",), id="48-dbe-is-fatal"),
        pytest.param(94, DEFAULT_IGNORED_XIDS, False, ("xid 94",), id="94-contained-ecc"),
        pytest.param(13, DEFAULT_IGNORED_XIDS, True, (), id="13-app-error-ignored"),
        pytest.param(31, DEFAULT_IGNORED_XIDS, True, (), id="31-page-fault-ignored"),
        pytest.param(43, DEFAULT_IGNORED_XIDS, True, (), id="43-ignored"),
        pytest.param(45, DEFAULT_IGNORED_XIDS, True, (), id="45-ignored"),
        pytest.param(68, DEFAULT_IGNORED_XIDS, True, (), id="68-ignored"),
        pytest.param(109, DEFAULT_IGNORED_XIDS, True, (), id="109-ignored"),
        pytest.param(79, {79}, True, (), id="configured-to-ignore-79"),
        pytest.param(13, set(), False, ("xid 13",), id="configured-to-ignore-nothing"),
    ],
)
def test_xid_marks_gpu_unhealthy_unless_ignored(
    started, xid: int, ignored: set[int], healthy: bool, events: tuple[str, ...]
) -> None:
    monitor, nvml = started(ignored_xids=ignored)
    nvml.inject_xid(3, xid)

    arrived = monitor.poll_once(1000)

    assert [(e.index, e.kind, e.xid) for e in arrived] == [(3, "xid", xid)]
    health = monitor.health()[3]
    assert (health.healthy, health.events) == (healthy, events)
    assert health.ignored_events == (0 if events else 1)
    assert all(monitor.health()[i].healthy for i in range(8) if i != 3)


@pytest.mark.parametrize(
    ("double_bit", "healthy", "events"),
    [
        pytest.param(True, False, ("ecc double-bit error",), id="double-bit-is-fatal"),
        pytest.param(False, True, (), id="single-bit-is-corrected"),
    ],
)
def test_ecc_events(started, double_bit: bool, healthy: bool, events: tuple[str, ...]) -> None:
    monitor, nvml = started()
    nvml.inject_ecc(6, double_bit=double_bit)
    monitor.poll_once(1000)
    assert (monitor.health()[6].healthy, monitor.health()[6].events) == (healthy, events)


def test_uncorrected_ecc_errors_before_start_mark_unhealthy(started) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    host.gpus[1].volatile_uncorrected_ecc = 2
    monitor, _ = started(host)
    assert monitor.health()[1].healthy is False
    assert monitor.health()[1].events == (
        "ecc double-bit error (2 uncorrected ECC errors since the driver loaded)",
    )
    assert monitor.health()[0].healthy is True


def test_xid_on_a_mig_instance_names_it(started) -> None:
    monitor, nvml = started()
    nvml.inject_xid(2, 79, gi=9, ci=0)
    monitor.poll_once(1000)
    assert monitor.health()[2].events == ("xid 79 on MIG gi 9 ci 0",)
    assert monitor.health()[2].healthy is False


def test_repeated_fault_is_listed_once(started) -> None:
    monitor, nvml = started()
    for _ in range(3):
        nvml.inject_xid(0, 79)
    nvml.inject_xid(0, 48)
    for _ in range(4):
        monitor.poll_once(1000)
    assert monitor.health()[0].events == ("xid 79", "xid 48")


def test_gpu_lost_while_watching(started) -> None:
    monitor, nvml = started()
    nvml.lose_gpu(4)
    arrived = monitor.poll_once(1000)
    assert [(e.index, e.kind) for e in arrived] == [(4, "lost")]
    assert healthy_map(monitor) == {i: i != 4 for i in range(8)}
    assert monitor.health()[4].events == ("gpu lost",)


def test_gpu_lost_before_start(started) -> None:
    host = fake_nvml.h100_8x_mixed_mig()
    host.gpus[0].lost = True
    monitor, _ = started(host)
    assert monitor.health()[0] == GpuHealth(0, None, False, ("gpu lost",))
    assert monitor.health()[1].healthy is True


def test_timeout_changes_nothing(started) -> None:
    monitor, _ = started()
    before = monitor.health()
    assert monitor.poll_once(0) == ()
    assert monitor.health() == before


def test_gpu_whose_events_cannot_be_watched_has_unknown_health(started) -> None:
    class NoEvents(FakeNvml):
        def nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monitor = GpuHealthMonitor(NvmlBackend(NoEvents(fake_nvml.a100_2x())))
    monitor.start()
    try:
        assert healthy_map(monitor) == {0: None, 1: None}
    finally:
        monitor.stop()


def test_events_for_unsupported_types_are_not_requested(started) -> None:
    # An L4 has no ECC events; asking for them would fail registration on a real driver.
    monitor, _ = started(fake_nvml.l4_1x())
    assert healthy_map(monitor) == {0: True}


def test_no_driver_leaves_monitor_unavailable_without_error() -> None:
    nvml = FakeNvml(fake_nvml.no_driver("driver_not_loaded"))
    monitor = GpuHealthMonitor(NvmlBackend(nvml))
    monitor.start()
    assert not monitor.available
    assert "kernel driver is not loaded" in monitor.status_message
    assert monitor.poll_once(1000) == ()
    monitor.stop()


def test_wait_failure_is_reported_not_judged() -> None:
    class BrokenWait(FakeNvml):
        def nvmlEventSetWait_v2(self, event_set, timeoutms):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monitor = GpuHealthMonitor(NvmlBackend(BrokenWait(fake_nvml.a100_2x())))
    monitor.start()
    try:
        with pytest.raises(DiscoveryError, match="waiting for GPU events failed"):
            monitor.poll_once(10)
        assert healthy_map(monitor) == {0: True, 1: True}
        assert "Unknown Error" in monitor.status_message
    finally:
        monitor.stop()


def test_apply_to_fills_gpu_health(started) -> None:
    monitor, nvml = started(fake_nvml.a100_2x())
    nvml.inject_xid(1, 79)
    monitor.poll_once(1000)
    host = nvml.host
    gpus = [Gpu(g.index, g.uuid, g.model.name, f"0000:0{g.index}:00.0", 0, 0, None) for g in host.gpus]
    stranger = Gpu(5, "GPU-other", None, "0000:99:00.0", None, None, None)

    merged = monitor.apply_to([*gpus, stranger])

    assert [(g.healthy, g.health_events) for g in merged] == [(True, ()), (False, ("xid 79",)), (None, ())]


def test_on_change_sees_transitions_only(started) -> None:
    changes: list[GpuHealth] = []
    monitor, nvml = started(fake_nvml.a100_2x(), on_change=changes.append)
    assert [(h.index, h.healthy) for h in changes] == [(0, True), (1, True)]
    nvml.inject_xid(0, 13)  # ignored: counted, not a change of health
    nvml.inject_xid(0, 79)
    monitor.poll_once(1000)
    monitor.poll_once(1000)
    assert [(h.index, h.healthy, h.events) for h in changes[2:]] == [(0, False, ("xid 79",))]
    assert changes[-1].ignored_events == 1


# --------------------------------------------------------------------------- the thread runner


def test_thread_marks_gpu_unhealthy_and_stops_cleanly() -> None:
    nvml = FakeNvml(fake_nvml.h100_8x_mixed_mig())
    unhealthy = threading.Event()

    def on_change(h: GpuHealth) -> None:
        if h.healthy is False:
            unhealthy.set()

    runner = GpuHealthThread(GpuHealthMonitor(NvmlBackend(nvml), on_change=on_change), timeout_ms=50)
    runner.start()
    try:
        assert runner.running
        nvml.inject_xid(7, 79)
        assert unhealthy.wait(10), "the runner never applied the event"
        assert runner.monitor.health()[7].events == ("xid 79",)
    finally:
        runner.stop()
    assert not runner.running
    assert nvml.open_event_sets == 0
    assert not nvml.initialised


def test_thread_does_not_start_without_driver() -> None:
    runner = GpuHealthThread(GpuHealthMonitor(NvmlBackend(FakeNvml(fake_nvml.no_driver()))))
    runner.start()
    assert not runner.running
    runner.stop()


def test_event_kinds_from_the_backend_are_the_documented_ones(started) -> None:
    monitor, nvml = started(fake_nvml.a100_2x())
    nvml.inject_ecc(0, double_bit=False)
    (event,) = monitor.poll_once(1000)
    assert event == GpuEvent(0, nvml.host.gpus[0].uuid, "ecc_sbe")
    assert set(nvml.calls) - set(dir(pynvml)) == set()
