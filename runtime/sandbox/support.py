"""What this host's kernel offers the sandbox, for `nodeagent doctor`, `GET /v1/node`, and for
allocate to refuse a request that needs what is missing.

:func:`probe` reads files only (under an injectable /proc root, so tests use fake trees);
:func:`probe_live` forks a child that really tries each piece, for doctor, since a file can say a
feature exists while a security module or a container runtime above us refuses it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import DiscoveryError
from nodeagent.kernelfs import Procfs
from nodeagent.runtime.sandbox import mounts, seccomp
from nodeagent.runtime.sandbox._sys import (
    CLONE_NEWCGROUP,
    CLONE_NEWIPC,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUTS,
    check,
    libc,
)
from nodeagent.runtime.sandbox.spec import SandboxSpec

#: /proc/self/ns entry of each namespace the sandbox may use.
NAMESPACE_FILES = {
    "mount": "mnt",
    "pid": "pid",
    "ipc": "ipc",
    "uts": "uts",
    "cgroup": "cgroup",
    "user": "user",
}


@dataclass(frozen=True)
class SandboxSupport:
    kernel: str
    #: Namespaces this kernel has (of mount, pid, ipc, uts, cgroup, user).
    namespaces: frozenset[str]
    #: max_user_namespaces > 0 (and Debian's unprivileged_userns_clone is not 0).
    user_namespaces: bool
    #: seccomp in filter mode, able to return errno and kill the process.
    seccomp_filter: bool
    #: hidepid on a private proc instance (Linux 5.8+; before it the option is host-wide).
    hidepid: bool
    #: mount_setattr(2): read-only recursively in one call (Linux 5.12+; older kernels remount
    #: each mount, which works but costs more).
    mount_setattr: bool

    def to_json(self) -> dict[str, object]:
        return {
            "kernel": self.kernel,
            "namespaces": sorted(self.namespaces),
            "user_namespaces": self.user_namespaces,
            "seccomp_filter": self.seccomp_filter,
            "hidepid": self.hidepid,
            "mount_setattr": self.mount_setattr,
        }



def _release_at_least(release: str, major: int, minor: int) -> bool:
    parts = release.split(".")
    try:
        return (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def probe(proc_root: Path = Path("/proc")) -> SandboxSupport:
    """What the kernel behind ``proc_root`` offers, from its files alone."""
    procfs = Procfs(proc_root)

    def read(rel: str) -> str | None:
        try:
            return procfs.read_text(rel)
        except DiscoveryError:
            return None  # unreadable is as good as absent: the feature is not offered

    release = read("sys/kernel/osrelease") or ""
    namespaces = frozenset(
        name for name, entry in NAMESPACE_FILES.items() if os.path.lexists(proc_root / "self/ns" / entry)
    )
    max_userns = read("sys/user/max_user_namespaces") or "0"
    debian_switch = read("sys/kernel/unprivileged_userns_clone") or "1"
    actions = (read("sys/kernel/seccomp/actions_avail") or "").split()
    return SandboxSupport(
        kernel=release,
        namespaces=namespaces,
        user_namespaces="user" in namespaces
        and max_userns.isdigit()
        and int(max_userns) > 0
        and debian_switch != "0",
        seccomp_filter={"errno", "kill_process", "allow"} <= set(actions),
        hidepid=_release_at_least(release, 5, 8),
        mount_setattr=_release_at_least(release, 5, 12),
    )


def missing_for(spec: SandboxSpec, support: SandboxSupport) -> list[str]:
    """What ``spec`` needs that the host lacks, one phrase each; empty when it can be built."""
    missing = [f"the {name} namespace" for name in spec.namespaces if name not in support.namespaces]
    if spec.seccomp_profile != "unconfined" and not support.seccomp_filter:
        missing.append("seccomp filter mode with errno and kill_process actions")
    if spec.hide_other_processes and not support.hidepid:
        missing.append(f"hidepid on a private /proc (Linux 5.8+, this is {support.kernel or 'unknown'})")
    return missing


def probe_live() -> dict[str, str]:
    """Try each piece in a forked child as the caller (root for a full answer): unshare of each
    namespace, a tmpfs mount, a hidepid proc, a seccomp filter that must refuse mount(2).
    Returns piece -> "ok" or the error. The child touches nothing outside its own namespaces."""

    program = seccomp.filter_for("default")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child; its results come back through the pipe
        results: dict[str, str] = {}
        try:
            os.close(read_end)
            for name, flag in (("ipc", CLONE_NEWIPC), ("uts", CLONE_NEWUTS), ("cgroup", CLONE_NEWCGROUP),
                               ("pid", CLONE_NEWPID), ("mount", CLONE_NEWNS)):  # fmt: skip
                results[f"namespace {name}"] = _attempt(functools.partial(_unshare, flag))
            if results["namespace mount"] == "ok":
                results["private mounts"] = _attempt(lambda: mounts.make_private("/"))
                results["tmpfs"] = _attempt(lambda: mounts.mount_tmpfs(mounts.TMP, 1 << 20))
                results["hidepid /proc"] = _attempt(
                    lambda: mounts.mount_private_proc(hide_other_processes=True)
                )
            if program is not None:
                results["seccomp filter"] = _attempt(lambda: seccomp.install(program))
                refused = libc.umount2(os.fsencode(mounts.TMP), 0) == -1 and _errno() == errno.EPERM
                results["seccomp refuses umount2"] = "ok" if refused else "umount2 was not refused"
            os.write(write_end, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    with contextlib.closing(os.fdopen(read_end, "rb")) as reader:
        chunks.append(reader.read())
    os.waitpid(pid, 0)
    body = b"".join(chunks)
    return json.loads(body) if body else {"probe": "the probing child died before it answered"}


def _unshare(flag: int) -> None:
    check(libc.unshare(flag), "unshare")


def _errno() -> int:
    return ctypes.get_errno()


def _attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as err:
        return f"{errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}"
    except Exception as err:  # noqa: BLE001 - the probe reports every failure as text
        return str(err)
    return "ok"
