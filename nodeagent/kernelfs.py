"""Readers of the kernel's pseudo-filesystems, sysfs and procfs, under an injectable root.

``Sysfs(root=Path("/sys"))`` and ``Procfs(root=Path("/proc"))`` read files by paths relative to their
root (``"devices/system/cpu/online"``, ``"self/mountinfo"``), so tests point them at fake trees
written into tmp_path, and a tree captured from another host reads like the live one. Every read
keeps one contract:

- an absent file or directory (ENOENT; in procfs also ESRCH, a process that ended between being
  listed and being read) is ``None``: what absence means is for the caller to say (a kernel without
  NUMA has no node directory; a PCI function without SR-IOV no sriov_totalvfs);
- any other OSError becomes a :class:`~nodeagent.errors.DiscoveryError` naming the path, what the
  kernel said and what to do, with the errno kept (``err.errno``) for a caller to whom one means
  "not offered" (EOPNOTSUPP from /proc/pressure on a kernel booted with psi=0);
- content that is not what was asked for (text, an integer, a cpulist) is a DiscoveryError quoting it.

Only reads: cgroupfs has its own guarded read/write pair (``nodeagent.cgroups.fs``), and so has the
resctrl filesystem (``nodeagent.isolation.resctrl``), because there the values written matter.

Discovery reads hundreds of small files on a big host, so this works on plain strings and binary
reads: ``pathlib`` and text-mode wrappers cost more than the kernel's read itself.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from nodeagent.cpulist import parse_cpulist
from nodeagent.errors import DiscoveryError, InvalidRequest, os_error_message


def read_all(path: str | Path, flags: int = 0) -> bytes:
    """A whole file through os.open and os.read, not open(): the buffered file object cost about as
    much as the kernel's answer for the small files read here (the QoS loop reads five a second).
    ``flags`` are added to the open's (``O_NOFOLLOW``). OSError as the kernel gave it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class KernelFs:
    """The reader sysfs and procfs share; ``kind`` names the tree in messages."""

    kind = "kernel"
    #: What a read may fail with that means "not there" (None).
    absent: frozenset[int] = frozenset({errno.ENOENT})

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._prefix = str(self.root).rstrip("/") + "/"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def path(self, rel: str) -> str:
        """The absolute path of ``rel`` under the root, as a string."""
        return self._prefix + rel

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._prefix + rel)

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self._prefix + rel)

    def is_file(self, rel: str) -> bool:
        return os.path.isfile(self._prefix + rel)

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's content as the kernel gave it; None when it does not exist."""
        path = self._prefix + rel
        try:
            return read_all(path)
        except OSError as err:
            if err.errno in self.absent:
                return None
            raise DiscoveryError(os_error_message(f"reading {path}", err), errno_=err.errno) from err

    def read_text(self, rel: str) -> str | None:
        """The file's content without surrounding whitespace; None when it does not exist."""
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return data.decode().strip()
        except UnicodeDecodeError as err:
            raise self._garbage(rel, data, "text") from err

    def read_int(self, rel: str) -> int | None:
        """A file holding one decimal integer (may be negative: sysfs says -1 for "none")."""
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return int(data)
        except ValueError as err:
            raise self._garbage(rel, data, "an integer") from err

    def read_cpulist(self, rel: str) -> frozenset[int] | None:
        """A file in the kernel's cpulist format ("0-3,8"); an empty file is the empty set."""
        data = self.read_bytes(rel)
        if data is None:
            return None
        try:
            return parse_cpulist(data.decode())
        except (InvalidRequest, UnicodeDecodeError) as err:
            raise self._garbage(rel, data, "a cpulist such as '0-3,8'") from err

    def listdir(self, rel: str = "") -> list[str] | None:
        """Names in a directory, sorted; None when the directory does not exist."""
        path = self._prefix + rel
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return None
        except NotADirectoryError as err:
            raise DiscoveryError(f"reading {path}: expected a directory, found a file") from err
        except OSError as err:
            raise DiscoveryError(os_error_message(f"listing {path}", err), errno_=err.errno) from err

    def subdirs(self, rel: str) -> list[str] | None:
        """Names of the real directories in a directory (symlinks to directories left out), sorted;
        None when it does not exist. sysfs links lead back up the tree (``subsystem``, ``driver``),
        so a walk down follows only these."""
        path = self._prefix + rel
        try:
            with os.scandir(path) as entries:
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return None
        except OSError as err:
            raise DiscoveryError(os_error_message(f"listing {path}", err), errno_=err.errno) from err

    def link_name(self, rel: str) -> str | None:
        """The last component of a symlink's target (``driver`` -> "vfio-pci"); None when absent."""
        path = self._prefix + rel
        try:
            return os.path.basename(os.readlink(path))
        except FileNotFoundError:
            return None
        except OSError as err:
            raise DiscoveryError(os_error_message(f"reading link {path}", err), errno_=err.errno) from err

    def real_path(self, rel: str) -> str:
        """``rel`` with every symlink resolved (where a class device really sits in the device tree)."""
        return os.path.realpath(self._prefix + rel)

    def _garbage(self, rel: str, data: bytes, expected: str) -> DiscoveryError:
        shown = repr(data[:60].decode(errors="replace"))
        return DiscoveryError(
            f"reading {self._prefix + rel}: expected {expected}, found {shown}; "
            f"the {self.kind} tree is damaged or not a {self.kind} tree"
        )


class Sysfs(KernelFs):
    """sysfs: devices, CPUs and NUMA nodes (``/sys``, or a captured or fake tree)."""

    kind = "sysfs"

    def __init__(self, root: Path = Path("/sys")) -> None:
        super().__init__(root)


class Procfs(KernelFs):
    """procfs: the kernel's and processes' state (``/proc``, or a fake tree)."""

    kind = "procfs"
    absent = frozenset({errno.ENOENT, errno.ESRCH})

    def __init__(self, root: Path = Path("/proc")) -> None:
        super().__init__(root)


__all__ = ["KernelFs", "Procfs", "Sysfs", "read_all"]
