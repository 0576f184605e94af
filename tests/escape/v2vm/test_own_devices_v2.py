"""A default slot's own devices on a pure cgroup v2 kernel (the device cgroup is the slot's eBPF
program): the same scenario as on v1 (tests/escape/own_devices.py)."""

from __future__ import annotations

from pathlib import Path

from tests.escape.own_devices import own_devices_scenario


def test_a_default_slot_opens_its_own_root_only_nodes_and_nothing_else_on_cgroup_v2(tmp_path: Path) -> None:
    own_devices_scenario(tmp_path, "w")
