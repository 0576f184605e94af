"""What a worker's sandbox is made of: plain data, checked when it is built, JSON on the wire.

A :class:`SandboxSpec` travels inside the launch request to the pre-forked child, which carries it
out with :func:`nodeagent.runtime.sandbox.enter_sandbox` and
:func:`nodeagent.runtime.sandbox.seal_sandbox`. Like the request, everything in it is resolved:
numeric ids, absolute paths, device numbers. The defaults are the confined worker; every field
that loosens it is an opt-out the agent's configuration must have allowed.
"""

from __future__ import annotations

import dataclasses
import os.path
from dataclasses import dataclass
from typing import Any

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.sandbox.caps import capability_number
from nodeagent.runtime.sandbox.paths import lexical
from nodeagent.runtime.sandbox.seccomp import PROFILES, restricted_syscalls

#: Namespaces a spec may ask for; the network namespace is the slot's own (entered by the launch
#: path from the slot's netns file), so it is not made here.
NAMESPACES = ("mount", "pid", "ipc", "uts", "cgroup")
#: A confined worker's namespaces unless the spec says otherwise. No pid namespace: a non-root
#: worker is kept from other processes by a private /proc with hidepid and its own uid, which
#: needs no init process per worker (see pidns.py for the figures).
DEFAULT_NAMESPACES = ("mount", "ipc", "uts")
#: How the worker sees /sys/fs/cgroup: the host's tree read-only; only its own subtree, through a
#: cgroup namespace and fresh read-only cgroupfs mounts; or the host's tree as it is (an opt-out).
CGROUP_VIEWS = ("read-only", "namespace", "host")
#: Names under the private /dev that the sandbox always makes; a slot's device may not reuse them.
SAFE_DEV_NAMES = frozenset(
    {"null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd", "stdin", "stdout",
     "stderr", "core"}
)  # fmt: skip
DEFAULT_TMP_BYTES = 256 << 20
DEFAULT_SHM_BYTES = 64 << 20
_MAX_ID = 2**32 - 2  # (uid_t)-1 means "unchanged" to the kernel
_MAX_MAJOR = (1 << 12) - 1
_MAX_MINOR = (1 << 20) - 1
_MAX_HOSTNAME = 64


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node to expose in the worker's private /dev (numbers as on the host)."""

    path: str
    type: str
    major: int
    minor: int
    mode: int = 0o660
    uid: int = 0
    gid: int = 0

    def __post_init__(self) -> None:
        name = self.path.removeprefix("/dev/")
        where = f"device node {self.path!r}"
        if not self.path.startswith("/dev/") or not name or lexical(self.path) != self.path:
            raise InvalidRequest(f"{where}: the path must be a normalised absolute path under /dev/")
        if name.split("/")[0] in SAFE_DEV_NAMES:
            raise InvalidRequest(f"{where}: /dev/{name.split('/')[0]} is made by the sandbox itself")
        if self.type not in ("c", "b"):
            raise InvalidRequest(f"{where}: type {self.type!r} must be 'c' (character) or 'b' (block)")
        if not 0 <= self.major <= _MAX_MAJOR or not 0 <= self.minor <= _MAX_MINOR:
            raise InvalidRequest(
                f"{where}: {self.major}:{self.minor} is outside the kernel's device numbers "
                f"(major 0-{_MAX_MAJOR}, minor 0-{_MAX_MINOR})"
            )
        if not 0 <= self.mode <= 0o777:
            raise InvalidRequest(f"{where}: mode {self.mode:o} must be permission bits only (0-777)")
        _check_id(self.uid, f"{where}: owner uid")
        _check_id(self.gid, f"{where}: owner gid")


@dataclass(frozen=True, slots=True)
class Exposed:
    """A host path inside a hidden directory that the worker sees again, at the same place: its
    slot file, HOME and TMPDIR live under the agent's state directory, which is hidden whole."""

    path: str
    writable: bool = False


@dataclass(frozen=True, slots=True)
class PrivateDir:
    """A tmpfs of the worker's own at ``path`` (its HOME, /run/lock): private to the slot, at most
    ``size`` bytes, its pages charged to the slot's memory cgroup, gone with the worker's mount
    namespace; never a place on the agent's state file system."""

    path: str
    size: int
    mode: int = 0o700
    uid: int = 0
    gid: int = 0


# Slotted, like the records in it: each slot's launch request keeps one of its own.
@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """One worker's sandbox. Sizes are bytes; ``None`` for /tmp or /dev/shm keeps the host's."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    #: Capabilities the worker keeps (names without ``CAP_``); none by default.
    capabilities: tuple[str, ...] = ()
    seccomp_profile: str = "default"
    #: Syscalls the profile restricts that this slot may use anyway (opt-outs by name).
    seccomp_allow: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = DEFAULT_NAMESPACES
    tmp_bytes: int | None = DEFAULT_TMP_BYTES
    shm_bytes: int | None = DEFAULT_SHM_BYTES
    #: Build a private /dev holding only the safe nodes and ``devices``.
    private_dev: bool = True
    devices: tuple[DeviceNode, ...] = ()
    #: Host paths the worker must not see (the agent's state directory, its token file).
    hide_paths: tuple[str, ...] = ()
    #: Paths under ``hide_paths`` shown again at the same place (bind mounts of the host's).
    expose: tuple[Exposed, ...] = ()
    #: tmpfs mounts of the worker's own, made after the hidden paths (one may lie in a directory
    #: shown again: HOME in the worker directory's view).
    private_dirs: tuple[PrivateDir, ...] = ()
    #: Where the private /tmp is shown again (TMPDIR in the worker directory's view): one
    #: size-limited place for the worker's temporary files, not a directory on the host's disk.
    tmp_views: tuple[str, ...] = ()
    #: Shared host directories (/var/tmp) the worker sees as they are but writes to privately: an
    #: overlay whose changes live in a tmpfs of ``tmp_bytes`` of its own (read-only without overlayfs).
    private_views: tuple[str, ...] = ()
    cgroup_view: str = "read-only"
    #: A private /proc where other users' processes are invisible (hidepid=invisible).
    hide_other_processes: bool = True
    #: Size of the tmpfs the launch puts on the worker's HOME (a PrivateDir); None: HOME is the
    #: host directory as it is.
    home_bytes: int | None = None
    #: Host directory for the worker's HOME (made by the agent, owned by ``uid``).
    home: str | None = None
    #: Where ``home`` is bind-mounted inside; None: HOME simply names ``home``.
    home_mount: str | None = None
    hostname: str | None = None
    #: Every host mount read-only inside, except the sandbox's own /tmp, /dev, /dev/shm and HOME.
    read_only_root: bool = False
    #: The init binary that runs as PID 1 of the worker's pid namespace (needed with "pid").
    init: str | None = None

    def __post_init__(self) -> None:
        _check_id(self.uid, "sandbox uid")
        _check_id(self.gid, "sandbox gid")
        for group in self.groups:
            _check_id(group, "sandbox supplementary group")
        for name in self.capabilities:
            capability_number(name)  # raises InvalidRequest naming the unknown capability
        self._check_seccomp()
        self._check_namespaces()
        for what, size in (
            ("tmp_bytes", self.tmp_bytes),
            ("shm_bytes", self.shm_bytes),
            ("home_bytes", self.home_bytes),
        ):
            if size is not None and size < 4096:
                raise InvalidRequest(f"sandbox {what}={size}: a private tmpfs needs at least 4096 bytes")
        if len({node.path for node in self.devices}) != len(self.devices):
            raise InvalidRequest("sandbox devices: the same /dev path is listed twice")
        if self.devices and not self.private_dev:
            raise InvalidRequest("sandbox devices are placed in the private /dev; they need private_dev")
        for private in self.private_dirs:
            if private.size < 4096 or not 0 <= private.mode <= 0o7777:
                raise InvalidRequest(
                    f"sandbox private directory {private.path!r}: a tmpfs needs at least 4096 bytes and "
                    "permission bits (0-7777)"
                )
            _check_id(private.uid, f"sandbox private directory {private.path!r}: owner uid")
            _check_id(private.gid, f"sandbox private directory {private.path!r}: owner gid")
        if (self.tmp_views or self.private_views) and self.tmp_bytes is None:
            raise InvalidRequest(
                "sandbox tmp_views and private_views are as large as the private /tmp; they need tmp_bytes"
            )
        for path in (
            *self.hide_paths,
            *(e.path for e in self.expose),
            *(p.path for p in self.private_dirs),
            *self.tmp_views,
            *self.private_views,
            self.home,
            self.home_mount,
        ):
            if path is not None and (not path.startswith("/") or lexical(path) != path or path == "/"):
                raise InvalidRequest(f"sandbox path {path!r} must be a normalised absolute path other than /")
        for exposed in self.expose:
            if not any(_under(exposed.path, hidden) for hidden in self.hide_paths):
                raise InvalidRequest(
                    f"sandbox expose {exposed.path!r}: no hidden path covers it (expose shows a path "
                    "inside a hidden directory again)"
                )
        if len({e.path for e in self.expose}) != len(self.expose):
            raise InvalidRequest("sandbox expose: the same path is listed twice")
        if self.home_mount is not None and self.home is None:
            raise InvalidRequest(
                "sandbox home_mount names where HOME appears; it needs home (the host directory)"
            )
        if self.hostname is not None and not 0 < len(self.hostname.encode()) <= _MAX_HOSTNAME:
            raise InvalidRequest(f"sandbox hostname {self.hostname!r} must be 1-{_MAX_HOSTNAME} bytes")
        if self.uid == 0:
            self._check_root()

    def _check_seccomp(self) -> None:
        if self.seccomp_profile not in PROFILES:
            raise InvalidRequest(
                f"unknown seccomp profile {self.seccomp_profile!r}; known: {', '.join(sorted(PROFILES))}"
            )
        restricted = restricted_syscalls(self.seccomp_profile)
        for name in self.seccomp_allow:
            if name not in restricted:
                raise InvalidRequest(
                    f"seccomp opt-out {name!r}: profile {self.seccomp_profile!r} does not restrict it "
                    "(an opt-out names a syscall the profile denies)"
                )

    def _check_namespaces(self) -> None:
        unknown = set(self.namespaces) - set(NAMESPACES)
        if unknown:
            raise InvalidRequest(f"unknown namespaces {sorted(unknown)}; known: {', '.join(NAMESPACES)}")
        if self.cgroup_view not in CGROUP_VIEWS:
            raise InvalidRequest(f"cgroup_view {self.cgroup_view!r}: one of {', '.join(CGROUP_VIEWS)}")
        if (self.cgroup_view == "namespace") != ("cgroup" in self.namespaces):
            raise InvalidRequest(
                "cgroup_view 'namespace' and the cgroup namespace go together: the fresh cgroupfs "
                "mounts show the namespace's root, and a cgroup namespace is only useful with them"
            )
        if "mount" not in self.namespaces:
            needs = [
                name
                for name, wanted in (
                    ("a private /tmp", self.tmp_bytes is not None),
                    ("a private /dev/shm", self.shm_bytes is not None),
                    ("a private /dev", self.private_dev),
                    ("hidden paths", bool(self.hide_paths)),
                    ("a HOME mount", self.home_mount is not None),
                    (
                        "private directories",
                        bool(self.private_dirs) or bool(self.tmp_views) or bool(self.private_views),
                    ),
                    ("a read-only or namespaced /sys/fs/cgroup", self.cgroup_view != "host"),
                    ("a private /proc", self.hide_other_processes or "pid" in self.namespaces),
                    ("a read-only root", self.read_only_root),
                )
                if wanted
            ]
            if needs:
                raise InvalidRequest(f"without a mount namespace the sandbox cannot give {', '.join(needs)}")
        if self.hostname is not None and "uts" not in self.namespaces:
            raise InvalidRequest("a sandbox hostname needs the uts namespace")
        if "pid" in self.namespaces and self.init is None:
            raise InvalidRequest(
                "a pid namespace needs an init binary (init=PATH): the worker as PID 1 would ignore "
                "SIGTERM and leave its orphans unreaped"
            )
        if self.init is not None and not os.path.isabs(self.init):
            raise InvalidRequest(f"sandbox init {self.init!r} must be an absolute path")

    def _check_root(self) -> None:
        # uid 0 owns most of the host's files and may signal every root process whatever its
        # capabilities; only these two keep a root worker inside its slot.
        if "pid" not in self.namespaces:
            raise InvalidRequest(
                "a root worker (uid 0) needs a pid namespace: root may signal every root process on "
                "the host, capabilities or not, and hidepid does not hide them from it"
            )
        if not self.read_only_root:
            raise InvalidRequest(
                "a root worker (uid 0) needs read_only_root: it shares the host's file system, most "
                "of which uid 0 owns"
            )

    def to_json(self) -> dict[str, Any]:
        # What dataclasses.asdict gives, without its deep copy of every value (~10x the time): the
        # fields are plain values and tuples of them, and of the flat records above. Each launch
        # and exec probe serialises its sandbox, so this is cheap enough to need no cache.
        body = {name: getattr(self, name) for name in _SPEC_FIELDS}
        for name, fields in _NESTED.items():
            body[name] = tuple({f: getattr(item, f) for f in fields} for item in body[name])
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> SandboxSpec:
        fixed = dict(body)
        for key in (
            "groups",
            "capabilities",
            "seccomp_allow",
            "namespaces",
            "hide_paths",
            "tmp_views",
            "private_views",
        ):
            if key in fixed:
                fixed[key] = tuple(fixed[key])
        if "devices" in fixed:
            fixed["devices"] = tuple(DeviceNode(**node) for node in fixed["devices"])
        if "expose" in fixed:
            fixed["expose"] = tuple(Exposed(**item) for item in fixed["expose"])
        if "private_dirs" in fixed:
            fixed["private_dirs"] = tuple(PrivateDir(**item) for item in fixed["private_dirs"])
        try:
            return cls(**fixed)
        except TypeError as err:
            raise InvalidRequest(f"sandbox spec: {err}") from None


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SandboxSpec))
#: The fields that hold records, with the fields of each record.
_NESTED = {
    name: tuple(f.name for f in dataclasses.fields(kind))
    for name, kind in (("devices", DeviceNode), ("expose", Exposed), ("private_dirs", PrivateDir))
}


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def _check_id(value: int, what: str) -> None:
    if not 0 <= value <= _MAX_ID:
        raise InvalidRequest(f"{what} {value} is not a valid id (0-{_MAX_ID})")
