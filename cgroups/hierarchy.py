"""Where the agent's cgroups live: one agent-owned parent, guaranteed slots directly under it, and a
parent per shared QoS class so a class can be tuned as a whole::

    nodeagent.slice/              the agent's parent (holds no processes itself)
    ├── <guaranteed slot>/
    ├── burstable/<slot>/
    └── best-effort/<slot>/
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from nodeagent.cgroups.base import CgroupManager
from nodeagent.cgroups.detect import CgroupHost
from nodeagent.cgroups.factory import open_manager
from nodeagent.errors import InvalidRequest

QosClass = Literal["guaranteed", "burstable", "best-effort"]
DEFAULT_PARENT = "nodeagent.slice"
CLASS_DIRS: dict[str, str] = {"burstable": "burstable", "best-effort": "best-effort"}
_MAX_NAME = 200


def validate_name(name: str) -> str:
    """A cgroup directory name: not empty, not '.'/'..', no '/', no control characters."""
    if not name or name in (".", "..") or "/" in name or len(name) > _MAX_NAME:
        raise InvalidRequest(
            f"invalid cgroup name {name!r}: use 1..{_MAX_NAME} characters without '/', and not '.' or '..'"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidRequest(f"invalid cgroup name {name!r}: control characters are not allowed")
    return name


@dataclass(frozen=True)
class Hierarchy:
    """The agent's cgroup layout under ``parent`` (relative to the cgroup mounts)."""

    parent: str = DEFAULT_PARENT

    def __post_init__(self) -> None:
        for part in self.parent.split("/"):
            validate_name(part)

    def class_parent(self, qos: QosClass) -> str:
        if qos == "guaranteed":
            return self.parent
        if qos not in CLASS_DIRS:
            raise InvalidRequest(f"unknown QoS class {qos!r}; use guaranteed, burstable or best-effort")
        return f"{self.parent}/{CLASS_DIRS[qos]}"

    def slot_path(self, name: str, qos: QosClass) -> str:
        return _slot_path(self, name, qos)

    def candidate_paths(self, name: str) -> tuple[str, ...]:
        """Where a slot named ``name`` would be in each class (to find it whatever its class).
        Checked each time and not kept: only a slot's own class is asked for again and again, and
        :meth:`slot_path`'s cache would hold the other two for every slot (issue 23)."""
        check_slot_name(name)
        return tuple(f"{self.class_parent(qos)}/{name}" for qos in ("guaranteed", "burstable", "best-effort"))

    def parents(self) -> tuple[str, ...]:
        """The agent parent and the class parents, top first."""
        return (self.parent, *(f"{self.parent}/{d}" for d in CLASS_DIRS.values()))


@functools.lru_cache(maxsize=4096)
def _slot_path(hierarchy: Hierarchy, name: str, qos: QosClass) -> str:
    """A slot's cgroup path, checked once per slot: the QoS loop and the host's cpuset sync ask
    for every best-effort slot's path, and checking 500 names each time was a tenth of their cost
    (issue 23). A refused name raises and is not kept."""
    check_slot_name(name)
    return f"{hierarchy.class_parent(qos)}/{name}"


def check_slot_name(name: str) -> str:
    """A slot's cgroup directory name: a valid name that no class parent has."""
    validate_name(name)
    if name in CLASS_DIRS.values():
        raise InvalidRequest(f"slot name {name!r} is reserved for a QoS class parent; choose another")
    return name


def ensure_parents(host: CgroupHost, hierarchy: Hierarchy) -> list[CgroupManager]:
    """Create the agent parent and the class parents (idempotent); return their managers."""
    managers = [open_manager(host, path) for path in hierarchy.parents()]
    for manager in managers:
        manager.create()
    return managers


def list_owned(host: CgroupHost, hierarchy: Hierarchy | str = DEFAULT_PARENT) -> list[str]:
    """Relative paths of every slot group under the agent parent (to find orphans after a crash)."""
    layout = hierarchy if isinstance(hierarchy, Hierarchy) else Hierarchy(hierarchy)
    owned: list[str] = []
    for name in open_manager(host, layout.parent).children():
        if name not in CLASS_DIRS.values():
            owned.append(f"{layout.parent}/{name}")
    for class_dir in CLASS_DIRS.values():
        class_path = f"{layout.parent}/{class_dir}"
        owned += [f"{class_path}/{name}" for name in open_manager(host, class_path).children()]
    return owned
