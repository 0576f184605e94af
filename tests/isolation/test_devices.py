"""A slot's device allow-list: pure rule building, and resolving device paths on this host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.cgroups import DeviceRule
from nodeagent.devices.pci import DeviceNumber
from nodeagent.errors import InvalidRequest, NotFound
from nodeagent.isolation.devices import SAFE_DEVICES, device_rules, resolve_device_nodes, slot_device_rules
from nodeagent.isolation.slot_spec import IsolatorConfig, SlotIsolationSpec

GPU0 = DeviceNumber("c", 195, 0)
MIG_CAP = DeviceNumber("c", 237, 12)
FPGA = DeviceNumber("c", 508, 0)
DISK = DeviceNumber("b", 7, 1)


@pytest.mark.parametrize(
    ("nodes", "extra"),
    [
        pytest.param([], set(), id="safe-set-only"),
        pytest.param([GPU0, MIG_CAP], {"c 195:0 rwm", "c 237:12 rwm"}, id="gpu-and-mig-cap"),
        pytest.param([FPGA, DISK], {"c 508:0 rwm", "b 7:1 rwm"}, id="fpga-and-block"),
        pytest.param([GPU0, GPU0], {"c 195:0 rwm"}, id="duplicates-merge"),
        pytest.param([DeviceNumber("c", 1, 3)], set(), id="node-already-safe"),
    ],
)
def test_rules_are_the_safe_set_plus_each_node_read_write_and_mknod(
    nodes: list[DeviceNumber], extra: set[str]
) -> None:
    rules = device_rules(nodes)
    assert {str(r) for r in rules} == {str(r) for r in SAFE_DEVICES} | extra
    assert list(rules) == sorted(rules)


def test_safe_set_is_the_standard_devices_with_mknod_only_for_what_the_sandbox_makes() -> None:
    assert {str(r) for r in SAFE_DEVICES} == {
        "c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",  # null zero full random urandom
        "c 5:0 rwm", "c 5:2 rw",  # tty ptmx (a link to the private devpts' own)
        "c 136:* rw",  # pts (the private devpts makes its own)
    }  # fmt: skip


def test_custom_safe_set_replaces_the_default() -> None:
    assert device_rules([GPU0], safe=[DeviceRule("c", 1, 3, "rw")]) == (
        DeviceRule("c", 1, 3, "rw"),
        DeviceRule("c", 195, 0, "rwm"),
    )


def test_resolving_a_real_node_gives_its_numbers() -> None:
    st = os.stat("/dev/null")
    assert resolve_device_nodes("web", ["/dev/null"]) == (
        DeviceNumber("c", os.major(st.st_rdev), os.minor(st.st_rdev)),
    )


def test_a_missing_device_says_which_slot_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "nvidia9"
    with pytest.raises(NotFound, match=rf"slot web asks for device {missing}, which does not exist"):
        resolve_device_nodes("web", [str(missing)])


def test_a_regular_file_is_not_a_device(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(InvalidRequest, match="not a character or block device node"):
        resolve_device_nodes("web", [str(plain)])


def test_optional_nodes_are_taken_only_where_they_exist(tmp_path: Path) -> None:
    nodes = resolve_device_nodes("web", [], optional=["/dev/zero", str(tmp_path / "nvidia-uvm")])
    assert nodes == (DeviceNumber("c", 1, 5),)


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        pytest.param(False, {"c 1:3 rwm"}, id="no-gpu-no-control-nodes"),
        pytest.param(True, {"c 1:3 rwm", "c 1:7 rwm"}, id="gpu-adds-existing-control-nodes"),
    ],
)
def test_slot_rules_add_gpu_control_nodes_only_for_gpu_slots(
    tmp_path: Path, gpu: bool, expected: set[str]
) -> None:
    # /dev/full stands in for nvidiactl; the missing path for an absent nvidia-uvm.
    config = IsolatorConfig(safe_devices=(), gpu_control_nodes=("/dev/full", str(tmp_path / "nvidia-uvm")))
    spec = SlotIsolationSpec("web", "burstable", memory_bytes=1 << 20, device_paths=("/dev/null",), gpu=gpu)
    assert {str(r) for r in slot_device_rules(spec, config)} == expected


def test_relative_device_paths_are_refused_in_the_spec() -> None:
    with pytest.raises(InvalidRequest, match="not absolute"):
        SlotIsolationSpec("web", "burstable", memory_bytes=1 << 20, device_paths=("dev/null",))
