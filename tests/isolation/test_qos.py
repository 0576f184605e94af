from __future__ import annotations

import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from nodeagent.errors import InvalidRequest, KernelError
from nodeagent.isolation.qos import (
    QosDefaults,
    cpu_idle_supported,
    cpus_to_shares,
    io_weight_to_blkio,
    qos_parameters,
    quota_us,
    sched_idle_supported,
    set_sched_idle,
    suppressed,
)

GiB = 1 << 30


@pytest.mark.parametrize(
    ("qos", "cpus", "memory", "cpu_idle", "expected"),
    [
        pytest.param(
            "guaranteed",
            4,
            8 * GiB,
            True,
            {
                "cpu_weight": 400,
                "cpu_shares": 4096,
                "cpu_quota_us": None,
                "cpu_idle": False,
                "sched_idle": False,
                "memory_max": 8 * GiB,
                "memory_high": None,
                "memory_swap_max": 0,
                "io_weight": 200,
                "blkio_weight": 1000,
                "oom_score_adj": -997,
            },
            id="guaranteed-4cpu-no-quota-memory-max-is-request",
        ),
        pytest.param(
            "burstable",
            0.5,
            2 * GiB,
            True,
            {
                "cpu_weight": 50,
                "cpu_shares": 512,
                "cpu_quota_us": 50_000,
                "cpu_period_us": 100_000,
                "cpu_idle": False,
                "sched_idle": False,
                "memory_max": 2 * GiB,
                "memory_high": None,
                "memory_swap_max": 0,
                "io_weight": 100,
                "blkio_weight": 500,
                "oom_score_adj": 500,
            },
            id="burstable-half-cpu-quota-50ms",
        ),
        pytest.param(
            "burstable",
            2.25,
            GiB,
            False,
            {"cpu_weight": 225, "cpu_shares": 2304, "cpu_quota_us": 225_000},
            id="burstable-fractional-above-one",
        ),
        pytest.param(
            "burstable",
            None,
            GiB,
            False,
            {"cpu_weight": 100, "cpu_shares": 1024, "cpu_quota_us": None},
            id="burstable-without-cpus-default-weight-no-quota",
        ),
        pytest.param(
            "burstable",
            0.001,
            GiB,
            False,
            {"cpu_shares": 2, "cpu_weight": 1, "cpu_quota_us": 1000},
            id="burstable-tiny-clamped-to-kernel-minimums",
        ),
        pytest.param(
            "best-effort",
            None,
            4 * GiB,
            True,
            {
                "cpu_weight": 1,
                "cpu_shares": 2,
                "cpu_quota_us": None,
                "cpu_idle": True,
                "sched_idle": False,
                "memory_high": 4 * GiB,
                "memory_max": 8 * GiB,
                "memory_swap_max": None,
                "io_weight": 1,
                "blkio_weight": 10,
                "oom_score_adj": 1000,
            },
            id="best-effort-cpu-idle-memory-high-soft",
        ),
        pytest.param(
            "best-effort",
            3,
            None,
            False,
            {"cpu_weight": 1, "cpu_idle": False, "sched_idle": True, "memory_high": None, "memory_max": None},
            id="best-effort-without-cpu-idle-falls-back-to-sched-idle",
        ),
    ],
)
def test_class_parameters(
    qos: str, cpus: float | None, memory: int | None, cpu_idle: bool, expected: dict[str, Any]
) -> None:
    params = asdict(qos_parameters(qos, cpus=cpus, memory_bytes=memory, cpu_idle_available=cpu_idle))
    assert params["qos"] == qos
    assert params["pids_max"] == 4096
    assert {key: params[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("qos", "cpus", "memory", "message"),
    [
        pytest.param("platinum", 1, GiB, "unknown QoS class 'platinum'", id="unknown-class"),
        pytest.param("guaranteed", 1.5, GiB, "positive integer", id="guaranteed-fractional"),
        pytest.param("guaranteed", None, GiB, "positive integer", id="guaranteed-no-cpus"),
        pytest.param("guaranteed", 0, GiB, "positive integer", id="guaranteed-zero-cpus"),
        pytest.param("guaranteed", 2, None, "give resources.memory", id="guaranteed-no-memory"),
        pytest.param("burstable", 1, 0, "give resources.memory", id="burstable-zero-memory"),
        pytest.param("burstable", 0, GiB, r"positive \(fractional\)", id="burstable-zero-cpus"),
        pytest.param("burstable", -1, GiB, "cannot be negative", id="negative-cpus"),
        pytest.param("best-effort", None, -5, "cannot be negative", id="negative-memory"),
    ],
)
def test_requests_that_do_not_fit_their_class(
    qos: str, cpus: float | None, memory: int | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        qos_parameters(qos, cpus=cpus, memory_bytes=memory, cpu_idle_available=True)


@pytest.mark.parametrize(
    ("machine", "memory", "expected"),
    [
        pytest.param(None, GiB, 500, id="unknown-machine"),
        pytest.param(16 * GiB, 4 * GiB, 750, id="quarter-of-machine"),
        pytest.param(16 * GiB, 16 * GiB, 2, id="whole-machine-still-above-guaranteed"),
        pytest.param(16 * GiB, 1, 999, id="tiny-still-below-best-effort"),
    ],
)
def test_burstable_oom_score_follows_reserved_share(machine: int | None, memory: int, expected: int) -> None:
    params = qos_parameters(
        "burstable", cpus=1, memory_bytes=memory, cpu_idle_available=False, machine_memory_bytes=machine
    )
    assert params.oom_score_adj == expected


def test_defaults_change_the_parameters() -> None:
    defaults = QosDefaults(
        cfs_period_us=50_000,
        pids_max=128,
        best_effort_memory_max_factor=None,
        disable_swap_for_online=False,
        io_weight_burstable=300,
    )
    burst = qos_parameters(
        "burstable", cpus=1.5, memory_bytes=GiB, cpu_idle_available=True, defaults=defaults
    )
    assert (burst.cpu_quota_us, burst.cpu_period_us, burst.pids_max) == (75_000, 50_000, 128)
    assert (burst.memory_swap_max, burst.io_weight, burst.blkio_weight) == (None, 300, 1000)
    best = qos_parameters(
        "best-effort", cpus=None, memory_bytes=GiB, cpu_idle_available=True, defaults=defaults
    )
    assert (best.memory_high, best.memory_max) == (GiB, None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        pytest.param("cfs_period_us", 999, "outside the kernel's range", id="period-too-short"),
        pytest.param("cfs_period_us", 1_000_001, "outside the kernel's range", id="period-too-long"),
        pytest.param("pids_max", 0, "at least 1", id="pids-zero"),
        pytest.param("io_weight_best_effort", 0, "outside 1..10000", id="io-weight-zero"),
        pytest.param("best_effort_memory_max_factor", 0.5, "memory.max >= memory.high", id="cap-below-high"),
        pytest.param("suppressed_cpus", 0, "positive", id="suppressed-zero"),
    ],
)
def test_bad_defaults_are_refused(field: str, value: float, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        QosDefaults(**{field: value})


def test_suppression_cuts_best_effort_quota_only() -> None:
    best = qos_parameters("best-effort", cpus=None, memory_bytes=GiB, cpu_idle_available=True)
    cut = suppressed(best)
    assert cut.cpu_quota_us == 1000
    assert cut.cpu_weight == best.cpu_weight
    assert suppressed(best, QosDefaults(suppressed_cpus=0.25)).cpu_quota_us == 25_000
    burst = qos_parameters("burstable", cpus=1, memory_bytes=GiB, cpu_idle_available=True)
    with pytest.raises(InvalidRequest, match="only best-effort"):
        suppressed(burst)


@pytest.mark.parametrize(
    ("cpus", "shares"),
    [(0.0, 2), (1, 1024), (0.25, 256), (1000, 262_144)],
    ids=["zero-clamped", "one", "quarter", "huge-clamped"],
)
def test_cpus_to_shares(cpus: float, shares: int) -> None:
    assert cpus_to_shares(cpus) == shares


@pytest.mark.parametrize(
    ("cpus", "period", "expected"),
    [(0.5, 100_000, 50_000), (0.001, 100_000, 1000), (4, 10_000, 40_000)],
    ids=["half", "below-kernel-minimum", "short-period"],
)
def test_quota(cpus: float, period: int, expected: int) -> None:
    assert quota_us(cpus, period) == expected


@pytest.mark.parametrize(("weight", "blkio"), [(1, 10), (100, 500), (200, 1000), (10_000, 1000)])
def test_io_weight_to_blkio(weight: int, blkio: int) -> None:
    assert io_weight_to_blkio(weight) == blkio


def test_cpu_idle_detected_from_cgroup_dir(tmp_path: Path) -> None:
    assert not cpu_idle_supported(tmp_path)
    (tmp_path / "cpu.idle").write_text("0\n")
    assert cpu_idle_supported(tmp_path)


def test_sched_idle_on_a_child_process() -> None:
    assert sched_idle_supported()
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert os.sched_getscheduler(child.pid) != os.SCHED_IDLE
        set_sched_idle(child.pid)
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
    finally:
        child.kill()
        child.wait()


def test_sched_idle_on_a_missing_process_is_a_kernel_error() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    with pytest.raises(KernelError, match=f"set SCHED_IDLE on pid {child.pid}"):
        set_sched_idle(child.pid)
