"""The tests in ``vm/`` need a machine whose PID 1 is systemd on pure cgroup v2 (run-tests starts one
with ``cgroup2-vm --systemd``); they are collected only when NODEAGENT_IN_SYSTEMD_VM=1 (set inside
that VM), so ordinary runs never see them."""

from __future__ import annotations

import os

import pytest

collect_ignore = [] if os.environ.get("NODEAGENT_IN_SYSTEMD_VM") == "1" else ["vm"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/systemd/vm/" in str(item.path):
            item.add_marker(pytest.mark.systemdvm)
            item.add_marker(pytest.mark.root)
