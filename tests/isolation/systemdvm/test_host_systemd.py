"""Host partitioning where systemd owns the cgroup tree: the root's other children (system.slice,
init.scope, ...) are confined through ``AllowedCPUs=`` so that systemd keeps it across a
daemon-reload, a busy service never runs on the exclusive CPU, and everything is put back.

Runs in the VM runner's --systemd mode (systemd is PID 1; this test runs as a delegated service in
system.slice); the whole VM is thrown away afterwards, and the test still puts back what it changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import detect
from nodeagent.cpulist import parse_cpulist
from nodeagent.isolation.isolator import SlotIsolator
from nodeagent.isolation.partitioning import RECORD_NAME, host_partitioner
from nodeagent.isolation.slot_spec import IsolatorConfig
from tests.isolation.specs import guaranteed

UNIT = f"natest-busy-{os.getpid()}"


def systemctl(*args: str) -> str:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=True).stdout.strip()


def allowed(unit: str) -> frozenset[int]:
    return parse_cpulist(systemctl("show", "-p", "AllowedCPUs", "--value", unit))


def last_cpu(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[36])


@pytest.fixture
def busy_service() -> Iterator[int]:
    """A CPU-bound transient service in system.slice; its main pid."""
    if not Path("/run/systemd/system").is_dir():
        pytest.skip("needs systemd as PID 1")
    subprocess.run(
        ["systemd-run", "--unit", UNIT, "--slice", "system.slice", "-p", "Nice=19", sys.executable, "-c",
         "while True:\n    pass\n"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    try:
        pid = int(systemctl("show", "-p", "MainPID", "--value", UNIT))
        assert pid > 0
        yield pid
    finally:
        subprocess.run(["systemctl", "stop", UNIT], check=False, capture_output=True)


def test_systemd_units_are_confined_through_allowed_cpus_and_put_back(
    tmp_path: Path, busy_service: int
) -> None:
    host = detect()
    online = frozenset(os.sched_getaffinity(1))
    if not {0, 1} <= online:
        pytest.skip("needs CPUs 0 and 1")
    isolator = SlotIsolator(host, IsolatorConfig(cgroup_parent=f"natest{os.getpid()}.slice"))
    p = host_partitioner(host, state_dir=tmp_path, cgroup_parent=isolator.config.cgroup_parent)
    before = {unit: allowed(unit) for unit in ("system.slice", "init.scope")}
    try:
        isolator.apply(guaranteed("g", frozenset({1})))
        report = p.apply(frozenset({1}))
        assert report.moved.get("cgroup", 0) >= 2, report.to_dict()
        assert allowed("system.slice") == {0}
        assert allowed("init.scope") == {0}
        assert os.sched_getaffinity(busy_service) == {0}
        assert os.sched_getaffinity(1) == {0}  # PID 1, through init.scope
        # systemd re-applies unit settings on a reload: ours are its own now, so they stay.
        systemctl("daemon-reload")
        assert Path("/sys/fs/cgroup/system.slice/cpuset.cpus").read_text().strip() == "0"
        seen = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            seen.add(last_cpu(busy_service))
            time.sleep(0.001)
        assert 1 not in seen
        p.restore()
        assert {unit: allowed(unit) for unit in before} == before
        assert os.sched_getaffinity(busy_service) == online
        assert not (tmp_path / RECORD_NAME).exists()
    finally:
        isolator.remove_all()
        if (tmp_path / RECORD_NAME).exists():
            p.restore()
