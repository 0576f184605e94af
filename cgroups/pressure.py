"""Pressure stall information (PSI): node-wide in ``/proc/pressure``, per cgroup in cgroup v2.

A PSI file (kernel 4.20+, ``CONFIG_PSI``; Documentation/accounting/psi.rst) reads::

    some avg10=0.12 avg60=0.05 avg300=0.01 total=123456
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

``total`` is the cumulative stall time in microseconds: the share of a period in which tasks
stalled is the difference of two totals over the period's length. The ``avg`` figures are
exponential averages over 10 s and more, too slow for a loop that must react within a second,
so callers that act on pressure use the totals.

Only cgroup v2 has per-cgroup files (``cpu.pressure``, ``memory.pressure``, ``io.pressure``); v1
controllers have none, and there the node-wide files are all there is. The node-wide CPU "full"
line is always zero (the kernel reports it only for compatibility since 5.13).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nodeagent.cgroups import fs
from nodeagent.errors import CgroupError, DiscoveryError
from nodeagent.kernelfs import Procfs

Resource = Literal["cpu", "memory", "io"]
RESOURCES: tuple[Resource, ...] = ("cpu", "memory", "io")


@dataclass(frozen=True)
class PressureLine:
    """One line of a PSI file: averages in percent, ``total`` in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


@dataclass(frozen=True)
class Pressure:
    """A PSI file: ``some`` (at least one task stalled) and ``full`` (all non-idle tasks stalled;
    absent from the node-wide cpu file before kernel 5.13)."""

    some: PressureLine
    full: PressureLine | None


def parse_pressure(text: str) -> Pressure:
    """Parse a PSI file; ValueError naming the line when it is not one."""
    lines: dict[str, PressureLine] = {}
    for raw in text.splitlines():
        if not raw.strip():
            continue
        kind, _, rest = raw.partition(" ")
        try:
            fields = dict(item.split("=", 1) for item in rest.split())
            lines[kind] = PressureLine(
                float(fields["avg10"]), float(fields["avg60"]), float(fields["avg300"]), int(fields["total"])
            )
        except (KeyError, ValueError) as err:
            raise ValueError(f"not a pressure line: {raw!r} ({err})") from None
    if "some" not in lines:
        raise ValueError(f"no 'some' line in pressure text {text[:120]!r}")
    return Pressure(lines["some"], lines.get("full"))


def read_node_pressure(proc_root: Path, resource: Resource) -> Pressure | None:
    """``/proc/pressure/<resource>``; None where the kernel has no PSI (booted without it)."""
    path = proc_root / "pressure" / resource
    try:
        text = Procfs(proc_root).read_text(f"pressure/{resource}")
    except DiscoveryError as err:
        # EOPNOTSUPP: a kernel built with PSI but booted with psi=0.
        if err.errno in (errno.EOPNOTSUPP, errno.ENOTDIR):
            return None
        raise CgroupError(str(err), errno_=err.errno) from err
    if text is None:
        return None
    try:
        return parse_pressure(text)
    except ValueError as err:
        raise CgroupError(f"{path}: {err}") from None


def read_cgroup_pressure(directory: fs.CgroupDir, resource: Resource) -> Pressure | None:
    """``<resource>.pressure`` of a cgroup v2 directory; None where the file is missing."""
    text = fs.read_optional(directory, f"{resource}.pressure")
    if text is None:
        return None
    try:
        return parse_pressure(text)
    except ValueError as err:
        raise CgroupError(f"{directory.path}/{resource}.pressure: {err}") from None


__all__ = [
    "RESOURCES",
    "Pressure",
    "PressureLine",
    "Resource",
    "parse_pressure",
    "read_cgroup_pressure",
    "read_node_pressure",
]
