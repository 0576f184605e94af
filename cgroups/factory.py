"""Picking the manager for a host, and the operations built on it."""

from __future__ import annotations

import contextlib
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
    if host.mode != "v2":
        _remove_untracked(host, relpath)


def _remove_untracked(host: CgroupHost, relpath: str) -> None:
    """The same path in the hierarchies without controllers (``name=systemd``, a hybrid host's
    cgroup2 mount): a container runtime below a slot makes its groups there too, and leaves the
    ancestors it made. Empty once the processes above are gone; one still busy stays."""
    controllers = set(host.v1_mounts.values())
    for mount in host.all_mounts:
        if mount in controllers:
            continue
        top = mount / relpath.strip("/")
        if not top.is_dir() or top == mount:
            continue
        for directory in sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
