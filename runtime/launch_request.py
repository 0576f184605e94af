"""What the agent asks the keeper's worker child to launch; plain data, JSON on the wire.

Everything here is already resolved: numeric uid/gid, absolute cgroup.procs paths, the full
environment. The child and the keeper never look anything up; they only carry it out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nodeagent.runtime.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from nodeagent.runtime.sandbox.spec import SandboxSpec


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    launch_id: str
    argv: tuple[str, ...]
    env: dict[str, str]
    #: Directory for the keeper's state file and the worker's output FIFOs; one per worker.
    run_dir: str
    #: Directory for worker.log (stdout and stderr, one stream) and its rotations.
    log_dir: str
    cwd: str | None = None
    #: cgroup.procs files to join: one per v1 hierarchy, or the single v2 one.
    cgroup_procs: tuple[str, ...] = ()
    #: A child cgroup of the one each of ``cgroup_procs`` names, which the worker joins instead (a
    #: container worker on cgroup v2: the slot's own cgroup holds no process once its controllers
    #: are enabled for children). What the keeper ends at the worker's exit is still the whole slot.
    cgroup_leaf: str | None = None
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
    #: Written to /proc/self/oom_score_adj before the identity switch (lowering it needs root);
    #: None keeps what the keeper passed down.
    oom_score_adj: int | None = None
    log_max_bytes: int = DEFAULT_MAX_BYTES
    log_backups: int = DEFAULT_BACKUPS
    #: Free bytes on the log's file system the keeper leaves alone ([state] reserve): below them
    #: the log gives up its own old rotations, then drops output, before the agent's records fail.
    log_reserve_bytes: int = 0
    #: Once the worker's main process exits, what is left in its cgroups gets SIGTERM, and SIGKILL
    #: this long after (the keeper does it, also while the agent is down).
    stop_grace_seconds: float = 30.0
    #: The worker's sandbox, set up by the child before exec (runtime/sandbox); its uid, gid and
    #: groups are the request's. None: no sandbox (switched off by the agent's configuration).
    sandbox: SandboxSpec | None = None
    #: (pid, start time) of a running worker whose namespaces this launch joins instead of making
    #: its own (an exec probe runs where its worker runs).
    join: tuple[int, int] | None = None
    #: When the main process exits the keeper ends what is left in the slot's cgroups (a worker);
    #: False: only its own process group (a probe, which must not take its worker with it).
    end_slot_on_exit: bool = True

    def to_json(self) -> dict[str, Any]:
        # Shallow (json.dumps reads tuples as lists), the sandbox's too: dataclasses.asdict's deep
        # copy of a sandboxed request cost ~0.1 ms on every launch.
        body = {name: getattr(self, name) for name in _FIELDS}
        if self.cgroup_leaf is None:
            del body["cgroup_leaf"]  # what a keeper older than the field reads unchanged
        if self.sandbox is not None:
            body["sandbox"] = self.sandbox.to_json()
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LaunchRequest:
        fixed = dict(body)
        for key in ("argv", "cgroup_procs", "cpus", "mems", "groups", "join"):
            if fixed.get(key) is not None:
                fixed[key] = tuple(fixed[key])
        fixed["rlimits"] = {k: (int(v[0]), int(v[1])) for k, v in fixed.get("rlimits", {}).items()}
        if fixed.get("sandbox") is not None:
            fixed["sandbox"] = SandboxSpec.from_json(fixed["sandbox"])
        return cls(**fixed)


_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchRequest))


def joined_procs(req: LaunchRequest) -> tuple[str, ...]:
    """The cgroup.procs files the worker's child writes itself into (``cgroup_leaf`` applied)."""
    if req.cgroup_leaf is None:
        return req.cgroup_procs
    return tuple(
        f"{path.rpartition('/')[0]}/{req.cgroup_leaf}/{path.rpartition('/')[2]}" for path in req.cgroup_procs
    )
