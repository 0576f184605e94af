"""What the agent asks the spawner to launch, and what it gets back; plain data, JSON on the wire.

Everything here is already resolved: numeric uid/gid, absolute cgroup.procs paths, the full
environment. The spawner and keeper never look anything up; they only carry it out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nodeagent.runtime.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class LaunchRequest:
    launch_id: str
    argv: tuple[str, ...]
    env: dict[str, str]
    #: Directory for the keeper's state file; one per worker.
    run_dir: str
    #: Directory for stdout.log / stderr.log.
    log_dir: str
    cwd: str | None = None
    #: cgroup.procs files to join: one per v1 hierarchy, or the single v2 one.
    cgroup_procs: tuple[str, ...] = ()
    #: A network namespace file (e.g. /run/netns/<name>) to enter.
    netns: str | None = None
    cpus: tuple[int, ...] | None = None
    #: NUMA nodes to bind memory to with set_mempolicy(MPOL_BIND); None leaves the policy alone.
    mems: tuple[int, ...] | None = None
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] | None = None
    no_new_privs: bool = True
    #: resource name ("nofile") -> (soft, hard); -1 is unlimited.
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    umask: int = 0o022
    #: memory.oom_control (v1) or memory.events (v2) of the slot, so the keeper can tell an OOM kill.
    oom_events: str | None = None
    log_max_bytes: int = DEFAULT_MAX_BYTES
    log_backups: int = DEFAULT_BACKUPS

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LaunchRequest:
        fixed = dict(body)
        for key in ("argv", "cgroup_procs", "cpus", "mems", "groups"):
            if fixed.get(key) is not None:
                fixed[key] = tuple(fixed[key])
        fixed["rlimits"] = {k: (int(v[0]), int(v[1])) for k, v in fixed.get("rlimits", {}).items()}
        return cls(**fixed)


@dataclass(frozen=True)
class LaunchResult:
    launch_id: str
    pid: int
    start_time: int
    keeper_pid: int
    keeper_start_time: int
