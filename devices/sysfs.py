"""A small reader over a sysfs tree whose root is injectable (``/sys`` or a captured/fake tree).

Every read goes through :meth:`Sysfs._read`: an absent file (ENOENT) is ``None``, any other
OSError becomes a :class:`~nodeagent.errors.DiscoveryError` naming the path, and so does content
that does not parse. Paths are relative to the root (``"devices/system/cpu/online"``).

Discovery reads hundreds of small files on a big host, so this works on plain strings and
binary reads: ``pathlib`` and text-mode wrappers cost more than the kernel's read itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.cpulist import parse_cpulist
from nodeagent.errors import DiscoveryError, InvalidRequest, os_error_message


class Sysfs:
    def __init__(self, root: Path = Path("/sys")) -> None:
        self.root = Path(root)
        self._prefix = str(self.root).rstrip("/") + "/"

    def __repr__(self) -> str:
        return f"Sysfs({str(self.root)!r})"

    def path(self, rel: str) -> str:
        """The absolute path of ``rel`` under the root, as a string."""
        return self._prefix + rel

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._prefix + rel)

    def _read(self, rel: str) -> bytes | None:
        path = self._prefix + rel
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise DiscoveryError(os_error_message(f"reading {path}", err)) from err

    def read_text(self, rel: str) -> str | None:
        """The file's content without surrounding whitespace; None when it does not exist."""
        data = self._read(rel)
        if data is None:
            return None
        try:
            return data.decode().strip()
        except UnicodeDecodeError as err:
            raise self._garbage(rel, data, "text") from err

    def read_int(self, rel: str) -> int | None:
        """A file holding one decimal integer (may be negative: sysfs says -1 for "none")."""
        data = self._read(rel)
        if data is None:
            return None
        try:
            return int(data)
        except ValueError as err:
            raise self._garbage(rel, data, "an integer") from err

    def read_cpulist(self, rel: str) -> frozenset[int] | None:
        """A file in the kernel's cpulist format ("0-3,8"); an empty file is the empty set."""
        data = self._read(rel)
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
            raise DiscoveryError(os_error_message(f"listing {path}", err)) from err

    def _garbage(self, rel: str, data: bytes, expected: str) -> DiscoveryError:
        shown = repr(data[:60].decode(errors="replace"))
        return DiscoveryError(
            f"reading {self._prefix + rel}: expected {expected}, found {shown}; "
            "the sysfs tree is damaged or not a sysfs tree"
        )


__all__ = ["Sysfs"]
