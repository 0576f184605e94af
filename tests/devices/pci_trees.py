"""Fake sysfs and /dev trees for PCI, FPGA and SR-IOV discovery, laid out as the kernel does.

A tree is a ``{relpath: content}`` map: a string is a file, a :class:`Link` a symlink (relative
target, as sysfs writes them), a path ending in "/" an empty directory. PCI functions live under
``devices/pci0000:XX/`` and are linked from ``bus/pci/devices/``; class devices such as
``class/fpga_region/region0`` link into the PCI function's directory, like on a real host.
A /dev tree holds plain files: discovery only checks that a node exists.
"""

from __future__ import annotations

from collections.abc import Mapping

from tests.trees import Link, Tree


def pci_function(
    bus_id: str,
    vendor: str,
    device: str,
    class_code: str,
    *,
    numa: int = -1,
    driver: str | None = None,
    iommu_group: int | None = None,
    subsystem: tuple[str, str] | None = None,
    extra: Mapping[str, str | Link] | None = None,
) -> dict[str, str | Link]:
    """One PCI function; ``extra`` paths are relative to its directory."""
    root_bus = f"pci{bus_id[:7]}"
    base = f"devices/{root_bus}/{bus_id}"
    tree: dict[str, str | Link] = {
        f"bus/pci/devices/{bus_id}": Link(f"../../../{base}"),
        f"{base}/vendor": vendor + "\n",
        f"{base}/device": device + "\n",
        f"{base}/class": class_code + "\n",
        f"{base}/numa_node": f"{numa}\n",
        f"{base}/uevent": f"PCI_SLOT_NAME={bus_id}\n",
        f"{base}/subsystem": Link("../../../bus/pci"),
    }
    if subsystem is not None:
        tree[f"{base}/subsystem_vendor"] = subsystem[0] + "\n"
        tree[f"{base}/subsystem_device"] = subsystem[1] + "\n"
    if driver is not None:
        tree[f"bus/pci/drivers/{driver}/"] = ""
        tree[f"{base}/driver"] = Link(f"../../../bus/pci/drivers/{driver}")
    if iommu_group is not None:
        tree[f"kernel/iommu_groups/{iommu_group}/"] = ""
        tree[f"{base}/iommu_group"] = Link(f"../../../kernel/iommu_groups/{iommu_group}")
    for rel, content in (extra or {}).items():
        tree[f"{base}/{rel}"] = content
    return tree


def char_device(devname: str, major: int, minor: int) -> dict[str, str]:
    """The ``dev`` and ``uevent`` files of a class device with a node, relative to its directory."""
    return {"dev": f"{major}:{minor}\n", "uevent": f"MAJOR={major}\nMINOR={minor}\nDEVNAME={devname}\n"}


def below(prefix: str, files: Mapping[str, str | Link]) -> dict[str, str | Link]:
    return {f"{prefix}/{rel}": content for rel, content in files.items()}


def sriov_pf(total_vfs: int, vf_bus_ids: list[str]) -> dict[str, str | Link]:
    files: dict[str, str | Link] = {
        "sriov_totalvfs": f"{total_vfs}\n",
        "sriov_numvfs": f"{len(vf_bus_ids)}\n",
    }
    for index, vf in enumerate(vf_bus_ids):
        files[f"virtfn{index}"] = Link(f"../{vf}")
    return files


def merge(*trees: Tree) -> dict[str, str | Link]:
    out: dict[str, str | Link] = {}
    for tree in trees:
        out.update(tree)
    return out


# --------------------------------------------------------------------------- common functions

INTEL_HOST_BRIDGE = pci_function("0000:00:00.0", "0x8086", "0x2020", "0x060000", numa=0)
VIRTIO_NET = pci_function(
    "0000:00:03.0",
    "0x1af4",
    "0x1041",
    "0x020000",
    driver="virtio-pci",
    extra=below("virtio0/net/eth0", {"uevent": "INTERFACE=eth0\nIFINDEX=2\n"}),
)
# An ASPEED BMC display: a GPU by class but no accelerator; its node must not leak into FPGAs.
ASPEED_VGA = pci_function(
    "0000:03:00.0",
    "0x1a03",
    "0x2000",
    "0x030000",
    numa=0,
    driver="ast",
    extra=below("drm/card0", char_device("dri/card0", 226, 0)),
)


def _alveo_u250(card: str, numa: int, bus_number: int, render_minor: int) -> dict[str, str | Link]:
    card_minor = render_minor - 127  # card0 is the BMC's display
    mgmt_instance = bus_number << 8  # XRT names the node after bus/device/function
    mgmt = pci_function(
        f"{card}.0",
        "0x10ee",
        "0x5004",
        "0x058000",
        numa=numa,
        driver="xclmgmt",
        iommu_group=10 + numa,
        subsystem=("0x10ee", "0x000e"),
        extra=below(
            f"xrt_mgmt/xclmgmt{mgmt_instance}",
            char_device(f"xclmgmt{mgmt_instance}", 239, numa),
        ),
    )
    user = pci_function(
        f"{card}.1",
        "0x10ee",
        "0x5005",
        "0x058000",
        numa=numa,
        driver="xocl",
        iommu_group=20 + numa,
        subsystem=("0x10ee", "0x000e"),
        extra={
            **below(
                f"drm/renderD{render_minor}", char_device(f"dri/renderD{render_minor}", 226, render_minor)
            ),
            **below(f"drm/card{card_minor}", char_device(f"dri/card{card_minor}", 226, card_minor)),
        },
    )
    return merge(mgmt, user)


#: Two AMD/Xilinx Alveo U250 cards (management + user function each) on NUMA nodes 0 and 1.
ALVEO_PAIR_SYS = merge(
    INTEL_HOST_BRIDGE,
    ASPEED_VGA,
    _alveo_u250("0000:3b:00", numa=0, bus_number=0x3B, render_minor=128),
    _alveo_u250("0000:d8:00", numa=1, bus_number=0xD8, render_minor=129),
)
ALVEO_PAIR_DEV = {
    "xclmgmt15104": "",
    "xclmgmt55296": "",
    "dri/renderD128": "",
    "dri/renderD129": "",
    "dri/card0": "",
    "dri/card1": "",
    "dri/card2": "",
}


def _dfl_card(bus_id: str, device: str, numa: int, index: int, vfs: list[str]) -> dict[str, str | Link]:
    base = f"devices/pci{bus_id[:7]}/{bus_id}"
    region = f"fpga_region/region{index}"
    manager = f"{region}/dfl-fme.{index}/dfl-fme-mgr.{index}/fpga_manager/fpga{index}"
    card = pci_function(
        bus_id,
        "0x8086",
        device,
        "0x120000",
        numa=numa,
        driver="dfl-pci",
        iommu_group=30 + index,
        extra={
            **sriov_pf(1, vfs),
            **below(f"{region}/dfl-fme.{index}", char_device(f"dfl-fme.{index}", 240, index)),
            **below(f"{region}/dfl-port.{index}", char_device(f"dfl-port.{index}", 241, index)),
            f"{manager}/name": "dfl\n",
        },
    )
    card[f"class/fpga_region/region{index}"] = Link(f"../../{base}/{region}")
    card[f"class/fpga_manager/fpga{index}"] = Link(f"../../{base}/{manager}")
    return card


#: An Intel PAC N3000 (NUMA 0) and a PAC D5005 (NUMA 1, its one VF enabled) on the dfl-pci
#: driver, plus the host bridge, whose Intel vendor id must not make it an FPGA.
INTEL_PAC_SYS = merge(
    INTEL_HOST_BRIDGE,
    _dfl_card("0000:5e:00.0", "0x0b30", numa=0, index=0, vfs=[]),
    _dfl_card("0000:af:00.0", "0x0b2b", numa=1, index=1, vfs=["0000:af:01.0"]),
    pci_function(
        "0000:af:01.0",
        "0x8086",
        "0x0b2c",
        "0x120000",
        numa=1,
        driver="vfio-pci",
        iommu_group=50,
        extra={"physfn": Link("../0000:af:00.0")},
    ),
)
#: dfl-port.1 has no node: its sysfs entry alone must not list it.
INTEL_PAC_DEV = {"dfl-fme.0": "", "dfl-port.0": "", "dfl-fme.1": ""}

_MLX_VFS = ["0000:3b:00.2", "0000:3b:00.3", "0000:3b:00.4", "0000:3b:00.5"]

#: A Mellanox ConnectX-5 with SR-IOV: 64 VFs possible, 4 enabled (each with its own IOMMU group).
SRIOV_NIC_SYS = merge(
    INTEL_HOST_BRIDGE,
    pci_function(
        "0000:3b:00.0",
        "0x15b3",
        "0x1017",
        "0x020000",
        numa=0,
        driver="mlx5_core",
        iommu_group=40,
        extra=sriov_pf(64, _MLX_VFS),
    ),
    *(
        pci_function(
            vf,
            "0x15b3",
            "0x1018",
            "0x020000",
            numa=0,
            driver="mlx5_core",
            iommu_group=41 + i,
            extra={"physfn": Link("../0000:3b:00.0")},
        )
        for i, vf in enumerate(_MLX_VFS)
    ),
)

#: No accelerator at all: a host bridge, a VGA of the BMC and a virtio NIC.
NO_ACCELERATORS_SYS = merge(INTEL_HOST_BRIDGE, ASPEED_VGA, VIRTIO_NET)

#: A PCI card of an unknown vendor that only an fpga_manager class device marks as an FPGA, and
#: a SoC FPGA manager (no PCI parent) that must not be reported as a card.
CLASS_ONLY_SYS = merge(
    pci_function(
        "0000:65:00.0",
        "0x1d0f",
        "0xcafe",
        "0x120000",
        numa=0,
        extra={"fpga_manager/fpga0/name": "vendor-mgr\n"},
    ),
    {
        "class/fpga_manager/fpga0": Link("../../devices/pci0000:65/0000:65:00.0/fpga_manager/fpga0"),
        "devices/platform/soc/ff706000.fpgamgr/fpga_manager/fpga1/name": "socfpga\n",
        "class/fpga_manager/fpga1": Link("../../devices/platform/soc/ff706000.fpgamgr/fpga_manager/fpga1"),
    },
)
