"""The runtime side as the agent's slot manager sees it: supervisors for slots, found again after a restart.

:class:`WorkerRuntime` is the seam (the manager's tests plug a fake in); :class:`SpawnerRuntime`
is the real one: workers launched through the spawner, one directory per slot under
``workers_dir``::

    <workers_dir>/<slot id>/slot.json   the slot description (NODEAGENT_SLOT_FILE)
    <workers_dir>/<slot id>/run/        the keeper's state file: how :meth:`readopt` finds the worker
    <workers_dir>/<slot id>/logs/       stdout and stderr
    <workers_dir>/<slot id>/tmp/        the worker's TMPDIR

Where a worker goes in the kernel comes from isolation's result for the slot (:class:`AppliedSlot`):
its cgroup.procs files, network namespace and OOM counter; None means the slot is not isolated.
"""

from __future__ import annotations

import contextlib
import enum
import shutil
from pathlib import Path
from typing import Protocol

from nodeagent.cgroups import CgroupHost, CgroupManager, open_manager
from nodeagent.cgroups.delegation import ProcessPlacement
from nodeagent.errors import NotFound
from nodeagent.isolation.slot import AppliedSlot
from nodeagent.runtime.adopt import resume_supervision
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.launch import SlotBinding, build_launch_request
from nodeagent.runtime.logs import tail
from nodeagent.runtime.spawner import Spawner
from nodeagent.runtime.supervisor import SlotCgroup, SpawnerLauncher, Supervisor
from nodeagent.schema.worker import WorkerSpec


class Readoption(enum.StrEnum):
    """What :meth:`WorkerRuntime.readopt` found of a slot's last worker."""

    ADOPTED = "adopted"  #: alive, and now supervised again
    EXITED = "exited"  #: ended while the agent was away; its restart policy has been applied
    NONE = "none"  #: nothing was ever launched for the slot


class WorkerRuntime(Protocol):
    def supervisor(self, slot: SlotDescription, applied: AppliedSlot | None, spec: WorkerSpec) -> Supervisor:
        """A supervisor (not started) for ``spec`` in ``slot``, which isolation built as ``applied``."""
        ...

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        """Resume the worker last launched for ``slot_id`` into ``supervisor``."""
        ...

    def logs(self, slot_id: str, lines: int) -> list[str]: ...

    def discard(self, slot_id: str) -> None:
        """The slot is gone: remove its worker directory."""
        ...

    def close(self) -> None: ...


def slot_binding(applied: AppliedSlot | None) -> SlotBinding:
    """Where a worker of the slot must go: its cgroups, network namespace and OOM counter."""
    if applied is None:
        return SlotBinding(cgroup_procs=())
    return SlotBinding(
        cgroup_procs=applied.procs_files, netns=applied.netns_path, oom_events=applied.oom_events
    )


class ManagedCgroup:
    """Supervision's view of a slot's cgroup (:class:`SlotCgroup`) over a cgroups manager."""

    def __init__(self, manager: CgroupManager) -> None:
        self._manager = manager

    def kill_all(self, timeout: float) -> None:
        if self._manager.exists():
            self._manager.kill(timeout)

    def oom_kill_count(self) -> int:
        if not self._manager.exists():
            return 0
        return self._manager.oom_events().oom_kill or 0

    def pids(self) -> list[int]:
        return self._manager.subtree_pids() if self._manager.exists() else []


class NoCgroup:
    """A slot without a cgroup (the agent runs unisolated): nothing to kill or count."""

    def kill_all(self, timeout: float) -> None:
        return None

    def oom_kill_count(self) -> int:
        return 0

    def pids(self) -> list[int]:
        return []


class SpawnerRuntime:
    """The real :class:`WorkerRuntime` (see the module docstring for the directory layout)."""

    def __init__(
        self,
        workers_dir: Path,
        host: CgroupHost | None,
        spawner: Spawner | None = None,
        *,
        placement: ProcessPlacement | None = None,
    ) -> None:
        """``placement``: where the agent's helpers belong (under systemd, the delegated cgroup's
        ``keeper/`` leaf); the spawner, and the keepers it forks, start there."""
        self._dir = workers_dir
        self._host = host
        self._spawner = spawner or Spawner(placement=placement)
        self._launcher = SpawnerLauncher(self._spawner)

    def supervisor(self, slot: SlotDescription, applied: AppliedSlot | None, spec: WorkerSpec) -> Supervisor:
        template = build_launch_request(spec, slot, slot_binding(applied), self._dir / slot.slot_id)
        # A worker in its own network namespace listens on the slot's address, which the host
        # reaches over the slot's veth; 127.0.0.1 here would be the host's loopback, not the slot's.
        network = applied.network if applied is not None else None
        probe_host = str(network.slot_address) if network is not None else "127.0.0.1"
        return Supervisor(spec, template, self._launcher, self._cgroup(applied), probe_host=probe_host)

    def _cgroup(self, applied: AppliedSlot | None) -> SlotCgroup:
        if applied is None or self._host is None:
            return NoCgroup()
        return ManagedCgroup(open_manager(self._host, applied.cgroup))

    def readopt(self, slot_id: str, supervisor: Supervisor) -> Readoption:
        found = resume_supervision(supervisor, self._dir / slot_id / "run")
        if found.process is not None:
            return Readoption.ADOPTED
        return Readoption.EXITED if found.exit is not None else Readoption.NONE

    def logs(self, slot_id: str, lines: int) -> list[str]:
        log_dir = self._dir / slot_id / "logs"
        out = tail(log_dir, "stdout", lines)
        with contextlib.suppress(NotFound):
            out += [f"[stderr] {line}" for line in tail(log_dir, "stderr", lines)]
        return out[-lines:] if lines else []

    def discard(self, slot_id: str) -> None:
        shutil.rmtree(self._dir / slot_id, ignore_errors=True)

    def close(self) -> None:
        # Closing our end ends the spawner; keepers and workers it started live on.
        self._spawner.close()


__all__ = [
    "ManagedCgroup",
    "NoCgroup",
    "Readoption",
    "SpawnerRuntime",
    "WorkerRuntime",
    "slot_binding",
]
