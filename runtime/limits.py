"""What a worker's ``rlimits`` may ask for on this host, checked when the spec is submitted.

The launch sets the limits as root before it drops to the worker's uid, so what it can set is
what the agent's own process can: without CAP_SYS_RESOURCE a hard limit no higher than the
agent's own hard limit; with it, any value the kernel takes (``nofile`` at most
``/proc/sys/fs/nr_open``). A value past that used to be accepted and then fail every launch
(EPERM, or an overflow for values past 2^63 - 1); here it is refused with the ceiling named.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from nodeagent.errors import InvalidRequest
from nodeagent.kernelfs import Procfs

#: Bit of CAP_SYS_RESOURCE in the capability masks of /proc/<pid>/status.
CAP_SYS_RESOURCE = 24
#: An rlimit the kernel takes (rlim_t is unsigned 64-bit, RLIM_INFINITY its largest value; Python's
#: resource module takes a signed 64-bit value).
LARGEST = 2**63 - 1


@dataclass(frozen=True)
class RlimitCeilings:
    """The most each limit may be raised to by the agent's launch (None: no ceiling but the
    kernel's, unlimited allowed)."""

    by_name: Mapping[str, int | None]

    def check(self, rlimits: Mapping[str, tuple[int, int]]) -> None:
        """InvalidRequest naming the first limit asked above its ceiling (-1 is unlimited)."""
        for name, (soft, hard) in sorted(rlimits.items()):
            ceiling = self.by_name.get(name)
            for which, value in (("hard", hard), ("soft", soft)):
                too_big = value > LARGEST or (ceiling is not None and (value == -1 or value > ceiling))
                if too_big:
                    most = "unlimited (-1)" if ceiling is None else str(ceiling)
                    asked = "unlimited (-1)" if value == -1 else str(value)
                    raise InvalidRequest(
                        f"worker.rlimits.{name}: the {which} limit {asked} is more than this host lets the "
                        f"agent give (at most {most}); ask for less"
                        + ("" if ceiling is None else ", or give the agent CAP_SYS_RESOURCE / a higher limit")
                    )


def host_ceilings(
    proc: Procfs | None = None, getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit
) -> RlimitCeilings:
    """The ceilings of this process (the agent's) on this host."""
    proc = proc or Procfs()
    privileged = _has_cap_sys_resource(proc.read_text("self/status") or "")
    nr_open = proc.read_int("sys/fs/nr_open") or 1 << 20  # the kernel's default
    ceilings: dict[str, int | None] = {}
    for attribute in dir(resource):
        if not attribute.startswith("RLIMIT_"):
            continue
        name = attribute.removeprefix("RLIMIT_").lower()
        if privileged:
            ceilings[name] = nr_open if name == "nofile" else None
            continue
        hard = getrlimit(getattr(resource, attribute))[1]
        ceilings[name] = None if hard == resource.RLIM_INFINITY else hard
    return RlimitCeilings(ceilings)


def _has_cap_sys_resource(status: str) -> bool:
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


__all__ = ["LARGEST", "RlimitCeilings", "host_ceilings"]
