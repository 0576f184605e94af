"""PCI, FPGA and SR-IOV discovery on fake sysfs trees, and on this host's real /sys."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from nodeagent.devices.pci import (
    PciDevice,
    device_node_info,
    device_nodes_of,
    discover_fpgas,
    is_fpga_function,
    list_pci_devices,
    pci_parent,
)
from nodeagent.devices.topology import Fpga, Sriov
from nodeagent.errors import DiscoveryError, InvalidRequest, NotFound
from tests.devices import pci_trees as trees
from tests.trees import Link, Tree, write_tree


@pytest.fixture
def host(tmp_path: Path):
    """Write a (sysfs tree, dev tree) pair and return their roots."""

    def make(sys_tree: Tree, dev_tree: Tree | None = None) -> tuple[Path, Path]:
        sysfs = write_tree(tmp_path / "sys", sys_tree)
        dev = write_tree(tmp_path / "dev", dev_tree or {})
        return sysfs, dev

    return make


def _fpga(card, vendor, device, *, numa, nodes, driver, sriov=None, function=0):
    return {
        "id": card,
        "vendor": vendor,
        "device": device,
        "pci_bus_id": f"{card}.{function}",
        "numa": numa,
        "device_nodes": nodes,
        "driver": driver,
        "sriov": sriov,
    }


FPGA_CASES = [
    pytest.param(
        trees.ALVEO_PAIR_SYS,
        trees.ALVEO_PAIR_DEV,
        [
            _fpga(
                "0000:3b:00",
                "0x10ee",
                "0x5004",
                numa=0,
                nodes=["dri/card1", "dri/renderD128", "xclmgmt15104"],
                driver="xclmgmt,xocl",
            ),
            _fpga(
                "0000:d8:00",
                "0x10ee",
                "0x5004",
                numa=1,
                nodes=["dri/card2", "dri/renderD129", "xclmgmt55296"],
                driver="xclmgmt,xocl",
            ),
        ],
        id="two-alveo-u250",
    ),
    pytest.param(
        trees.INTEL_PAC_SYS,
        trees.INTEL_PAC_DEV,
        [
            _fpga(
                "0000:5e:00",
                "0x8086",
                "0x0b30",
                numa=0,
                nodes=["dfl-fme.0", "dfl-port.0"],
                driver="dfl-pci",
                sriov=Sriov(1, 0),
            ),
            _fpga(
                "0000:af:00",
                "0x8086",
                "0x0b2b",
                numa=1,
                nodes=["dfl-fme.1"],
                driver="dfl-pci",
                sriov=Sriov(1, 1),
            ),
        ],
        id="intel-pac-n3000-d5005",
    ),
    pytest.param(
        trees.CLASS_ONLY_SYS,
        {},
        [_fpga("0000:65:00", "0x1d0f", "0xcafe", numa=0, nodes=[], driver=None)],
        id="fpga-manager-class-only",
    ),
    pytest.param(trees.SRIOV_NIC_SYS, {}, [], id="sriov-nic-is-no-fpga"),
    pytest.param(trees.NO_ACCELERATORS_SYS, {"dri/card0": ""}, [], id="no-accelerators"),
]


@pytest.mark.parametrize(("sys_tree", "dev_tree", "expected"), FPGA_CASES)
def test_discover_fpgas(host, sys_tree, dev_tree, expected):
    sysfs, dev = host(sys_tree, dev_tree)
    want = tuple(
        Fpga(**{**e, "device_nodes": tuple(str(dev / n) for n in e["device_nodes"])}) for e in expected
    )
    assert discover_fpgas(sysfs, dev) == want


def test_fpga_nodes_are_only_those_present_under_dev_root(host):
    sysfs, dev = host(trees.ALVEO_PAIR_SYS, {"dri/renderD128": ""})
    first, second = discover_fpgas(sysfs, dev)
    assert first.device_nodes == (str(dev / "dri/renderD128"),)
    assert second.device_nodes == ()


def test_sriov_nic_physical_function(host):
    sysfs, _ = host(trees.SRIOV_NIC_SYS)
    pf = {d.bus_id: d for d in list_pci_devices(sysfs)}["0000:3b:00.0"]
    assert pf == PciDevice(
        bus_id="0000:3b:00.0",
        vendor="0x15b3",
        device="0x1017",
        class_code="0x020000",
        subsystem_vendor=None,
        subsystem_device=None,
        numa=0,
        driver="mlx5_core",
        iommu_group=40,
        sriov=Sriov(total_vfs=64, num_vfs=4),
        physfn=None,
        virtfns=("0000:3b:00.2", "0000:3b:00.3", "0000:3b:00.4", "0000:3b:00.5"),
    )
    assert not pf.is_virtfn


def test_sriov_virtual_functions_name_their_parent(host):
    sysfs, _ = host(trees.SRIOV_NIC_SYS)
    vfs = [d for d in list_pci_devices(sysfs) if d.is_virtfn]
    assert [(v.bus_id, v.device, v.physfn, v.iommu_group, v.sriov) for v in vfs] == [
        ("0000:3b:00.2", "0x1018", "0000:3b:00.0", 41, None),
        ("0000:3b:00.3", "0x1018", "0000:3b:00.0", 42, None),
        ("0000:3b:00.4", "0x1018", "0000:3b:00.0", 43, None),
        ("0000:3b:00.5", "0x1018", "0000:3b:00.0", 44, None),
    ]


def test_virtfns_are_in_vf_order_not_name_order(host):
    vfs = [f"0000:3b:{1 + i // 8:02x}.{i % 8}" for i in range(12)]
    pf = trees.pci_function("0000:3b:00.0", "0x8086", "0x1572", "0x020000", extra=trees.sriov_pf(32, vfs))
    sysfs, _ = host(pf)
    (device,) = list_pci_devices(sysfs)
    assert device.virtfns == tuple(vfs)  # virtfn10 after virtfn9, not after virtfn1
    assert device.sriov == Sriov(total_vfs=32, num_vfs=12)


@pytest.mark.parametrize(
    ("sys_tree", "bus_ids"),
    [
        pytest.param(trees.NO_ACCELERATORS_SYS, ["0000:00:00.0", "0000:00:03.0", "0000:03:00.0"], id="plain"),
        pytest.param(
            trees.SRIOV_NIC_SYS,
            ["0000:00:00.0", "0000:3b:00.0", "0000:3b:00.2", "0000:3b:00.3", "0000:3b:00.4", "0000:3b:00.5"],
            id="sriov",
        ),
        pytest.param({"class/": ""}, [], id="no-pci-bus"),
    ],
)
def test_list_pci_devices_lists_every_function(host, sys_tree, bus_ids):
    sysfs, _ = host(sys_tree)
    assert [d.bus_id for d in list_pci_devices(sysfs)] == bus_ids


@pytest.mark.parametrize(
    ("numa_text", "expected"),
    [
        pytest.param("-1", None, id="unknown"),
        pytest.param("1", 1, id="node1"),
        pytest.param(None, None, id="absent"),
    ],
)
def test_numa_node(host, numa_text, expected):
    tree = dict(trees.pci_function("0000:01:00.0", "0x10ee", "0x5005", "0x058000"))
    base = "devices/pci0000:01/0000:01:00.0/numa_node"
    if numa_text is None:
        del tree[base]
    else:
        tree[base] = numa_text + "\n"
    sysfs, _ = host(tree)
    (device,) = list_pci_devices(sysfs)
    assert device.numa == expected


def test_device_that_vanished_during_the_scan_is_left_out(host):
    tree = {
        **trees.NO_ACCELERATORS_SYS,
        "bus/pci/devices/0000:99:00.0": Link("../../../devices/pci0000:99/gone"),
    }
    sysfs, _ = host(tree)
    assert "0000:99:00.0" not in [d.bus_id for d in list_pci_devices(sysfs)]


PF = "devices/pci0000:3b/0000:3b:00.0"


@pytest.mark.parametrize(
    ("change", "bad_path"),
    [
        pytest.param({f"{PF}/vendor": "banana\n"}, f"{PF}/vendor", id="vendor-not-hex"),
        pytest.param({f"{PF}/device": ""}, f"{PF}/device", id="device-empty"),
        pytest.param({f"{PF}/class": None}, f"{PF}/class", id="class-missing"),
        pytest.param({f"{PF}/numa_node": "zero\n"}, f"{PF}/numa_node", id="numa-not-int"),
        pytest.param({f"{PF}/sriov_totalvfs": "lots\n"}, f"{PF}/sriov_totalvfs", id="totalvfs-not-int"),
        pytest.param({f"{PF}/sriov_numvfs": None}, f"{PF}/sriov_numvfs", id="numvfs-missing"),
        pytest.param({f"{PF}/iommu_group": "40\n"}, f"{PF}/iommu_group", id="iommu-group-not-a-link"),
        pytest.param({f"{PF}/driver": "mlx5\n"}, f"{PF}/driver", id="driver-not-a-link"),
    ],
)
def test_garbage_raises_discovery_error_naming_the_path(host, change, bad_path):
    tree = {k: v for k, v in {**trees.SRIOV_NIC_SYS, **change}.items() if v is not None}
    sysfs, dev = host(tree)
    for read in (lambda: list_pci_devices(sysfs), lambda: discover_fpgas(sysfs, dev)):
        with pytest.raises(DiscoveryError) as info:
            read()
        # the message names the file through the bus/pci/devices link
        assert bad_path.rpartition("/")[2] in str(info.value)
        assert "0000:3b:00.0" in str(info.value)


def test_entry_not_named_like_a_pci_address_is_an_error(host):
    sysfs, _ = host({**trees.NO_ACCELERATORS_SYS, "bus/pci/devices/garbage": Link("../../../devices/x")})
    (sysfs / "devices/x").mkdir()
    with pytest.raises(DiscoveryError, match="garbage"):
        list_pci_devices(sysfs)


def test_device_nodes_skip_child_functions_behind_a_bridge(host):
    bridge = trees.pci_function(
        "0000:00:01.0",
        "0x8086",
        "0x2030",
        "0x060400",
        extra=trees.below("0000:01:00.0/drm/renderD128", trees.char_device("dri/renderD128", 226, 128)),
    )
    sysfs, dev = host(bridge, {"dri/renderD128": ""})
    assert device_nodes_of("0000:00:01.0", sysfs, dev) == ()


@pytest.mark.parametrize(
    ("vendor", "device", "driver", "expected"),
    [
        pytest.param("0x10ee", "0x5005", None, True, id="xilinx-any"),
        pytest.param("0x1172", "0x0001", None, True, id="altera-any"),
        pytest.param("0x8086", "0x0b30", None, True, id="intel-n3000"),
        pytest.param("0x8086", "0xbccf", None, True, id="intel-dfl-vf"),
        pytest.param("0x1c2c", "0x1000", None, True, id="silicom-n5010"),
        pytest.param("0x8086", "0x0d57", None, False, id="intel-host-bridge"),
        pytest.param("0x1c2c", "0x0001", None, False, id="silicom-other"),
        pytest.param("0x1234", "0x0001", "xocl", True, id="by-driver"),
        pytest.param("0x10de", "0x2330", "nvidia", False, id="nvidia-gpu"),
    ],
)
def test_is_fpga_function(vendor, device, driver, expected):
    assert is_fpga_function(vendor, device, driver) is expected


@pytest.mark.parametrize(
    ("sys_path", "expected"),
    [
        pytest.param(
            "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1/drm/renderD128", "0000:3b:00.1", id="drm"
        ),
        pytest.param("/sys/devices/pci0000:00/0000:00:03.0", "0000:00:03.0", id="itself"),
        pytest.param("/sys/devices/virtual/net/veth0", None, id="virtual"),
    ],
)
def test_pci_parent(sys_path, expected):
    assert pci_parent(sys_path) == expected


# --------------------------------------------------------------------------- device nodes


def test_device_node_info_of_dev_null():
    assert device_node_info("/dev/null") == ("c", 1, 3)


@pytest.mark.root
@pytest.mark.parametrize(
    ("kind", "mode", "numbers"),
    [
        pytest.param("c", stat.S_IFCHR, (241, 7), id="char"),
        pytest.param("b", stat.S_IFBLK, (7, 250), id="block"),
    ],
)
def test_device_node_info_reads_what_mknod_made(tmp_path, kind, mode, numbers):
    node = tmp_path / "node"
    os.mknod(node, mode | 0o600, os.makedev(*numbers))
    assert device_node_info(node) == (kind, *numbers)


def test_device_node_info_rejects_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequest, match="not a character or block device"):
        device_node_info(tmp_path / "file")


def test_device_node_info_of_a_missing_path(tmp_path):
    with pytest.raises(NotFound, match="does not exist"):
        device_node_info(tmp_path / "nothing")


# --------------------------------------------------------------------------- this host


@pytest.mark.kernel
def test_real_host_agrees_with_udev_and_lspci():
    if not Path("/sys/bus/pci/devices").is_dir():
        pytest.skip("this host has no PCI bus in sysfs")
    import pyudev

    ours = {d.bus_id: d for d in list_pci_devices()}
    udev = {
        dev.sys_name: (dev.properties.get("PCI_ID", "").lower(), dev.properties.get("DRIVER"))
        for dev in pyudev.Context().list_devices(subsystem="pci")
    }
    assert {b: (f"{d.vendor[2:]}:{d.device[2:]}", d.driver) for b, d in ours.items()} == udev
    if shutil.which("lspci"):
        out = subprocess.run(["lspci", "-Dn"], capture_output=True, text=True, check=True).stdout
        seen = dict(re.findall(r"^(\S+) [0-9a-f]{4}: ([0-9a-f]{4}:[0-9a-f]{4})", out, re.MULTILINE))
        assert {b: f"{d.vendor[2:]}:{d.device[2:]}" for b, d in ours.items()} == seen
    fpgas = discover_fpgas()
    assert {f.pci_bus_id for f in fpgas} <= set(ours)
