"""The one way the agent replaces a file: whole or not at all.

A reader (a container runtime scanning a CDI directory, the next agent reading a manifest, the
keeper's exit record) sees the old file or the new one, never half of one: the content goes to a
temporary beside the target (same directory, so the rename stays on one filesystem), then
``rename(2)`` swaps it in. The temporary is a dot file ending in ``.tmp`` (``.NAME.PID.N.tmp``,
N counting this process's writes), so scanners of ``*.json`` never parse it and two writers never
share one. On any failure the
temporary is removed and the old file is left as it was; the OSError goes to the caller, which
knows what the file is and says so.

``durable`` adds fsync of the file before the rename and of the directory after it, so the swap
survives a crash of the whole host (exit records, the host record, the API token); without it the
file survives the agent but not the machine, like the kernel objects it describes, and the write
costs no disk flush.
"""

from __future__ import annotations

import contextlib
import itertools
import os

#: Tells apart the temporaries of one process's writers (threads; next() on a count is atomic).
#: Not threading: the keeper imports this and stays free of it.
_serial = itertools.count()


def write_atomic(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644, durable: bool = False
) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8), permissions exactly ``mode`` whatever the umask."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{next(_serial)}.tmp")
    body = data.encode() if isinstance(data, str) else data
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # os.open's mode is cut by the umask
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(directory or ".")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename or an unlink in it); best effort, as a filesystem
    that cannot fsync a directory has nothing more to flush."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_temporary(name: str) -> bool:
    """Whether a directory entry is a temporary of :func:`write_atomic` (left by a crash)."""
    return name.startswith(".") and name.endswith(".tmp")


__all__ = ["fsync_dir", "is_temporary", "write_atomic"]
