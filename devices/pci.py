"""FPGAs and other PCI accelerators from sysfs (placeholder: being written)."""

from __future__ import annotations

from pathlib import Path

from nodeagent.devices.topology import Fpga


def discover_fpgas(sysfs_root: Path = Path("/sys"), dev_root: Path = Path("/dev")) -> tuple[Fpga, ...]:
    """Every FPGA card on the PCI bus; () when there is none."""
    return ()
