"""The kernel's procfs text formats, each parsed here and only here (see proc(5)).

Reading is :mod:`nodeagent.kernelfs`'s (or a caller's that must not import it, such as the sandbox
in a forked child); this module turns the text into plain data and decides nothing: which fields
count as busy, which mounts matter, what an absent key means, is each caller's.

- ``/proc/stat``: :func:`parse_cpu_ticks`, the ``cpuN`` lines' counters;
- ``/proc/meminfo`` and ``/sys/devices/system/node/nodeN/meminfo``: :func:`parse_meminfo`,
  :func:`meminfo_bytes`;
- ``/proc/PID/mountinfo``: :func:`parse_mountinfo`;
- ``/proc/PID/cgroup``: :func:`parse_proc_cgroup`.

Standard library only: the keeper and its forked children import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------- /proc/stat

#: Indices of the counters on a ``cpuN`` line of /proc/stat (ticks of USER_HZ since boot).
USER, NICE, SYSTEM, IDLE, IOWAIT, IRQ, SOFTIRQ, STEAL = range(8)


def parse_cpu_ticks(text: str) -> dict[int, tuple[int, ...]]:
    """Each CPU's counters from /proc/stat's ``cpuN`` lines (the ``cpu`` total left out), in the
    kernel's order (user nice system idle iowait irq softirq steal guest guest_nice; older kernels
    print fewer)."""
    found: dict[int, tuple[int, ...]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        found[int(name[3:])] = tuple(int(v) for v in rest.split())
    return found


# ---------------------------------------------------------------------------- meminfo


def parse_meminfo(text: str) -> dict[str, str]:
    """Each key of a meminfo file and its value as written (``"MemTotal"`` -> ``"16384 kB"``); a
    NUMA node's file ("Node 0 MemTotal:  16384 kB") gives the same keys."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.split()[-1] if key.strip() else ""
        if key and key not in found:
            found[key] = value.strip()
    return found


def meminfo_bytes(value: str | None) -> int | None:
    """A meminfo size ("16384 kB") in bytes; None when absent or not in that form."""
    fields = (value or "").split()
    if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
        return int(fields[0]) * 1024
    return None


# ---------------------------------------------------------------------------- mountinfo


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/PID/mountinfo, paths unescaped."""

    root: str  #: the path of the mounted filesystem that is seen at mount_point
    mount_point: str
    options: str  #: per-mount options ("rw,nosuid,relatime")
    fstype: str
    source: str
    super_options: str  #: per-superblock options ("rw,nsdelegate")


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as ``\\ooo``."""
    if "\\" not in field:
        return field
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Every mount of a mountinfo text, in its order (parents before children); lines that are not
    mountinfo lines are left out."""
    mounts: list[MountInfo] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        if len(fields) < 5:
            continue
        fstype, source, super_options = [*right.split(), "", "", ""][:3]
        options = fields[5] if len(fields) > 5 else ""
        mounts.append(
            MountInfo(unescape(fields[3]), unescape(fields[4]), options, fstype, source, super_options)
        )
    return mounts


# ---------------------------------------------------------------------------- /proc/PID/cgroup


def parse_proc_cgroup(text: str) -> list[tuple[str, str, str]]:
    """(hierarchy id, controllers, path) of each line of /proc/PID/cgroup, in its order: ``"0"``
    and ``""`` for the unified (v2) hierarchy, ``"cpu,cpuacct"`` or ``"name=systemd"`` for a v1
    one. The path is as written (``"/"`` for a root); a line without two colons is left out."""
    found: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if sep and sep2:
            found.append((hierarchy, controllers, path))
    return found


__all__ = [
    "IDLE",
    "IOWAIT",
    "IRQ",
    "NICE",
    "SOFTIRQ",
    "STEAL",
    "SYSTEM",
    "USER",
    "MountInfo",
    "meminfo_bytes",
    "parse_cpu_ticks",
    "parse_meminfo",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "unescape",
]
