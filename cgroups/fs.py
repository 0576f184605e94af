"""The one gateway to cgroupfs: every read, write, mkdir and rmdir of a cgroup file goes through here.

Each function takes the cgroup mount (``root``) and a path relative to it, and refuses any path that
would leave the mount: an absolute path, a ``..`` component, or a symlink that resolves elsewhere.
The readers also take a :class:`CgroupDir` (a directory :func:`resolve_dir` has already checked)
and a bare file name: a scrape reading a dozen files of one cgroup then checks the directory once,
not each file, and opens the files with ``O_NOFOLLOW`` so a symlink put in a file's place is refused.
OSErrors are translated into :class:`~nodeagent.errors.CgroupError` (keeping ``errno``) with the
file and the value quoted, so a refused write reads like ``writing '0-3' to cpuset/x/cpuset.cpus``.
"""

from __future__ import annotations

import errno
import functools
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nodeagent.errors import CgroupError, DiscoveryError, translate_os_error
from nodeagent.kernelfs import Procfs, read_all
from nodeagent.procfmt import parse_mountinfo


def join(*parts: str) -> str:
    """Join relative cgroup path parts, skipping empty ones (``join("", "cgroup.procs")``)."""
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


@dataclass(frozen=True)
class CgroupDir:
    """A cgroup directory that :func:`resolve_dir` checked: files in it are named, not pathed."""

    path: Path


def check_relative(relpath: str | PurePosixPath, root: Path | None = None) -> str:
    """The lexical half of the guard: refuse an absolute path or a ``..`` component."""
    text = str(relpath)
    if text.startswith("/") or ".." in text.split("/"):
        where = "" if root is None else f" under {root}"
        raise CgroupError(
            f"refusing cgroup path {text!r}{where}: it must be relative and must not contain '..'",
            errno_=errno.EINVAL,
        )
    return text


def resolve(root: Path, relpath: str | PurePosixPath) -> Path:
    """Return ``root/relpath``, refusing anything that would not stay under ``root``.

    On a cgroup filesystem the lexical check is the whole guard: kernfs has no symlinks (nothing
    can create one in it), so a relative path without ``..`` cannot leave it, and a realpath per
    file access (an allocate makes about a hundred) would only cost time. Anywhere else (a fake
    tree in a test) a symlink could point out, so the resolved path is compared with the root's.
    """
    return Path(_checked(root, relpath))


def _checked(root: Path, relpath: str | PurePosixPath) -> str:
    """:func:`resolve` as a string, for this module's own reads and writes: building a ``Path`` per
    access cost more than the system calls (syncing the host's cpusets at 500 slots reads ~1,500
    files; issue 23)."""
    rel = check_relative(relpath, root)
    root_text = str(root)
    real_root, kernfs = _root_facts(root_text)
    candidate = (root_text.rstrip("/") + "/" + rel) if rel else root_text
    if kernfs:
        return candidate
    real = real_path(Path(candidate))
    if real != real_root and not real.startswith(real_root.rstrip("/") + "/"):
        raise CgroupError(
            f"refusing cgroup path {str(relpath)!r}: it resolves to {real}, outside the cgroup root "
            f"{real_root}",
            errno_=errno.EXDEV,
        )
    return candidate


@functools.lru_cache(maxsize=64)
def _root_facts(root: str) -> tuple[str, bool]:
    """A cgroup root's real path, and whether it is a cgroup filesystem (the roots are mounts that
    do not move while the agent runs, so both are asked once)."""
    real = real_path(Path(root))
    return real, mount_fs_type(real) in ("cgroup", "cgroup2")


def mount_fs_type(path: str, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The filesystem type of the mount ``path`` (a real path) lies on, or None when unknown."""
    try:
        text = Procfs(mountinfo.parent).read_text(mountinfo.name)
    except DiscoveryError:
        return None
    if text is None:
        return None
    best, fs_type = "", None
    for mount in parse_mountinfo(text):
        point = mount.mount_point
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and mount.fstype and len(point) >= len(best):
            best, fs_type = point, mount.fstype
    return fs_type


def real_path(path: Path) -> str:
    """``os.path.realpath``, asked of the kernel when the path exists (three system calls instead of
    an lstat per component)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(path)  # not there (yet): resolve what exists of it
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)  # no /proc
    finally:
        os.close(fd)


def resolve_dir(root: Path, relpath: str | PurePosixPath) -> CgroupDir:
    """Check a cgroup directory once, for reading several of its files by name."""
    return CgroupDir(resolve(root, relpath))


@dataclass(frozen=True)
class CgroupFile:
    """A cgroup file that :func:`resolve_file` checked, kept by code that reads it every period: each
    read is then one open, read and close of a string path (the QoS loop reads two files of every
    best-effort slot a second; pathlib and the check cost more than the system calls, issue 23)."""

    path: str


def resolve_file(root: Path, relpath: str | PurePosixPath) -> CgroupFile:
    """Check a cgroup file's path once, for reading it many times with :func:`read_checked`."""
    return CgroupFile(str(resolve(root, relpath)))


#: What :func:`read_checked` asks of the first read: more than any one-value or short keyed file
#: holds, so that a read returning less was the whole file.
SMALL_FILE_BYTES = 4096


def read_checked(file: CgroupFile) -> str | None:
    """Read a checked cgroup file; None when the file or its cgroup is gone. ``O_NOFOLLOW``: a
    symlink put in the file's place is refused.

    These are small one-value files, so a first read that returns less than it asked for is the
    whole file and no second read waits for the end (kernfs answers a read from the one record it
    formats; a regular file in a test tree ends there too): open, read and close, three system
    calls instead of four (a scrape of 500 slots reads 2,500 files, issue 23)."""
    try:
        fd = os.open(file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):
            return None
        raise translate_os_error(f"reading {file.path}", err, CgroupError) from err
    try:
        data = os.read(fd, SMALL_FILE_BYTES)
        if len(data) < SMALL_FILE_BYTES:
            return data.decode()
        chunks = [data]
        while chunk := os.read(fd, SMALL_FILE_BYTES):
            chunks.append(chunk)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):  # the cgroup went away between open and read
            return None
        raise translate_os_error(f"reading {file.path}", err, CgroupError) from err
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


def _file_in(directory: CgroupDir, name: str | PurePosixPath) -> Path:
    name = str(name)
    if not name or "/" in name or name in (".", ".."):
        raise CgroupError(
            f"refusing cgroup file {name!r} in {directory.path}: name a file directly in the directory",
            errno_=errno.EINVAL,
        )
    return directory.path / name


def read_file(root: Path | CgroupDir, relpath: str | PurePosixPath) -> str:
    """Read a cgroup file as text (the kernel's whole answer, trailing newline kept)."""
    if isinstance(root, CgroupDir):
        return _read(_file_in(root, relpath), os.O_NOFOLLOW)
    return _read(_checked(root, relpath))


def _read(path: str | Path, flags: int = 0) -> str:
    try:
        return read_all(path, flags).decode()
    except OSError as err:
        raise translate_os_error(f"reading {path}", err, CgroupError) from err


def read_optional(root: Path | CgroupDir, relpath: str | PurePosixPath) -> str | None:
    """Like :func:`read_file`, but None when the file (or its cgroup) does not exist."""
    try:
        return read_file(root, relpath)
    except CgroupError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):
            return None
        raise


def write_file(root: Path, relpath: str | PurePosixPath, value: str | int) -> None:
    """Write one value to a cgroup file in a single write(2), as the kernel expects."""
    path = _checked(root, relpath)
    # A zero-length write(2) never reaches the kernel's handler, so "" would silently leave the old
    # value (an emptied cpuset would keep its CPUs); a lone newline is parsed as the empty value.
    data = str(value).encode() or b"\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)  # O_TRUNC: as a shell does
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as err:
        raise translate_os_error(f"writing {str(value)!r} to {path}", err, CgroupError) from err


def exists(root: Path, relpath: str | PurePosixPath) -> bool:
    return os.path.exists(_checked(root, relpath))


def make_dir(root: Path, relpath: str | PurePosixPath) -> bool:
    """Create one cgroup directory; return False when it was already there (idempotent create)."""
    path = resolve(root, relpath)
    try:
        path.mkdir()
    except FileExistsError:
        return False
    except OSError as err:
        raise translate_os_error(f"creating cgroup {path}", err, CgroupError) from err
    return True


def remove_dir(root: Path, relpath: str | PurePosixPath) -> bool:
    """Remove one cgroup directory; return False when it was already gone (ENOENT is fine)."""
    path = resolve(root, relpath)
    try:
        path.rmdir()
    except FileNotFoundError:
        return False
    except OSError as err:
        raise translate_os_error(f"removing cgroup {path}", err, CgroupError) from err
    return True


def child_dirs(root: Path, relpath: str | PurePosixPath) -> list[str]:
    """Names of the child cgroups of ``relpath`` (sorted); empty when it does not exist."""
    path = _checked(root, relpath)
    try:
        return sorted(entry.name for entry in os.scandir(path) if entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    except OSError as err:
        raise translate_os_error(f"listing cgroup {path}", err, CgroupError) from err


def read_int(root: Path | CgroupDir, relpath: str | PurePosixPath) -> int | None:
    """Read a single-number file; ``max`` (v2's "no limit") is None."""
    return parse_int(read_file(root, relpath), root, relpath)


def parse_int(
    text: str, root: Path | CgroupDir | CgroupFile, relpath: str | PurePosixPath = ""
) -> int | None:
    """A single-number file's value; ``max`` (v2's "no limit") is None. Where it was read (``root``
    and ``relpath``, or a checked ``CgroupFile``) only names the file in the error."""
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        if isinstance(root, CgroupFile):
            where = root.path
        else:
            where = str((root.path if isinstance(root, CgroupDir) else root) / relpath)
        raise CgroupError(f"expected a number in {where}, found {text!r}") from None


def read_keyed(root: Path | CgroupDir, relpath: str | PurePosixPath) -> dict[str, int]:
    """Read a flat keyed file (``key value`` per line, e.g. cpu.stat, memory.events)."""
    return parse_keyed(read_file(root, relpath))


def parse_keyed(text: str) -> dict[str, int]:
    result: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key and value.strip().lstrip("-").isdigit():
            result[key] = int(value)
    return result


def read_pids(root: Path, relpath: str | PurePosixPath) -> list[int]:
    """The pids listed in a cgroup.procs file; a cgroup that is gone has none."""
    try:
        text = read_file(root, relpath)
    except CgroupError as err:
        if err.errno in (errno.ENOENT, errno.ENODEV):
            return []
        raise
    return [int(line) for line in text.split()]
