"""The worker sandbox as the agent decides it: the ``[sandbox]`` configuration, what a request may
leave out of it, and the :class:`SandboxSpec` each slot's worker runs in.

The building blocks live in ``nodeagent.runtime.sandbox`` (made in the launching child before
exec); this module is the policy:

- **identity**: a worker runs as its slot's own uid (and a gid of the same number), allocated by
  the agent from ``uid_range`` and kept in the state database for as long as the slot exists (no
  passwd entry needed, as systemd's DynamicUser); a request may name a host user
  (``worker.user``/``group``/``supplementary_groups``) only where ``allow_named_users`` is set, and
  root only where ``allow_root`` is set, and then gets the root confinement (a pid namespace with an
  init, a read-only root, ``ROOT_CAPABILITIES``);
- **opt-outs** (``worker.sandbox``): syscalls the default seccomp profile denies, no filter,
  capabilities, /tmp and /dev/shm sizes; each must be allowed by the configuration;
- **view**: the state directory (with the API token and the keeper) and the configured paths
  hidden, the slot's devices in its private /dev, /sys/fs/cgroup read-only or namespaced;
- **host support**: what the kernel lacks (``runtime.sandbox.missing_for``) refuses the request
  (422 unsupported) rather than launching a worker less confined than asked.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.agent.sandbox_config import DEFAULT_UID_RANGE, SandboxConfig
from nodeagent.devices.pci import device_node_info
from nodeagent.errors import InvalidRequest, NodeAgentError, Unsupported
from nodeagent.isolation.devices import GPU_CONTROL_NODES
from nodeagent.runtime.launch import resolve_identity
from nodeagent.runtime.sandbox import DeviceNode, SandboxSpec, SandboxSupport, missing_for, probe
from nodeagent.runtime.sandbox.caps import CAPABILITY_NAMES, NEVER_FOR_ROOT, ROOT_CAPABILITIES
from nodeagent.runtime.sandbox.paths import Relation, describe, lexical, meets_hidden, relation
from nodeagent.runtime.sandbox.seccomp import restricted_syscalls
from nodeagent.runtime.sandbox.spec import DEFAULT_NAMESPACES, SAFE_DEV_NAMES, PrivateDir
from nodeagent.runtime.worker_kind import kind_of
from nodeagent.schema.quantity import format_quantity, parse_quantity
from nodeagent.schema.worker import WorkerSandbox, WorkerSpec

_MAX_UID = 2**31 - 1
#: Shared writable places of the host that a worker sees as its own instead: /var/tmp as the host
#: has it with the worker's writes kept in a tmpfs of its own (an overlay: what the host staged
#: there stays readable), /run/lock a small tmpfs (lock files take inodes, not pages).
VAR_TMP = "/var/tmp"  # noqa: S108 - a mount point, not a temporary file
RUN_LOCK = "/run/lock"
RUN_LOCK_BYTES = 1 << 20


def default_init() -> str | None:
    """The dumb-init installed with this package (beside the interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "dumb-init"
    return str(beside) if beside.is_file() else shutil.which("dumb-init")


def _is_root(value: str | int | None) -> bool:
    return value in (0, "root")


def check_private_sizes(spec: WorkerSpec, host_memory_bytes: int) -> None:
    """Refuse (InvalidRequest) a private tmpfs (``/tmp``, ``/dev/shm``, HOME) larger than this
    host's memory: a tmpfs is memory, charged to the slot, and a size no host could fill (1Ei)
    is a typo, not a limit."""
    opt = spec.sandbox
    if opt is None or host_memory_bytes <= 0:
        return
    for name, size in (("tmp_size", opt.tmp_size), ("shm_size", opt.shm_size), ("home_size", opt.home_size)):
        if size is not None and size > host_memory_bytes:
            raise InvalidRequest(
                f"worker.sandbox.{name}: {format_quantity(size)} is more than this host's memory "
                f"({format_quantity(host_memory_bytes)}); a tmpfs is memory charged to the slot: ask for at "
                "most its memory limit"
            )


@dataclass
class SandboxPolicy:
    """The configuration applied to requests; ``support`` is None where no sandbox can be built
    here (the agent is not root): then every worker runs unconfined and ``degraded`` says so."""

    config: SandboxConfig
    #: Host paths every worker is kept from seeing (the state directory, token files).
    hidden: tuple[str, ...]
    support: SandboxSupport | None
    init: str | None = field(default_factory=default_init)
    #: Why the sandbox cannot be given here (empty when it can, or when switched off on purpose).
    unavailable: str = ""

    @classmethod
    def for_host(cls, config: SandboxConfig, hidden: Iterable[Path], *, can_isolate: bool) -> SandboxPolicy:
        paths = tuple(dict.fromkeys(os.path.realpath(str(p)) for p in (*hidden, *config.hide_paths)))
        if not config.enabled:
            return cls(config, paths, None)
        if os.geteuid() != 0 or not can_isolate:
            why = "the agent is not root" if os.geteuid() != 0 else "slots are not isolated on this host"
            return cls(config, paths, None, unavailable=f"worker sandbox: {why}; workers run unconfined")
        return cls(config, paths, probe())

    @property
    def active(self) -> bool:
        return self.config.enabled and self.support is not None

    def degraded(self) -> tuple[str, ...]:
        if not self.config.enabled:
            return ("worker sandbox: switched off ([sandbox] enabled = false); workers are not confined",)
        if self.unavailable:
            return (self.unavailable,)
        assert self.support is not None
        lacking = missing_for(self._probe_spec(), self.support)
        return (f"worker sandbox: this host lacks {'; '.join(lacking)}",) if lacking else ()

    def to_json(self) -> dict[str, Any]:
        """What /v1/node says about the sandbox."""
        return {
            "enabled": self.config.enabled,
            "active": self.active,
            "support": None if self.support is None else self.support.to_json(),
            "uid_range": self.config.uid_range,
            "allow_root": self.config.allow_root,
            "cgroup_view": self.config.cgroup_view,
        }

    # ------------------------------------------------------------------ requests

    def check(self, spec: WorkerSpec) -> None:
        """Refuse a worker spec the configuration does not allow (InvalidRequest) or this host
        cannot confine as asked (Unsupported), before anything is placed or launched."""
        self.check_paths(spec)
        if not self.active:
            return
        self._check_identity(spec)
        opt = spec.sandbox or WorkerSandbox()
        denied = [n for n in opt.allow_syscalls if n not in self.config.allowed_syscalls]
        if denied:
            restricted = restricted_syscalls("default")
            unknown = [n for n in denied if n not in restricted]
            if unknown:
                raise InvalidRequest(
                    f"worker.sandbox.allow_syscalls: {', '.join(unknown)} is not denied by the default "
                    f"seccomp profile (an opt-out names a call it denies: {', '.join(sorted(restricted))})"
                )
            raise InvalidRequest(
                f"worker.sandbox.allow_syscalls: {', '.join(denied)} not allowed on this host; the agent's "
                f"[sandbox] allowed_syscalls lists {_listed(self.config.allowed_syscalls)}"
            )
        if opt.seccomp == "unconfined" and not self.config.allow_unconfined_seccomp:
            raise InvalidRequest(
                'worker.sandbox.seccomp "unconfined" is not allowed on this host; the agent\'s '
                "[sandbox] allow_unconfined_seccomp is false"
            )
        allowed_caps = {c.upper().removeprefix("CAP_") for c in self.config.allowed_capabilities}
        for name in opt.capabilities:
            bare = name.removeprefix("CAP_")
            if bare not in CAPABILITY_NAMES:
                raise InvalidRequest(f"worker.sandbox.capabilities: unknown capability {name!r}")
            if bare in NEVER_FOR_ROOT:
                raise InvalidRequest(
                    f"worker.sandbox.capabilities: {bare} undoes the slot as a boundary and is never given"
                )
            if bare not in allowed_caps and not (_is_root(spec.user) and bare in ROOT_CAPABILITIES):
                raise InvalidRequest(
                    f"worker.sandbox.capabilities: {bare} not allowed on this host; the agent's [sandbox] "
                    f"allowed_capabilities lists {_listed(sorted(allowed_caps))}"
                )
        if spec.workdir is not None and self._unreachable(spec.workdir):
            raise InvalidRequest(
                f"worker.workdir {spec.workdir!r} is not reachable inside the sandbox (it has its own "
                "/tmp, /dev and /dev/shm); use a directory outside them"  # noqa: S108
            )
        assert self.support is not None
        lacking = missing_for(self.spec_for(spec, uid=_MAX_UID, devices=()), self.support)
        if lacking:
            raise Unsupported(
                f"this host cannot confine the worker as asked: it lacks {'; '.join(lacking)}. Use a newer "
                "kernel, or set [sandbox] enabled = false (unsafe: workers then run unconfined)"
            )

    def _check_identity(self, spec: WorkerSpec) -> None:
        named = spec.user is not None or spec.group is not None or bool(spec.supplementary_groups)
        if _is_root(spec.user):
            if not self.config.allow_root:
                raise InvalidRequest(
                    "worker.user: running as root is not allowed on this host; leave user out (the slot "
                    "gets its own unprivileged uid), or set [sandbox] allow_root = true"
                )
        elif named and not self.config.allow_named_users:
            raise InvalidRequest(
                "worker.user/group/supplementary_groups: naming a host user or group is not allowed on this "
                "host (the slot's worker gets a uid of its own); leave them out, or set [sandbox] "
                "allow_named_users = true"
            )
        if spec.user is not None and not _is_root(spec.user):
            uid = resolve_identity(spec).uid
            low, high = self.config.uid_bounds()
            if uid is not None and (uid == 0 or low <= uid <= high):
                raise InvalidRequest(
                    f"worker.user {spec.user!r} is uid {uid}, "
                    + ("root" if uid == 0 else f"in the agent's own range [sandbox] uid_range {low}-{high}")
                    + "; leave user out to get the slot's own uid"
                )

    def check_paths(self, spec: WorkerSpec) -> None:
        """Refuse (InvalidRequest) a host path of the request that is, lies inside or (for a
        container mount's source, which shows what is below it) contains a hidden path, whatever
        its spelling (runtime.sandbox.paths); also with the sandbox off, where a container's mounts
        are the one way a worker that is not root reaches the state database."""
        if spec.workdir is not None:
            met = meets_hidden(spec.workdir, self.hidden, above=False)
            if met is not None:
                raise InvalidRequest(describe("worker.workdir", spec.workdir, met))
        for index, mount in enumerate(kind_of(spec).mounts(spec)):
            met = meets_hidden(mount.source, self.hidden)
            if met is not None:
                raise InvalidRequest(describe(f"worker.container.mounts[{index}].source", mount.source, met))
            if lexical(mount.target) == "/":
                raise InvalidRequest(
                    f"worker.container.mounts[{index}].target {mount.target!r} is the container's root; "
                    "mount below it"
                )

    def check_arguments(self, resolved: WorkerSpec) -> None:
        """Refuse (InvalidRequest) a command whose program or arguments name a file under the
        places the sandbox replaces (``/tmp``, ``/dev/shm``, ``/dev``) or hides: the worker would
        not find it there (its own ``/tmp`` is empty), and fail at every start. ``resolved``: the
        spec with its preset filled in (runtime.presets.resolve), so a preset's own arguments
        (a model repository) are weighed too. An argument ``--flag=/path`` counts as its path."""
        if not self.active or not kind_of(resolved).runs_in_sandbox or not resolved.command:
            return
        for index, arg in enumerate(resolved.command):
            for path in (arg, arg.partition("=")[2]):
                if not path.startswith("/"):
                    continue
                where = (
                    "the sandbox gives the worker its own /tmp, /dev and /dev/shm"
                    if self._unreachable(path)
                    else "the agent hides it from every worker"
                    if meets_hidden(path, self.hidden, above=False) is not None
                    else None
                )
                if where is not None:
                    name = "program" if index == 0 else f"argument {index}"
                    raise InvalidRequest(
                        f"worker command: the {name} {arg!r} names {path}, which the worker cannot reach "
                        f"({where}); put the file in a directory the worker can read, outside them"
                    )

    def _unreachable(self, path: str) -> bool:
        covered = ("/tmp", "/dev/shm", "/dev")  # noqa: S108 - mount points, not files
        return meets_hidden(path, covered, above=False) is not None

    # ------------------------------------------------------------------ the spec

    def spec_for(self, spec: WorkerSpec, *, uid: int, devices: Iterable[str]) -> SandboxSpec:
        """The sandbox of ``spec``'s worker: ``uid`` is the slot's own (used unless the request names
        a user); ``devices`` the slot's device nodes (host paths)."""
        opt = spec.sandbox or WorkerSandbox()
        root = _is_root(spec.user)
        if spec.user is not None or spec.group is not None or spec.supplementary_groups:
            identity = resolve_identity(spec)
            worker_uid = 0 if root else (identity.uid if identity.uid is not None else uid)
            gid = identity.gid if identity.gid is not None else (0 if root else worker_uid)
            groups = identity.groups or ()
        else:
            worker_uid, gid, groups = uid, uid, ()
        namespaces = list(DEFAULT_NAMESPACES)
        if self.config.cgroup_view == "namespace":
            namespaces.append("cgroup")
        capabilities = tuple(c.removeprefix("CAP_") for c in opt.capabilities)
        if root:
            namespaces.append("pid")
            capabilities = tuple(dict.fromkeys((*ROOT_CAPABILITIES, *capabilities)))
        tmp_bytes = opt.tmp_size or parse_quantity(self.config.tmp_size)
        return SandboxSpec(
            uid=worker_uid,
            gid=gid,
            groups=tuple(groups),
            capabilities=capabilities,
            seccomp_profile=opt.seccomp,
            seccomp_allow=tuple(opt.allow_syscalls),
            namespaces=tuple(namespaces),
            tmp_bytes=tmp_bytes,
            shm_bytes=opt.shm_size or parse_quantity(self.config.shm_size),
            home_bytes=opt.home_size or parse_quantity(self.config.home_size),
            private_views=self._shared_places(VAR_TMP) if tmp_bytes is not None else (),
            private_dirs=tuple(
                PrivateDir(path, RUN_LOCK_BYTES, 0o1777) for path in self._shared_places(RUN_LOCK)
            ),
            devices=device_nodes(devices, worker_uid, gid),
            hide_paths=self.hidden,
            cgroup_view=self.config.cgroup_view,
            read_only_root=root,
            init=self.init if root else None,
        )

    def _shared_places(self, path: str) -> tuple[str, ...]:
        """``path`` (a directory every user may write on the host, shared between slots) when the
        host has it and it holds no hidden path (a state directory there stays hidden, and what is
        shown again of it must stay reachable)."""
        if not os.path.isdir(path) or any(
            relation(os.path.realpath(path), hidden) is Relation.ABOVE for hidden in self.hidden
        ):
            return ()
        return (path,)

    def _probe_spec(self) -> SandboxSpec:
        return SandboxSpec(
            uid=_MAX_UID,
            gid=_MAX_UID,
            cgroup_view=self.config.cgroup_view,
            namespaces=(
                *DEFAULT_NAMESPACES,
                *(("cgroup",) if self.config.cgroup_view == "namespace" else ()),
            ),
        )


def device_nodes(paths: Iterable[str], uid: int, gid: int) -> tuple[DeviceNode, ...]:
    """The slot's device nodes for its private /dev, owned by its worker; a path the sandbox makes
    itself (/dev/null, ...) or that is gone from the host is left out (isolation already refused a
    request for a device that does not exist)."""
    nodes = []
    for path in dict.fromkeys(paths):
        name = path.removeprefix("/dev/").split("/")[0]
        if name in SAFE_DEV_NAMES:
            continue
        try:
            number = device_node_info(path)
        except NodeAgentError:
            continue
        nodes.append(DeviceNode(path, number.type, number.major, number.minor, 0o660, uid, gid))
    return tuple(nodes)


def slot_device_paths(paths: Iterable[str], gpu: bool) -> tuple[str, ...]:
    """What isolation allows the slot: its own device paths, plus CUDA's control nodes for a GPU slot
    where the host has them (isolation adds the same to the device cgroup)."""
    extra = [p for p in GPU_CONTROL_NODES if gpu and os.path.exists(p)]
    return tuple(dict.fromkeys((*paths, *extra)))


def taken_by_host(uid: int) -> bool:
    """A uid the host already uses for a user of its own (the agent never hands those out)."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _listed(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names) if names else "nothing"


__all__ = [
    "DEFAULT_UID_RANGE",
    "SandboxConfig",
    "SandboxPolicy",
    "default_init",
    "device_nodes",
    "slot_device_paths",
    "taken_by_host",
]
