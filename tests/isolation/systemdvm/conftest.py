"""Tests that need systemd as PID 1 on a pure cgroup v2 host (the VM runner's ``--systemd`` mode,
which sets NODEAGENT_IN_SYSTEMD_VM=1); collected only there."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/systemdvm/" in str(item.path):
            item.add_marker(pytest.mark.cgroup2vm)
            item.add_marker(pytest.mark.root)
