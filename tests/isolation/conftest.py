"""Isolation tests. Those in ``v2vm/`` need a pure cgroup v2 kernel; they are collected only when
NODEAGENT_IN_CGROUP2_VM=1 (set inside the VM that runs them), so ordinary runs never see them;
those in ``systemdvm/`` also need systemd as PID 1 (NODEAGENT_IN_SYSTEMD_VM=1)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]
# systemdvm/ needs systemd as PID 1 (the runner's --systemd mode sets NODEAGENT_IN_SYSTEMD_VM=1).
if os.environ.get("NODEAGENT_IN_SYSTEMD_VM") != "1":
    collect_ignore.append("systemdvm")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; killed and reaped at the end, also when the test fails."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
