"""The worker's view of the file system, built with mount(2) in a child that has its own mount
namespace (unshare(CLONE_NEWNS)), before it drops root.

Every call here changes only the calling process's mount namespace, and only after
:func:`make_private` has cut propagation: nothing mounted here reaches the host, and nothing
mounted here outlives the namespace, which the kernel frees when the slot's last process exits,
however it exits. The private /tmp, /dev/shm and /dev are tmpfs instances that live in memory and
vanish with their last mount; their pages are charged to the memory cgroup of the task that
touches them, which is the worker in its slot (the child joined the slot's cgroups before it got
here), so a worker filling /tmp meets its own memory limit, not the host's.

No ``mount`` binary and no fork: libc's mount(2), umount2(2) and the mount_setattr(2) syscall
through ctypes, so the work is a handful of system calls on the exec path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent import procfmt
from nodeagent.errors import Unsupported
from nodeagent.runtime.sandbox._sys import check, libc, mount_setattr_number
from nodeagent.runtime.sandbox.spec import DeviceNode, PrivateDir

# include/uapi/linux/mount.h
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2
MOUNT_ATTR_RDONLY = 1
AT_FDCWD = -100
AT_RECURSIVE = 0x8000

#: Mount points of the private tmpfs instances (mount points, not temporary files).
TMP = "/tmp"  # noqa: S108
DEV_SHM = "/dev/shm"  # noqa: S108
#: The nodes every process expects in /dev (name, major, minor); all mode 0666 like the host's.
SAFE_NODES = (
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
)
#: Links every process expects in /dev.
DEV_LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
)
_DEV_SIZE = 64 << 10  # nodes and links take inodes, not pages
_HIDE_OPTIONS = "size=4k,nr_inodes=2,mode=0555"
# Per-mount flags as /proc/PID/mountinfo's fifth field spells them, for remounts that must keep them.
_MOUNT_FLAG_NAMES = {
    "ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
}  # fmt: skip


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    try:
        return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


#: Linux 5.8 made each proc mount its own instance with its own options; before it, hidepid on a
#: "private" /proc changed the host's /proc too, so the sandbox refuses to use it there.
PER_MOUNT_PROC_OPTIONS = _kernel_at_least(5, 8)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(
        libc.mount(
            None if source is None else os.fsencode(source),
            os.fsencode(target),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {fstype or 'bind'} {source or ''} on {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    check(libc.umount2(os.fsencode(target), flags), f"umount {target}")


def make_private(path: str = "/") -> None:
    """Stop mount propagation to and from the host for ``path`` and everything below it."""
    mount(None, path, None, MS_REC | MS_PRIVATE)


def make_slave(path: str = "/") -> None:
    """Receive what the host mounts and unmounts at ``path`` and below, and send nothing back."""
    mount(None, path, None, MS_REC | MS_SLAVE)


def mount_tmpfs(target: str, size: int, mode: int = 0o1777, flags: int = MS_NOSUID | MS_NODEV) -> None:
    mount("tmpfs", target, "tmpfs", flags, f"size={size},mode={mode:o}")


def mount_private_dir(private: PrivateDir) -> None:
    """A tmpfs of the worker's own on ``private.path`` (which must exist, unless it lies in the
    worker's private /tmp, a tmpfs of its own made moments ago), owned as asked."""
    if private.path.startswith(TMP + "/"):
        os.makedirs(private.path, mode=0o700, exist_ok=True)
    mount(
        "tmpfs",
        private.path,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={private.size},mode={private.mode:o},uid={private.uid},gid={private.gid}",
    )


def private_overlay(path: str, size: int) -> str:
    """Show the host's directory ``path`` as it is, with the worker's changes going to a tmpfs of
    its own of ``size`` bytes: an overlay whose lower layer is the host's directory (reached
    through a descriptor taken before the tmpfs covers it) and whose upper layer lives in that
    tmpfs, under the overlay, out of the worker's reach. What the host staged there stays readable;
    nothing a worker writes there reaches the host or another slot. Where the kernel has no
    overlayfs the directory is shown read-only instead. Returns "overlay" or "read-only"."""
    lower = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
        umask = os.umask(0)
        try:
            os.mkdir(f"{path}/upper", stat.S_IMODE(os.fstat(lower).st_mode))  # the overlay's root's mode
            os.mkdir(f"{path}/work", 0o700)
        finally:
            os.umask(umask)
        try:
            mount(
                "overlay",
                path,
                "overlay",
                MS_NOSUID | MS_NODEV,
                f"lowerdir=/proc/self/fd/{lower},upperdir={path}/upper,workdir={path}/work",
            )
        except OSError as err:
            if err.errno not in (errno.ENODEV, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            umount(path, MNT_DETACH)
            bind(f"/proc/self/fd/{lower}", path, flags=MS_RDONLY | MS_NOSUID | MS_NODEV)
            return "read-only"
        return "overlay"
    finally:
        os.close(lower)


def bind(source: str, target: str, *, flags: int = 0, recursive: bool = False) -> None:
    """Bind ``source`` on ``target``, then set ``flags`` (MS_RDONLY, MS_NOSUID, ...) on the new
    mount: the first call ignores them, and the remount also clears a read-only flag the bind
    copied from a read-only source mount."""
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    mount(None, target, None, MS_BIND | MS_REMOUNT | flags)


# -- /proc ---------------------------------------------------------------------------------------


def mount_private_proc(*, hide_other_processes: bool) -> None:
    """A new proc instance on /proc. In a pid namespace it shows that namespace's processes; with
    ``hide_other_processes`` (hidepid=invisible) a process sees only the /proc/PID directories of
    processes it could ptrace-read: its own uid's, unless a capability says more."""
    if hide_other_processes and not PER_MOUNT_PROC_OPTIONS:
        raise Unsupported(
            f"hidepid on a private /proc needs Linux 5.8 or later (this is {os.uname().release}): "
            "before it the option would change the host's /proc"
        )
    mount(
        "proc",
        "/proc",
        "proc",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        "hidepid=invisible" if hide_other_processes else None,
    )


# -- read-only mounts ------------------------------------------------------------------------------


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def make_read_only(path: str, mountinfo: str | None = None) -> None:
    """Make ``path`` and every mount below it read-only in this namespace: one mount_setattr(2)
    call with AT_RECURSIVE (Linux 5.12+), else a read-only remount of each mount in turn."""
    number = mount_setattr_number()
    if number is not None:
        attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
        result = libc.syscall(
            number, AT_FDCWD, os.fsencode(path), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)
        )
        if result == 0:
            return
        if ctypes.get_errno() != errno.ENOSYS:
            check(result, f"mount_setattr {path} read-only")
    # Not through nodeagent.kernelfs: this runs in the forked child, where a failure must stay the
    # OSError its step reports; nodeagent.procfmt parses the text.
    make_read_only_each(
        path, mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    )


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/PID/mountinfo: the fields the sandbox uses."""

    mount_point: str
    root: str
    flags: int
    fstype: str
    source: str
    super_options: str


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for mount in procfmt.parse_mountinfo(text):
        flags = 0
        for option in mount.options.split(","):
            flags |= _MOUNT_FLAG_NAMES.get(option, 0)
        entries.append(
            MountEntry(mount.mount_point, mount.root, flags, mount.fstype, mount.source, mount.super_options)
        )
    return entries


def mounts_under(path: str, entries: Iterable[MountEntry]) -> list[MountEntry]:
    """Mounts at ``path`` or below, parents before children (mountinfo order)."""
    prefix = path.rstrip("/") + "/"
    return [entry for entry in entries if entry.mount_point == path or entry.mount_point.startswith(prefix)]


def make_read_only_each(path: str, mountinfo: str) -> None:
    """The pre-5.12 way: remount each mount under ``path`` read-only, keeping its other flags (a
    bind remount sets every per-mount flag at once, so leaving one out would clear it)."""
    for entry in mounts_under(path, parse_mountinfo(mountinfo)):
        with contextlib.suppress(FileNotFoundError):  # a mount under one hidden by a later one
            mount(None, entry.mount_point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | entry.flags)


# -- /sys/fs/cgroup ----------------------------------------------------------------------------------


def cgroup_namespace_view(root: str, mountinfo: str) -> None:
    """Replace the cgroup file systems under ``root`` with fresh read-only ones, rooted at this
    process's cgroup namespace (the caller has joined the slot's cgroups and then unshared
    CLONE_NEWCGROUP): the worker sees its own slot as the whole tree and nothing of the host's.
    Pure v2 has one cgroup2 mount at ``root``; v1 and hybrid hosts have a tmpfs there holding one
    mount per hierarchy, rebuilt here with the same controllers and the same symlinks."""
    entries = mounts_under(root, parse_mountinfo(mountinfo))
    top = [entry for entry in entries if entry.mount_point == root]
    if not top:
        raise Unsupported(f"no file system is mounted on {root}; nothing to give the worker a view of")
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
    if top[-1].fstype == "cgroup2":
        umount(root, MNT_DETACH)
        mount("cgroup2", root, "cgroup2", flags)
        return
    links = {
        name: os.readlink(f"{root}/{name}") for name in os.listdir(root) if os.path.islink(f"{root}/{name}")
    }
    hierarchies = [
        entry for entry in entries if entry.fstype in ("cgroup", "cgroup2") and entry.mount_point != root
    ]
    umount(root, MNT_DETACH)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=755")
    for entry in hierarchies:
        os.makedirs(entry.mount_point, exist_ok=True)
        options = ",".join(opt for opt in entry.super_options.split(",") if opt not in ("rw", "ro"))
        mount(entry.fstype, entry.mount_point, entry.fstype, flags, options or None)
    for name, target in links.items():
        os.symlink(target, f"{root}/{name}")
    mount(None, root, None, MS_REMOUNT | flags)


# -- /dev -----------------------------------------------------------------------------------------


def build_private_dev(devices: Sequence[DeviceNode], *, shm_bytes: int | None) -> list[tuple[str, str]]:
    """Put a tmpfs on /dev holding the safe nodes, a private devpts, the usual links and
    ``devices``; with ``shm_bytes``, a fresh tmpfs on /dev/shm too. Returns (node, how) for each
    node: "mknod" (the node has the owner and mode its spec asks for: the slot's uid on its own
    devices, whatever the host's node allows), or "bind" where the slot's device cgroup refuses
    mknod (an allow-list granting read/write only, as a slot made by an agent before 'm' was part
    of it has), in which case the host's node is bind-mounted and keeps the host's owner and mode."""
    host_dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        made = build_base_dev(host_dev)
        made += add_devices(devices, host_dev)
    finally:
        os.close(host_dev)
    if shm_bytes is not None:
        mount_tmpfs(DEV_SHM, shm_bytes)
    return made


def build_base_dev(host_dev: int) -> list[tuple[str, str]]:
    """The part of :func:`build_private_dev` that is the same for every worker: the tmpfs on /dev
    with the safe nodes, /dev/pts (a devpts instance of its own), the usual links and the empty
    /dev/shm mount point. ``host_dev`` is an O_PATH descriptor on the host's /dev, taken before the
    tmpfs covers it (a node the device cgroup refuses to mknod is bound from there)."""
    # With no umask, mknod and mkdir give the modes asked for, without a chmod each.
    umask = os.umask(0)
    try:
        mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC | MS_STRICTATIME, f"size={_DEV_SIZE},mode=755")
        made = [
            (
                f"/dev/{name}",
                _make_node(
                    f"/dev/{name}", stat.S_IFCHR, major, minor, mode=0o666, uid=0, gid=0, host_dev=host_dev
                ),
            )
            for name, major, minor in SAFE_NODES
        ]
        os.mkdir("/dev/pts", 0o755)
        os.mkdir(DEV_SHM, 0o1777)  # what /dev/shm always is: world-writable and sticky
    finally:
        os.umask(umask)
    # A devpts instance of its own: the worker's pseudo-terminals are not the host's (ptmxmode
    # makes pts/ptmx usable by any uid, as /dev/ptmx is on the host).
    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    for name, target in DEV_LINKS:
        os.symlink(target, f"/dev/{name}")
    return made


def add_devices(devices: Sequence[DeviceNode], host_dev: int) -> list[tuple[str, str]]:
    """The slot's own ``devices`` in the private /dev that :func:`build_base_dev` made, by mknod
    from inside the slot's device cgroup (or bound from ``host_dev`` where it refuses mknod)."""
    made = []
    umask = os.umask(0)
    try:
        for node in devices:
            kind = stat.S_IFCHR if node.type == "c" else stat.S_IFBLK
            parent = os.path.dirname(node.path)
            if parent != "/dev":
                os.makedirs(parent, mode=0o755, exist_ok=True)
            how = _make_node(
                node.path,
                kind,
                node.major,
                node.minor,
                mode=node.mode,
                uid=node.uid,
                gid=node.gid,
                host_dev=host_dev,
            )
            made.append((node.path, how))
    finally:
        os.umask(umask)
    return made


def _make_node(
    path: str, kind: int, major: int, minor: int, *, mode: int, uid: int, gid: int, host_dev: int
) -> str:
    try:
        os.mknod(path, kind | mode, os.makedev(major, minor))
    except PermissionError:
        # The device cgroup refuses mknod: show the host's node instead, reached through a
        # descriptor on the host's /dev taken before the tmpfs covered it. Never a chown or chmod
        # of it: the host's node is the host's (other slots and users rely on its owner and mode).
        host_path = f"/proc/self/fd/{host_dev}/{path.removeprefix('/dev/')}"
        if not _same_node(host_path, kind, major, minor):
            raise PermissionError(
                errno.EPERM,
                f"the device cgroup refuses mknod of {path} ({major}:{minor}) and the host has no such "
                "node to bind instead; allow mknod ('m') for it in the slot's device rules",
            ) from None
        with open(path, "x"):
            pass
        bind(host_path, path, flags=MS_NOSUID | MS_NOEXEC)
        return "bind"
    if uid or gid:  # made by root, so owned by root unless asked otherwise
        os.chown(path, uid, gid)
    return "mknod"


def _same_node(path: str, kind: int, major: int, minor: int) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_IFMT(info.st_mode) == kind and info.st_rdev == os.makedev(major, minor)


# -- hidden paths and HOME -------------------------------------------------------------------------


def open_exposed(expose: Sequence[tuple[str, bool]]) -> dict[str, tuple[int, bool]]:
    """O_PATH descriptors on the host's ``(path, writable)`` pairs to show again inside hidden
    directories, taken before any mount covers them (the private /tmp covers a state directory
    under /tmp before the hiding step). Opened after unshare(CLONE_NEWNS): a bind mount's source
    must be a mount of the caller's own namespace (EINVAL otherwise). The caller closes them
    (:func:`close_exposed`)."""
    handles: dict[str, tuple[int, bool]] = {}
    try:
        for path, writable in expose:
            handles[path] = (os.open(path, os.O_PATH | os.O_CLOEXEC), writable)
    except OSError:
        close_exposed(handles)
        raise
    return handles


def close_exposed(handles: Mapping[str, tuple[int, bool]]) -> None:
    for fd, _ in handles.values():
        os.close(fd)


def hide(paths: Iterable[str], exposed: Mapping[str, tuple[int, bool]] | None = None) -> list[str]:
    """Cover each existing path with something empty and read-only: a tiny tmpfs for a directory,
    /dev/null for a file. Returns the paths hidden (a path that does not exist has nothing to hide).

    ``exposed`` (from :func:`open_exposed`): paths inside hidden directories shown again at the same
    place, bound from their descriptors onto mount points made in the covering tmpfs, whose
    directories are traverse-only (0711: the worker reaches what it was given without listing its
    neighbours); the tmpfs is made read-only once they are in. One whose hidden directory is no
    longer there (under the private /tmp) gets its mount point made where it was."""
    exposed = exposed or {}
    placed: set[str] = set()
    hidden = []
    for path in paths:
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        inside = {p: h for p, h in exposed.items() if p.startswith(path.rstrip("/") + "/")}
        if is_dir and inside:
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            mount("tmpfs", path, "tmpfs", flags, f"size=64k,nr_inodes={16 + 8 * len(inside)},mode=0711")
            for where, (fd, writable) in inside.items():
                _place(where, fd, writable)
            mount(None, path, None, MS_REMOUNT | MS_RDONLY | flags)
            placed.update(inside)
        elif is_dir:
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, _HIDE_OPTIONS)
        else:
            # Not nodev: the file now reads as /dev/null, which nodev would refuse to open.
            bind("/dev/null", path, flags=MS_RDONLY | MS_NOSUID | MS_NOEXEC)
        hidden.append(path)
    for where, (fd, writable) in exposed.items():
        if where not in placed:
            _place(where, fd, writable)
    return hidden


def _traverse_only_dirs(path: str) -> None:
    """Make ``path`` and its missing parents 0711 each (os.makedirs gives its mode to the last one
    only): the worker passes through to what it was given and lists none of them."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory, 0o711)


def _place(path: str, fd: int, writable: bool) -> None:
    """A mount point at ``path`` (and traverse-only directories above it where missing), and the
    host's file or directory behind ``fd`` bound on it."""
    umask = os.umask(0)  # the modes asked for, whatever the launching process's umask
    try:
        _traverse_only_dirs(os.path.dirname(path))
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o711)
        else:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o444))
    finally:
        os.umask(umask)
    keep = MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY | MS_NOEXEC)
    bind(f"/proc/self/fd/{fd}", path, flags=keep)


def mount_home(host_dir: str, mount_point: str) -> None:
    """Bind the worker's HOME (made by the agent, owned by the worker) at ``mount_point``,
    writable even under a read-only root, without set-id programs or device nodes."""
    bind(host_dir, mount_point, flags=MS_NOSUID | MS_NODEV, recursive=True)
