"""The cgroup subtree a service manager delegates to the agent, and where the agent's processes live in it.

Under systemd the agent owns exactly one subtree: the cgroup of a unit with ``Delegate=yes``. systemd
created that cgroup and keeps writing its attributes; the agent creates, configures and removes what
lies below it, and nothing anywhere else (systemd's "single writer" rule). The layout below the
delegated cgroup is always the same::

    <root>/            the delegated cgroup (systemd's: the agent writes only its cgroup.subtree_control
    │                  and cgroup.procs, the files delegation hands over)
    ├── agent/         the agent itself, when its own unit is the delegated one
    ├── keeper/        the host keeper and any other helper the agent starts
    ├── pin/           the process that keeps a delegated service from being emptied (see below)
    └── slots/         Hierarchy.parent: the slots and the shared-class parents
        ├── <guaranteed slot>/
        ├── burstable/<slot>/
        └── best-effort/<slot>/

On cgroup v2 a cgroup that enables controllers for its children may not hold processes itself (the
"no internal processes" rule), so every process in the subtree sits in a leaf: the agent, the keeper
and the pin in theirs, workers in their slots; ``<root>`` and ``slots/`` hold none. The agent writes
cpusets and limits only on cgroups it created (``slots/`` and below), never on ``<root>``.

Why a pin: systemd removes a unit's cgroup, with every empty cgroup below it, as soon as no process is
left in it. The delegating unit of the default install (``nodeagent-slots.service``) starts a sleeping
process for that reason; :func:`prepare` moves it into ``pin/`` and starts another when it is gone.

:class:`ProcessPlacement` answers, for the agent and everything it starts, "which cgroup.procs must this
process be written into", and does it: :meth:`~ProcessPlacement.command` wraps a helper's argv so that
it starts already inside its leaf, :meth:`~ProcessPlacement.move` moves a running process. Without a
delegation (no systemd, or the configuration turned it off) processes stay where they start.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.cgroups import fs
from nodeagent.cgroups.detect import CgroupHost
from nodeagent.cgroups.factory import open_manager
from nodeagent.cgroups.hierarchy import validate_name
from nodeagent.errors import CgroupError

AGENT = "agent"
KEEPER = "keeper"
PIN = "pin"
#: The leaves processes may be placed in; a slot never lives directly below the delegated cgroup.
LEAVES = (AGENT, KEEPER, PIN)
#: The parent of every slot cgroup, below the delegated cgroup.
SLOTS = "slots"

#: Joins each cgroup.procs named before "--" (``$$`` is the shell itself, so the program it execs stays
#: there), then execs the rest: a helper starts inside its leaf before its first instruction, and the
#: agent needs no preexec_fn (which would cost CPython its vfork path in a threaded process).
_JOIN_SCRIPT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 126; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Delegation:
    """A delegated cgroup and how the agent lives in it.

    ``root``: its path relative to the cgroup mounts (the same in every hierarchy), without a leading
    slash. ``unit``: the unit that delegates it. ``agent_leaf``: the leaf the agent's own process
    belongs in, or None when the agent stays in a unit of its own, outside the subtree. ``pinned``: the
    subtree is a unit of its own that only a pin process keeps alive while no worker runs.
    """

    root: str
    unit: str
    agent_leaf: str | None = None
    pinned: bool = False

    def __post_init__(self) -> None:
        root = self.root.strip("/")
        if not root:
            raise CgroupError(
                f"{self.unit} delegates the cgroup root itself; refusing to manage the whole tree"
            )
        fs.check_relative(root)
        for part in root.split("/"):
            validate_name(part)
        object.__setattr__(self, "root", root)
        if self.agent_leaf is not None and self.agent_leaf not in LEAVES:
            raise CgroupError(
                f"the agent runs in {self.root}/{self.agent_leaf}, but below {self.root} the names "
                f"{', '.join(LEAVES)} and {SLOTS} are the agent's own; start it in {self.root}/{AGENT}"
            )

    @property
    def slots_parent(self) -> str:
        """The cgroup every slot lives under (``Hierarchy.parent``)."""
        return f"{self.root}/{SLOTS}"

    def leaf(self, name: str) -> str:
        if name not in LEAVES:
            raise CgroupError(f"{name!r} is not a process leaf; use one of {', '.join(LEAVES)}")
        return f"{self.root}/{name}"

    def contains(self, relpath: str) -> bool:
        """Whether ``relpath`` is the delegated cgroup or lies below it."""
        path = relpath.strip("/")
        return path == self.root or path.startswith(self.root + "/")


class ProcessPlacement:
    """Where the agent's own processes and its helpers belong, and how they get there."""

    def __init__(self, host: CgroupHost, delegation: Delegation | None) -> None:
        self.host = host
        self.delegation = delegation

    def procs_files(self, leaf: str) -> tuple[Path, ...]:
        """Every cgroup.procs a process must be written into to live in ``leaf`` (created if missing);
        empty without a delegation.

        cgroup v2: the one unified file. v1 and hybrid: the leaf in each controller hierarchy (in the
        ones systemd does not manage, cpuset and freezer, the agent mirrors the delegated path itself,
        as systemd's delegation notes ask), and in the hierarchies systemd tracks processes with
        (``name=systemd``, and the controller-less cgroup2 mount of a hybrid host), so that systemd
        counts the process as part of the delegating unit.
        """
        if self.delegation is None:
            return ()
        relpath = self.delegation.leaf(leaf)
        host = self.host
        if host.mode == "v2":
            if host.v2_mount is None:  # pragma: no cover - detect() never reports v2 without it
                raise CgroupError("cgroup v2 host without a cgroup2 mount")
            fs.make_dir(host.v2_mount, relpath)
            return (fs.resolve(host.v2_mount, fs.join(relpath, "cgroup.procs")),)
        manager = open_manager(host, relpath)
        manager.create()
        files = list(manager.procs_files())
        controller_mounts = set(host.v1_mounts.values())
        for mount in host.all_mounts:
            if mount in controller_mounts or not fs.exists(mount, self.delegation.root):
                continue
            fs.make_dir(mount, relpath)
            files.append(fs.resolve(mount, fs.join(relpath, "cgroup.procs")))
        return tuple(files)

    def command(self, leaf: str, argv: Sequence[str]) -> list[str]:
        """``argv``, run so that it starts inside ``leaf`` (unchanged without a delegation).

        A shell writes its own pid into each cgroup.procs and execs ``argv``: the helper's first
        instruction already runs in its leaf, and whatever it forks stays there.
        """
        files = self.procs_files(leaf)
        if not files:
            return list(argv)
        shell = shutil.which("sh") or "/bin/sh"
        return [shell, "-c", _JOIN_SCRIPT, "nodeagent-join", *map(str, files), "--", *argv]

    def move(self, pid: int, leaf: str) -> None:
        """Move process ``pid`` (every thread of it) into ``leaf``; nothing without a delegation."""
        for procs in self.procs_files(leaf):
            try:
                procs.write_text(f"{pid}\n")
            except OSError as err:
                raise CgroupError(
                    f"cannot move pid {pid} into {procs.parent}: {err.strerror}", errno_=err.errno
                ) from err

    def pids(self, leaf: str) -> list[int]:
        """The processes in ``leaf`` (in the first hierarchy that holds it); empty without a delegation."""
        files = self.procs_files(leaf)
        if not files:
            return []
        return sorted(int(line) for line in files[0].read_text().split())


def prepare(placement: ProcessPlacement, *, pin_argv: Sequence[str] | None = None) -> list[int]:
    """Make the delegated cgroup ready to hold slots; returns the pids it moved.

    1. On cgroup v2, every process directly in the delegated cgroup moves into a leaf: the agent into
       its own, anything else (the delegating unit's pin, started there by systemd) into ``pin/`` when
       the subtree is pinned, else next to the agent. Only then may the delegated cgroup enable
       controllers for its children.
    2. The agent moves into its leaf, when it has one (wherever it was started in the subtree).
    3. A pinned subtree gets a new pin when its last one is gone, so that systemd does not remove the
       subtree the moment its last worker ends.
    4. ``slots/`` is created, with the controllers the slots need enabled on the way down.
    """
    delegation = placement.delegation
    if delegation is None:
        return []
    host = placement.host
    moved: list[int] = []
    me = os.getpid()
    if host.mode == "v2" and host.v2_mount is not None:
        for pid in fs.read_pids(host.v2_mount, fs.join(delegation.root, "cgroup.procs")):
            # The agent (and, in the agent's own unit, whatever started with it) goes to its leaf;
            # in a pinned unit anything else is the pin systemd started.
            leaf = PIN if delegation.pinned and pid != me else (delegation.agent_leaf or AGENT)
            try:
                placement.move(pid, leaf)
            except CgroupError as err:
                if err.errno != errno.ESRCH:  # one that exited meanwhile needs no place
                    raise
                continue
            moved.append(pid)
    if delegation.agent_leaf is not None and me not in moved:
        placement.move(me, delegation.agent_leaf)
    if delegation.pinned and not placement.pids(PIN):
        start_pin(placement, pin_argv)
    open_manager(host, delegation.slots_parent).create()
    return moved


def start_pin(placement: ProcessPlacement, argv: Sequence[str] | None = None) -> int:
    """Start a pin: a sleeping process in ``pin/`` in a session of its own, outliving the agent."""
    sleep = shutil.which("sleep") or "/bin/sleep"
    command = placement.command(PIN, list(argv) if argv is not None else [sleep, "infinity"])
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd="/",
        )
    except OSError as err:
        raise CgroupError(
            f"cannot start a pin process ({command[-2:]}): {err.strerror}", errno_=err.errno
        ) from err
    return process.pid


__all__ = [
    "AGENT",
    "KEEPER",
    "LEAVES",
    "PIN",
    "SLOTS",
    "Delegation",
    "ProcessPlacement",
    "prepare",
    "start_pin",
]
