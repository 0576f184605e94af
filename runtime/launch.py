"""Turning a WorkerSpec and a slot into a LaunchRequest: names resolved, environment wired, files laid out.

The agent's side of a launch. Layout of a worker's directory (one per slot)::

    <worker_dir>/run/          the keeper's state file (worker.json) and the worker's stdout and
                               stderr FIFOs (stdout.fifo, stderr.fifo)
    <worker_dir>/logs/         worker.log (stdout and stderr, one time-ordered stream) and its rotations
    <worker_dir>/view/         what the worker sees of it (root's, 0755):
    <worker_dir>/view/slot.json   the slot description (NODEAGENT_SLOT_FILE), root's, 0644
    <worker_dir>/view/tmp/        the worker's private TMPDIR (its own, 0700); sandboxed, only the
                                  mount point of its private /tmp (a tmpfs)
    <worker_dir>/view/home/       the worker's HOME when it runs sandboxed without a private /tmp
                                  (its own, 0700); with one, HOME is /tmp/home, a tmpfs of its own
                                  ([sandbox] home_size) inside it, and TMPDIR is /tmp: short paths,
                                  with room for unix sockets (108 bytes) below them
    <worker_dir>/view/files/      the spec's ``files`` (root's, 0644; NODEAGENT_FILES_DIR)

With a sandbox the state directory above all this is hidden from the worker, and ``view/`` alone is
shown again at the same path (one bind mount: the environment names the same files inside and
outside). The worker can write in its own tmp/ and home/ only, never replace the slot file, and
never reach run/ or logs/, which hold what the keeper trusts about it.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nodeagent.atomicfile import write_atomic
from nodeagent.errors import InvalidRequest, KernelError, translate_os_error
from nodeagent.runtime.env import SlotDescription, thread_count, worker_environment, write_slot_file
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.sandbox.spec import Exposed, PrivateDir, SandboxSpec
from nodeagent.schema.worker import WorkerSpec


@dataclass(frozen=True)
class SlotBinding:
    """Where the slot lives in the kernel: what runtime needs from isolation's results."""

    cgroup_procs: tuple[str, ...]
    netns: str | None = None
    oom_events: str | None = None
    #: The slot's OOM score adjustment (its QoS class's), written before exec: without it a worker
    #: inherits the keeper's, which is the agent unit's strong protection from the OOM killer.
    oom_score_adj: int | None = None
    #: Bind memory with set_mempolicy too (cpuset.mems already confines it; this makes it strict
    #: for tasks that later leave the cpuset's control, and for v2 without the cpuset controller).
    bind_memory: bool = False
    #: A child of the slot's cgroup the worker joins instead of the slot's (LaunchRequest.cgroup_leaf).
    cgroup_leaf: str | None = None


@dataclass(frozen=True)
class Identity:
    uid: int | None
    gid: int | None
    groups: tuple[int, ...] | None
    home: str


def _group_id(value: str | int) -> int:
    if isinstance(value, int):
        return value
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise InvalidRequest(
            f"worker spec: group {value!r} does not exist on this host; create it or give a gid"
        ) from None


def resolve_identity(spec: WorkerSpec) -> Identity:
    """Numeric ids for the spec's user, group and supplementary groups (a user's primary group by default)."""
    if spec.user is None:
        gid = _group_id(spec.group) if spec.group is not None else None
        groups = tuple(_group_id(g) for g in spec.supplementary_groups) if spec.supplementary_groups else None
        return Identity(None, gid, groups, "/")
    try:
        entry = pwd.getpwuid(spec.user) if isinstance(spec.user, int) else pwd.getpwnam(spec.user)
    except KeyError:
        if isinstance(spec.user, int):
            gid = _group_id(spec.group) if spec.group is not None else spec.user
            return Identity(spec.user, gid, tuple(_group_id(g) for g in spec.supplementary_groups), "/")
        raise InvalidRequest(
            f"worker spec: user {spec.user!r} does not exist on this host; create it or give a uid"
        ) from None
    gid = _group_id(spec.group) if spec.group is not None else entry.pw_gid
    return Identity(
        entry.pw_uid, gid, tuple(_group_id(g) for g in spec.supplementary_groups), entry.pw_dir or "/"
    )


def _private_dir(path: Path, identity: Identity) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if identity.uid is not None:
            # Also when it exists: a slot's uid is its own, but a directory left by an earlier
            # worker of the slot under another identity (a changed spec) must follow.
            os.chown(path, identity.uid, identity.gid if identity.gid is not None else -1)
    except OSError as err:
        raise translate_os_error(f"prepare worker directory {path}", err, KernelError) from err


#: HOME and TMPDIR of a sandboxed worker with a private /tmp: short, so that a server's unix
#: sockets below them fit in sun_path's 108 bytes (PyTriton's under HOME did not, below the state
#: directory's worker paths).
PRIVATE_HOME = "/tmp/home"  # noqa: S108 - inside the worker's own /tmp
PRIVATE_TMPDIR = "/tmp"  # noqa: S108


def _sandboxed(sandbox: SandboxSpec, view: Path) -> tuple[SandboxSpec, Identity]:
    """The sandbox's identity (the agent chose it), its HOME, and the worker directory's view
    shown again where the hidden state directory covers it."""
    if "mount" in sandbox.namespaces and sandbox.tmp_bytes is not None and sandbox.home_bytes is not None:
        identity = Identity(sandbox.uid, sandbox.gid, sandbox.groups, PRIVATE_HOME)
        tmpfs = PrivateDir(PRIVATE_HOME, sandbox.home_bytes, 0o700, sandbox.uid, sandbox.gid)
        sandbox = dataclasses.replace(sandbox, private_dirs=(*sandbox.private_dirs, tmpfs))
        return _shown_again(sandbox, view), identity
    home = view / "home"
    identity = Identity(sandbox.uid, sandbox.gid, sandbox.groups, str(home))
    _private_dir(home, identity)
    if "mount" in sandbox.namespaces:
        # HOME and TMPDIR are size-limited places of the slot's own (a tmpfs, the private /tmp),
        # charged to its memory cgroup; the directories here are only their mount points, so a
        # worker never writes to the agent's state file system.
        private = (
            ()
            if sandbox.home_bytes is None
            else (PrivateDir(str(home), sandbox.home_bytes, 0o700, sandbox.uid, sandbox.gid),)
        )
        views = () if sandbox.tmp_bytes is None else (str(view / "tmp"),)
        sandbox = dataclasses.replace(
            sandbox,
            private_dirs=(*sandbox.private_dirs, *private),
            tmp_views=(*sandbox.tmp_views, *views),
        )
    return _shown_again(sandbox, view), identity


def _shown_again(sandbox: SandboxSpec, view: Path) -> SandboxSpec:
    hidden = [path.rstrip("/") + "/" for path in sandbox.hide_paths]
    if not any(str(view).startswith(h) for h in hidden):
        return sandbox  # not hidden: nothing to show again
    return dataclasses.replace(sandbox, expose=(*sandbox.expose, Exposed(str(view), writable=True)))


def _filled(text: str, fill: Mapping[str, str]) -> str:
    """``{threads}`` and ``{files}``: what only the launch knows (the slot's size, the directory)."""
    for key, value in fill.items():
        text = text.replace(key, value)
    return text


def _write_files(directory: Path, files: Mapping[str, str]) -> None:
    """The spec's files, root's and world-readable (the worker may read, never change them); those
    of an earlier spec of the slot go."""
    try:
        directory.mkdir(mode=0o755, exist_ok=True)
        for old in directory.iterdir():
            if old.name not in files:
                old.unlink()
        for name, text in files.items():
            write_atomic(directory / name, text, mode=0o644)
    except OSError as err:
        raise translate_os_error(f"write worker files in {directory}", err, KernelError) from err


def build_launch_request(
    spec: WorkerSpec,
    slot: SlotDescription,
    binding: SlotBinding,
    worker_dir: Path,
    sandbox: SandboxSpec | None = None,
    *,
    log_reserve_bytes: int = 0,
) -> LaunchRequest:
    """Lay out ``worker_dir``, write the slot file and return the request the keeper's child carries
    out; with ``sandbox`` the worker runs as the sandbox's uid, gid and groups (the request's own
    user and groups were weighed by the agent when it chose them). ``log_reserve_bytes``: free
    space the worker's log leaves on its file system (runtime.logs.RotatingLog)."""
    if not spec.command:
        raise InvalidRequest(
            "worker spec: command is missing; give the worker's argv or a preset that knows it"
        )
    worker_dir = Path(os.path.realpath(worker_dir))  # shown again by path inside the sandbox
    view = worker_dir / "view"
    try:
        # The agent's (0700, whatever the umask): run/ and logs/ are not the worker's to see; a
        # sandboxed worker reaches view/ through its own bind mount, not through this directory.
        worker_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        view.mkdir(exist_ok=True, mode=0o755)
        view.chmod(0o755)  # root's: the worker may not replace what is in it
    except OSError as err:
        raise translate_os_error(f"prepare worker directory {view}", err, KernelError) from err
    if sandbox is not None:
        sandbox, identity = _sandboxed(sandbox, view)
    else:
        identity = resolve_identity(spec)
    slot_file = write_slot_file(slot, view / "slot.json")
    tmpdir = view / "tmp"
    _private_dir(tmpdir, identity)
    files = view / "files"
    fill = {"{threads}": str(thread_count(slot)), "{files}": str(files)}
    _write_files(files, {name: _filled(text, fill) for name, text in spec.files.items()})
    short = identity.home == PRIVATE_HOME
    env = worker_environment(
        slot, slot_file, spec.env, home=identity.home, tmpdir=PRIVATE_TMPDIR if short else str(tmpdir)
    )
    if spec.files:
        env.setdefault("NODEAGENT_FILES_DIR", str(files))
    env = {key: _filled(value, fill) for key, value in env.items()}
    return LaunchRequest(
        launch_id=slot.slot_id,
        argv=tuple(_filled(arg, fill) for arg in spec.command),
        env=env,
        run_dir=str(worker_dir / "run"),
        log_dir=str(worker_dir / "logs"),
        # A preset's server writes beside itself (TorchServe its logs/, MLServer's parallel workers
        # .metrics/ and .envs/): it starts in its HOME, not in "/", which it may not write.
        cwd=spec.workdir or (identity.home if spec.preset is not None else None),
        cgroup_procs=binding.cgroup_procs,
        cgroup_leaf=binding.cgroup_leaf,
        netns=binding.netns,
        cpus=slot.cpus or None,
        mems=slot.numa_nodes if binding.bind_memory and slot.numa_nodes else None,
        uid=identity.uid,
        gid=identity.gid,
        groups=identity.groups,
        rlimits=dict(spec.rlimits),
        umask=spec.umask,
        oom_events=binding.oom_events,
        oom_score_adj=binding.oom_score_adj,
        stop_grace_seconds=spec.stop_grace_seconds,
        sandbox=sandbox,
        log_reserve_bytes=log_reserve_bytes,
    )
