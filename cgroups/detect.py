"""Which cgroup filesystems this host has (v2 unified, v1, or hybrid) and what we may do with them.

Reads ``/proc/self/mountinfo``, ``/proc/cgroups`` and ``/proc/self/cgroup`` under an injectable proc
root (:class:`~nodeagent.kernelfs.Procfs`), plus ``cgroup.controllers`` of the v2 mount under an
injectable filesystem root (through :mod:`nodeagent.cgroups.fs`), so tests run on fake trees. The
parsers are pure functions over text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nodeagent import procfmt
from nodeagent.cgroups import fs
from nodeagent.errors import CgroupError, DiscoveryError
from nodeagent.kernelfs import Procfs

Mode = Literal["v1", "v2", "hybrid", "none"]

#: The v1 controllers the managers drive; other v1 hierarchies (net_cls, name=systemd) are ignored.
V1_CONTROLLERS = ("cpuset", "cpu", "cpuacct", "memory", "pids", "devices", "freezer", "blkio")
#: The v2 controllers the managers drive.
V2_CONTROLLERS = ("cpuset", "cpu", "io", "memory", "pids")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo that is a cgroup filesystem."""

    mount_point: str
    fstype: str  # "cgroup" (v1) or "cgroup2"
    root: str  # the mount's root inside its hierarchy ("/" unless a container bind-mounted a subtree)
    super_options: frozenset[str]


@dataclass(frozen=True)
class CgroupHost:
    """What :func:`detect` found. Paths are real filesystem paths (``fs_root`` already applied)."""

    mode: Mode
    #: v1 controller -> mount point of its hierarchy (co-mounted controllers share one path).
    v1_mounts: dict[str, Path] = field(default_factory=dict)
    v2_mount: Path | None = None
    #: Controllers the manager can use: v1 controllers (v1/hybrid) or the v2 root's cgroup.controllers.
    controllers: frozenset[str] = frozenset()
    #: Controllers listed in the v2 mount's cgroup.controllers (empty in hybrid mode on most hosts).
    v2_controllers: frozenset[str] = frozenset()
    #: This process's cgroup in the v2 hierarchy ("/..." as in /proc/self/cgroup), when there is one.
    own_v2_cgroup: str | None = None
    #: Whether we may create cgroups (root, or a delegated subtree we own).
    can_write: bool = False
    #: True when we are not root but own our v2 cgroup (a delegated subtree, e.g. systemd Delegate=).
    delegated: bool = False
    #: Under systemd: the cgroup (relative path, the same in every hierarchy) that a unit delegates to
    #: the agent. Nothing above it is ours to write, not even to enable controllers; None elsewhere.
    delegation_root: str | None = None
    #: Every mounted cgroup hierarchy (v1 controllers, named ones such as name=systemd, cgroup2).
    all_mounts: tuple[Path, ...] = ()

    def controller_roots(self) -> list[Path]:
        """Every hierarchy a cgroup path of the controllers may live in: v2's mount, or each
        distinct v1 controller mount (co-mounted controllers once)."""
        if self.mode == "v2" and self.v2_mount is not None:
            return [self.v2_mount]
        return list(dict.fromkeys(self.v1_mounts.values()))

    def mount_for(self, controller: str) -> Path:
        """The v1 hierarchy that carries ``controller``."""
        try:
            return self.v1_mounts[controller]
        except KeyError:
            raise CgroupError(
                f"the v1 controller {controller!r} is not mounted on this host (mounted: "
                f"{', '.join(sorted(self.v1_mounts)) or 'none'}); mount it or enable it in the kernel"
            ) from None


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup and cgroup2 mounts in a mountinfo text (see proc(5))."""
    return [
        Mount(
            mount_point=m.mount_point,
            fstype=m.fstype,
            root=m.root,
            super_options=frozenset(m.super_options.split(",")),
        )
        for m in procfmt.parse_mountinfo(text)
        if m.fstype in ("cgroup", "cgroup2") and m.super_options
    ]


def parse_proc_cgroups(text: str) -> frozenset[str]:
    """The controllers the kernel has enabled, from /proc/cgroups."""
    enabled: set[str] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and not line.startswith("#") and parts[3] == "1":
            enabled.add(parts[0])
    return frozenset(enabled)


def parse_own_v2_cgroup(text: str) -> str | None:
    """This process's v2 cgroup from /proc/self/cgroup (the ``0::/path`` line)."""
    for hierarchy, controllers, path in procfmt.parse_proc_cgroup(text):
        if hierarchy == "0" and controllers == "":
            return path.strip() or "/"
    return None


def _under(fs_root: Path, mount_point: str) -> Path:
    return fs_root / mount_point.lstrip("/")


def detect(proc_root: Path = Path("/proc"), fs_root: Path = Path("/")) -> CgroupHost:
    """Detect the host's cgroup mode, mounts, usable controllers and write access."""
    procfs = Procfs(proc_root)
    mountinfo = procfs.read_text("self/mountinfo")
    if mountinfo is None:
        raise DiscoveryError(
            f"{procfs.path('self/mountinfo')} does not exist, so the cgroup mounts cannot be read; "
            f"mount procfs on {proc_root}"
        )
    mounts = parse_mountinfo(mountinfo)
    proc_cgroups = procfs.read_text("cgroups")
    enabled = None if proc_cgroups is None else parse_proc_cgroups(proc_cgroups)
    v1_mounts: dict[str, Path] = {}
    v2_mount: Path | None = None
    all_mounts = tuple(dict.fromkeys(_under(fs_root, mount.mount_point) for mount in mounts))
    for mount in mounts:
        if mount.fstype == "cgroup2":
            v2_mount = v2_mount or _under(fs_root, mount.mount_point)
            continue
        for controller in V1_CONTROLLERS:
            if controller in mount.super_options and (enabled is None or controller in enabled):
                v1_mounts.setdefault(controller, _under(fs_root, mount.mount_point))
    v2_controllers: frozenset[str] = frozenset()
    if v2_mount is not None:
        v2_controllers = frozenset((fs.read_optional(v2_mount, "cgroup.controllers") or "").split())
    mode: Mode
    if v1_mounts and v2_mount is not None:
        mode = "hybrid"
    elif v1_mounts:
        mode = "v1"
    elif v2_mount is not None:
        mode = "v2"
    else:
        mode = "none"
    own_cgroups = procfs.read_text("self/cgroup")
    own_v2 = None if own_cgroups is None else parse_own_v2_cgroup(own_cgroups)
    can_write, delegated = _access(mode, v1_mounts, v2_mount, own_v2)
    controllers = frozenset(v1_mounts) if mode in ("v1", "hybrid") else v2_controllers
    return CgroupHost(
        mode=mode,
        v1_mounts=v1_mounts,
        v2_mount=v2_mount,
        controllers=controllers,
        v2_controllers=v2_controllers,
        own_v2_cgroup=own_v2,
        can_write=can_write,
        delegated=delegated,
        all_mounts=all_mounts,
    )


def _access(
    mode: Mode, v1_mounts: dict[str, Path], v2_mount: Path | None, own_v2: str | None
) -> tuple[bool, bool]:
    if mode in ("v1", "hybrid"):
        return all(os.access(path, os.W_OK) for path in set(v1_mounts.values())), False
    if v2_mount is None:
        return False, False
    if os.access(v2_mount, os.W_OK):
        return True, False
    if own_v2 and own_v2 != "/":
        own_dir = v2_mount / own_v2.lstrip("/")
        try:
            owned = own_dir.stat().st_uid == os.geteuid()
        except OSError:
            return False, False
        writable = owned and os.access(own_dir, os.W_OK)
        return writable, writable
    return False, False
