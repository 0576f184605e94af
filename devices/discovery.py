"""The whole host's topology in one call: CPUs and NUMA nodes, GPUs, FPGAs."""

from __future__ import annotations

import socket
from pathlib import Path

from nodeagent.devices.cpu import discover_cpu_topology
from nodeagent.devices.gpu import discover_gpus
from nodeagent.devices.pci import discover_fpgas
from nodeagent.devices.topology import Topology
from nodeagent.kernelfs import Sysfs


def discover(
    sysfs_root: Path = Path("/sys"),
    *,
    proc_root: Path = Path("/proc"),
    dev_root: Path = Path("/dev"),
    gpus: bool = True,
    fpgas: bool = True,
) -> Topology:
    """Discover this host's topology; ``gpus``/``fpgas`` False leave those lists empty unread.

    Raises DiscoveryError when the CPU/NUMA part cannot be read; GPU and FPGA discovery report
    an absent driver or card as an empty list.
    """
    cpu = discover_cpu_topology(Sysfs(sysfs_root), proc_root=proc_root)
    return Topology(
        hostname=socket.gethostname(),
        cpus=cpu.cpus,
        numa_nodes=cpu.numa_nodes,
        gpus=discover_gpus(sysfs_root) if gpus else (),
        fpgas=discover_fpgas(sysfs_root, dev_root) if fpgas else (),
        memory_bytes=cpu.memory_bytes,
        isolated_cpus=cpu.isolated_cpus,
    )
