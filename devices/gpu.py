"""NVIDIA GPUs through NVML (placeholder: being written)."""

from __future__ import annotations

from pathlib import Path

from nodeagent.devices.topology import Gpu


def discover_gpus(sysfs_root: Path = Path("/sys")) -> tuple[Gpu, ...]:
    """Every NVIDIA GPU NVML reports; () when there is no GPU or no driver."""
    return ()
