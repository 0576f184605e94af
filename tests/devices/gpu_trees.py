"""Fake sysfs and /proc trees for GPU hosts, as ``{relpath: content}`` maps.

``h100_host_sysfs()`` is "a host with 8 GPUs split across 2 NUMA nodes": the PCI devices of the
fake NVML profile ``h100_8x_mixed_mig()`` (same bus ids, same NUMA nodes), plus the host's other
PCI functions that discovery must skip. ``mig_capabilities_proc(host)`` is the driver's MIG
capability files for a fake host's MIG layout.
"""

from __future__ import annotations

from tests.fakes.fake_nvml import FakeHost, h100_8x_mixed_mig

_PCI = "bus/pci/devices"

# Other devices on such a host: a ConnectX NIC per socket and an NVMe drive, which are not GPUs.
_OTHER_DEVICES = {
    "0000:00:00.0": ("0x8086", "0x09a2", "0x060000", 0),  # host bridge
    "0000:0c:00.0": ("0x15b3", "0x1021", "0x020000", 0),  # NIC
    "0000:8c:00.0": ("0x15b3", "0x1021", "0x020000", 1),  # NIC
    "0000:c1:00.0": ("0x144d", "0xa80a", "0x010802", 1),  # NVMe
    "0000:ee:00.0": ("0x10de", "0x22a3", "0x068000", 1),  # NVSwitch: NVIDIA, but a bridge
}


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """ "00000000:1B:00.0" -> "0000:1b:00.0"."""
    return nvml_bus_id[4:].lower()


def _pci_device(bus_id: str, vendor: str, device: str, cls: str, numa: int) -> dict[str, str]:
    base = f"{_PCI}/{bus_id}"
    return {
        f"{base}/vendor": f"{vendor}\n",
        f"{base}/device": f"{device}\n",
        f"{base}/class": f"{cls}\n",
        f"{base}/numa_node": f"{numa}\n",
    }


def gpu_host_sysfs(host: FakeHost, *, numa_override: dict[int, int] | None = None) -> dict[str, str]:
    """PCI entries for every GPU of ``host`` (3D controllers, vendor 0x10de) and a few other devices.

    ``numa_override`` maps a GPU index to the numa_node sysfs shows (e.g. -1 for "unknown").
    """
    tree: dict[str, str] = {}
    for bus_id, (vendor, device, cls, numa) in _OTHER_DEVICES.items():
        tree.update(_pci_device(bus_id, vendor, device, cls, numa))
    for gpu in host.gpus:
        numa = (numa_override or {}).get(gpu.index, gpu.numa)
        device_id = f"0x{gpu.model.pci_device_id >> 16:04x}"
        tree.update(_pci_device(sysfs_bus_id(gpu.pci_bus_id), "0x10de", device_id, "0x030200", numa))
    return tree


def h100_host_sysfs() -> dict[str, str]:
    """A host with 8 GPUs split across 2 NUMA nodes (GPUs 0-3 on node 0, 4-7 on node 1)."""
    return gpu_host_sysfs(h100_8x_mixed_mig())


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-caps minor the driver gives a GPU/compute instance's access file.

    nvidia-cap1 and 2 are mig/config and mig/monitor; then each GPU gets a block of 15 GPU
    instances x (1 GI + 8 CI) minors, so gpu0/gi1 is 12 and gpu0/gi1/ci0 is 13.
    """
    gi_minor = 3 + gpu_minor * 15 * 9 + gi * 9
    return gi_minor if ci is None else gi_minor + 1 + ci


def _access(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"


def mig_capabilities_proc(host: FakeHost) -> dict[str, str]:
    """/proc/driver/nvidia/capabilities for every MIG instance of ``host`` (relative to /proc)."""
    base = "driver/nvidia/capabilities"
    tree = {f"{base}/mig/config": _access(1), f"{base}/mig/monitor": _access(2)}
    for gpu in host.gpus:
        if not gpu.mig_enabled:
            continue
        for dev in gpu.mig_devices:
            gi_dir = f"{base}/gpu{gpu.minor}/mig/gi{dev.gpu_instance_id}"
            tree[f"{gi_dir}/access"] = _access(cap_minor(gpu.minor, dev.gpu_instance_id))
            ci_minor = cap_minor(gpu.minor, dev.gpu_instance_id, dev.compute_instance_id)
            tree[f"{gi_dir}/ci{dev.compute_instance_id}/access"] = _access(ci_minor)
    return tree
