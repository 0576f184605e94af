"""The whole agent on a pure cgroup v2 kernel (collected only inside the VM, NODEAGENT_IN_CGROUP2_VM=1)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/v2vm/" in str(item.path):
            item.add_marker(pytest.mark.cgroup2vm)
            item.add_marker(pytest.mark.root)
