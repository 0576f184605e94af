"""A default slot's own devices on this host's kernel (cgroup v1 or hybrid): see own_devices.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.escape.own_devices import own_devices_scenario

pytestmark = pytest.mark.root


def test_a_default_slot_opens_its_own_root_only_nodes_and_nothing_else(tmp_path: Path) -> None:
    own_devices_scenario(tmp_path, "d")
