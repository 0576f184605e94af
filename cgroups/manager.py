"""Picking the manager for a host, and the operations built on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from nodeagent.cgroups.base import CgroupManager
from nodeagent.cgroups.detect import CgroupHost
from nodeagent.cgroups.rules import DeviceRule
from nodeagent.cgroups.v1 import V1Manager
from nodeagent.cgroups.v2 import V2Manager
from nodeagent.errors import Unsupported


def open_manager(
    host: CgroupHost, relpath: str, *, version: Literal["auto", "v1", "v2"] = "auto"
) -> CgroupManager:
    """The manager for ``relpath`` (relative to the cgroup mounts) on ``host``.

    ``auto`` takes v1 on v1 and hybrid hosts (where the controllers are) and v2 on unified hosts.
    ``version="v2"`` on a hybrid host gives a controller-less group in the cgroup2 mount, which still
    supports freeze, cgroup.kill and eBPF device filters.
    """
    chosen = version if version != "auto" else ("v2" if host.mode == "v2" else "v1")
    if chosen == "v1":
        if not host.v1_mounts:
            raise Unsupported(f"no cgroup v1 hierarchies on this host (mode {host.mode})")
        return V1Manager(host, relpath)
    return V2Manager(host, relpath)


def apply_device_rules(manager: CgroupManager, rules: Iterable[DeviceRule]) -> None:
    """Make ``rules`` the group's device allow-list (v1: minimal diff, read back and verified; v2: eBPF)."""
    manager.set_devices(rules)


def remove_subtree(host: CgroupHost, relpath: str, timeout: float = 5.0) -> None:
    """Kill everything under ``relpath`` and remove it with its child groups (crash clean-up)."""
    manager = open_manager(host, relpath)
    manager.kill(timeout)
    manager.delete(timeout)
