"""PCI devices, FPGAs and SR-IOV from sysfs.

The reader works on a sysfs root passed in (``/sys`` by default) so that tests can point it at a
fake tree; pyudev cannot read a fake root, so it serves only the hotplug monitor.

What counts as an FPGA function (:func:`is_fpga_function`):

- any function of AMD/Xilinx (``0x10ee``: Alveo and Versal cards), Altera (``0x1172``);
- Intel (``0x8086``) and Silicom Denmark (``0x1c2c``) device ids that the kernel's ``dfl-pci``
  driver binds (drivers/fpga/dfl-pci.c: PAC N3000, D5005, Arria 10 GX, N5010/N5011, the
  generic DFL id used by N6000/N6001/C6100), physical and virtual functions;
- a function bound to an FPGA driver (XRT's xclmgmt/xocl, xdma, qdma, dfl-pci, the older
  out-of-tree intel-fpga-pci), whatever its ids;
- the PCI parent of any ``fpga_manager`` or ``fpga_region`` class device.

All physical functions of one card (same domain, bus and device; an Alveo card shows a
management function ``.0`` and a user function ``.1``) are one :class:`Fpga`. Virtual functions
are not counted as FPGAs: they appear in :func:`list_pci_devices` with their ``physfn``, ready to be
handed to a slot on their own.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from nodeagent.devices.topology import Fpga, Sriov
from nodeagent.errors import DiscoveryError, InvalidRequest, NotFound, os_error_message
from nodeagent.kernelfs import Sysfs

DEVICES_DIR = "bus/pci/devices"
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HEX_ID = re.compile(r"^0x[0-9a-f]+$")

VENDOR_XILINX = "0x10ee"
VENDOR_ALTERA = "0x1172"
VENDOR_INTEL = "0x8086"
VENDOR_SILICOM_DENMARK = "0x1c2c"

#: Vendors whose every PCI function is FPGA-based.
FPGA_VENDORS = frozenset({VENDOR_XILINX, VENDOR_ALTERA})

#: (vendor, device) pairs from the id table of drivers/fpga/dfl-pci.c (Linux 6.x).
DFL_FPGA_IDS = frozenset(
    {
        (VENDOR_INTEL, "0xbcbd"),  # PF_INT_5_X
        (VENDOR_INTEL, "0xbcbf"),  # VF_INT_5_X
        (VENDOR_INTEL, "0xbcc0"),  # PF_INT_6_X (PAC Arria 10 GX, early)
        (VENDOR_INTEL, "0xbcc1"),  # VF_INT_6_X
        (VENDOR_INTEL, "0x09c4"),  # PF_DSC_1_X (PAC Arria 10 GX)
        (VENDOR_INTEL, "0x09c5"),  # VF_DSC_1_X
        (VENDOR_INTEL, "0x0b30"),  # PAC N3000
        (VENDOR_INTEL, "0x0b2b"),  # PAC D5005
        (VENDOR_INTEL, "0x0b2c"),  # PAC D5005 VF
        (VENDOR_INTEL, "0xbcce"),  # generic DFL PF (N6000, N6001, C6100, D5005 with OFS)
        (VENDOR_INTEL, "0xbccf"),  # generic DFL VF
        (VENDOR_SILICOM_DENMARK, "0x1000"),  # PAC N5010
        (VENDOR_SILICOM_DENMARK, "0x1001"),  # PAC N5011
    }
)

FPGA_DRIVERS = frozenset(
    {"xclmgmt", "xocl", "xdma", "qdma", "qdma-pf", "qdma-vf", "dfl-pci", "intel-fpga-pci"}
)

_FPGA_CLASSES = ("fpga_manager", "fpga_region")

# Device nodes sit a few levels below a PCI function (dfl: region0/dfl-fme.0/dev); deeper
# walks only find unrelated children.
_NODE_SEARCH_DEPTH = 4


@dataclass(frozen=True, slots=True)
class PciDevice:
    """One PCI function as sysfs shows it. Ids are lower-case hex with ``0x``, as sysfs writes them."""

    bus_id: str  #: "0000:3b:00.1"
    vendor: str  #: "0x10ee"
    device: str  #: "0x5005"
    class_code: str  #: "0x120000"
    subsystem_vendor: str | None
    subsystem_device: str | None
    numa: int | None  #: None when the kernel does not know (numa_node -1) or has no NUMA
    driver: str | None
    iommu_group: int | None
    sriov: Sriov | None  #: None when the function has no SR-IOV capability
    physfn: str | None = None  #: for a virtual function: its physical function's bus id
    virtfns: tuple[str, ...] = ()  #: for a physical function: its enabled VFs, in VF order

    @property
    def is_virtfn(self) -> bool:
        return self.physfn is not None

    @property
    def card(self) -> str:
        """The address without the function number: what all functions of one card share."""
        return self.bus_id.rpartition(".")[0]


class DeviceNumber(NamedTuple):
    type: Literal["c", "b"]
    major: int
    minor: int


# --------------------------------------------------------------------------- pure rules


def is_fpga_function(vendor: str, device: str, driver: str | None = None) -> bool:
    """Whether a PCI function with these ids (``"0x10ee"``, ``"0x5005"``) and driver is an FPGA's."""
    return (
        vendor in FPGA_VENDORS
        or (vendor, device) in DFL_FPGA_IDS
        or (driver is not None and driver in FPGA_DRIVERS)
    )


def pci_parent(sys_path: str) -> str | None:
    """The PCI function nearest above a sysfs device path, or None when it sits on no PCI device."""
    for part in reversed(sys_path.split("/")):
        if PCI_ADDRESS.match(part):
            return part
    return None


# --------------------------------------------------------------------------- sysfs readers


def list_pci_devices(sysfs_root: Path = Path("/sys")) -> tuple[PciDevice, ...]:
    """Every PCI function under ``sysfs_root/bus/pci/devices``, sorted by bus id.

    A host without a PCI bus gives (). A function that disappears while being read (hot
    unplug, VFs being disabled) is left out; anything else unreadable raises DiscoveryError.
    """
    return _list_devices(Sysfs(sysfs_root))


def _list_devices(sysfs: Sysfs) -> tuple[PciDevice, ...]:
    out = []
    for name in sysfs.listdir(DEVICES_DIR) or []:
        try:
            out.append(_read_device(sysfs, name))
        except DiscoveryError:
            if sysfs.exists(f"{DEVICES_DIR}/{name}"):
                raise
    return tuple(out)


def read_pci_device(bus_id: str, sysfs_root: Path = Path("/sys")) -> PciDevice:
    """Read one PCI function by bus id ("0000:3b:00.1")."""
    return _read_device(Sysfs(sysfs_root), bus_id)


def _read_device(sysfs: Sysfs, bus_id: str) -> PciDevice:
    d = f"{DEVICES_DIR}/{bus_id}"
    if not PCI_ADDRESS.match(bus_id):
        raise DiscoveryError(
            f"{sysfs.path(d)} is not named like a PCI address "
            "(domain:bus:device.function, e.g. 0000:3b:00.1); is the sysfs root right?"
        )
    iommu = sysfs.link_name(f"{d}/iommu_group")
    return PciDevice(
        bus_id=bus_id,
        vendor=_hex_id(sysfs, f"{d}/vendor"),
        device=_hex_id(sysfs, f"{d}/device"),
        class_code=_hex_id(sysfs, f"{d}/class"),
        subsystem_vendor=_optional_hex_id(sysfs, f"{d}/subsystem_vendor"),
        subsystem_device=_optional_hex_id(sysfs, f"{d}/subsystem_device"),
        numa=_numa_node(sysfs, f"{d}/numa_node"),
        driver=sysfs.link_name(f"{d}/driver"),
        iommu_group=None if iommu is None else _parse_int(sysfs, f"{d}/iommu_group", iommu),
        sriov=_sriov(sysfs, d),
        physfn=sysfs.link_name(f"{d}/physfn"),
        virtfns=_virtfns(sysfs, d),
    )


def discover_fpgas(sysfs_root: Path = Path("/sys"), dev_root: Path = Path("/dev")) -> tuple[Fpga, ...]:
    """Every FPGA card on the PCI bus, one per card, sorted by address; () when there is none.

    ``device_nodes`` lists the nodes of all the card's physical functions that exist under
    ``dev_root`` (e.g. /dev/xclmgmt15104 and /dev/dri/renderD128 for an Alveo card,
    /dev/dfl-fme.0 and /dev/dfl-port.0 for an Intel PAC).
    """
    sysfs = Sysfs(sysfs_root)
    devices = _list_devices(sysfs)
    class_parents = _fpga_class_parents(sysfs)
    cards: dict[str, list[PciDevice]] = {}
    for dev in devices:
        if dev.is_virtfn:
            continue
        if is_fpga_function(dev.vendor, dev.device, dev.driver) or dev.bus_id in class_parents:
            cards.setdefault(dev.card, []).append(dev)
    return tuple(_fpga(card, funcs, sysfs, dev_root) for card, funcs in sorted(cards.items()))


def device_nodes_of(
    bus_id: str, sysfs_root: Path = Path("/sys"), dev_root: Path = Path("/dev")
) -> tuple[str, ...]:
    """Device nodes that belong to one PCI function and exist under ``dev_root``, sorted.

    Found from the function's sysfs children that carry a ``dev`` file (major:minor), named by
    the ``DEVNAME`` of their ``uevent``. Child PCI functions (behind a bridge) are not included.
    """
    return _device_nodes(Sysfs(sysfs_root), bus_id, dev_root)


def _device_nodes(sysfs: Sysfs, bus_id: str, dev_root: Path) -> tuple[str, ...]:
    names = _devnames_below(sysfs, f"{DEVICES_DIR}/{bus_id}", _NODE_SEARCH_DEPTH)
    found = {str(dev_root / name) for name in names}
    return tuple(sorted(p for p in found if os.path.exists(p)))


def device_node_info(path: str | Path) -> DeviceNumber:
    """Type and numbers of a device node (what a device cgroup rule needs): ``('c', 226, 128)``."""
    try:
        st = os.stat(path)
    except FileNotFoundError as err:
        raise NotFound(
            f"device node {path} does not exist; check the path and that its driver is loaded"
        ) from err
    except OSError as err:
        raise DiscoveryError(os_error_message(f"reading device node {path}", err)) from err
    if stat.S_ISCHR(st.st_mode):
        return DeviceNumber("c", os.major(st.st_rdev), os.minor(st.st_rdev))
    if stat.S_ISBLK(st.st_mode):
        return DeviceNumber("b", os.major(st.st_rdev), os.minor(st.st_rdev))
    raise InvalidRequest(f"{path} is not a character or block device node; give a path under /dev")


# --------------------------------------------------------------------------- helpers


def _fpga(card: str, funcs: list[PciDevice], sysfs: Sysfs, dev_root: Path) -> Fpga:
    primary = funcs[0]
    nodes = sorted({n for f in funcs for n in _device_nodes(sysfs, f.bus_id, dev_root)})
    drivers = [f.driver for f in funcs if f.driver is not None]
    return Fpga(
        id=card,
        vendor=primary.vendor,
        device=primary.device,
        pci_bus_id=primary.bus_id,
        numa=primary.numa,
        device_nodes=tuple(nodes),
        driver=",".join(dict.fromkeys(drivers)) or None,
        sriov=next((f.sriov for f in funcs if f.sriov is not None), None),
    )


def _fpga_class_parents(sysfs: Sysfs) -> frozenset[str]:
    """PCI parents of fpga_manager and fpga_region class devices (SoC FPGAs have none)."""
    parents: set[str] = set()
    for cls in _FPGA_CLASSES:
        for name in sysfs.listdir(f"class/{cls}") or []:
            parent = pci_parent(sysfs.real_path(f"class/{cls}/{name}"))
            if parent is not None:
                parents.add(parent)
    return frozenset(parents)


def _devnames_below(sysfs: Sysfs, directory: str, depth: int) -> Iterator[str]:
    # A directory removed while we walk (absent: None) has no nodes any more. Child PCI functions
    # are other devices with their own entry.
    for name in sysfs.subdirs(directory) or []:
        if PCI_ADDRESS.match(name):
            continue
        child = f"{directory}/{name}"
        if sysfs.is_file(f"{child}/dev"):
            yield _devname(sysfs, child)
        if depth > 1:
            yield from _devnames_below(sysfs, child, depth - 1)


def _devname(sysfs: Sysfs, device_dir: str) -> str:
    uevent = sysfs.read_text(f"{device_dir}/uevent") or ""
    for line in uevent.splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME" and value:
            return value
    return device_dir.rpartition("/")[2]


def _required(sysfs: Sysfs, rel: str) -> str:
    text = sysfs.read_text(rel)
    if text is None:
        raise DiscoveryError(
            f"reading {sysfs.path(rel)}: no such file; every PCI function has it, so the sysfs tree "
            "is incomplete"
        )
    return text


def _hex_id(sysfs: Sysfs, rel: str) -> str:
    return _check_hex(sysfs, rel, _required(sysfs, rel))


def _optional_hex_id(sysfs: Sysfs, rel: str) -> str | None:
    text = sysfs.read_text(rel)
    return None if text is None else _check_hex(sysfs, rel, text)


def _check_hex(sysfs: Sysfs, rel: str, text: str) -> str:
    value = text.lower()
    if not _HEX_ID.match(value):
        raise DiscoveryError(f"{sysfs.path(rel)} holds {text[:40]!r}; expected a hex id such as 0x10ee")
    return value


def _parse_int(sysfs: Sysfs, rel: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DiscoveryError(f"{sysfs.path(rel)} holds {text[:40]!r}; expected an integer") from None


def _numa_node(sysfs: Sysfs, rel: str) -> int | None:
    text = sysfs.read_text(rel)
    if text is None:
        return None  # kernels built without NUMA have no numa_node file
    node = _parse_int(sysfs, rel, text)
    return None if node < 0 else node


def _sriov(sysfs: Sysfs, device_dir: str) -> Sriov | None:
    total = sysfs.read_text(f"{device_dir}/sriov_totalvfs")
    if total is None:
        return None
    return Sriov(
        total_vfs=_parse_int(sysfs, f"{device_dir}/sriov_totalvfs", total),
        num_vfs=_parse_int(
            sysfs, f"{device_dir}/sriov_numvfs", _required(sysfs, f"{device_dir}/sriov_numvfs")
        ),
    )


def _virtfns(sysfs: Sysfs, device_dir: str) -> tuple[str, ...]:
    indexed = []
    for name in sysfs.listdir(device_dir) or []:
        index = name.removeprefix("virtfn")
        if name.startswith("virtfn") and index.isdigit():
            target = sysfs.link_name(f"{device_dir}/{name}")
            if target is not None:
                indexed.append((int(index), target))
    return tuple(target for _, target in sorted(indexed))
