"""A tiny container image built here, offline: the host's static busybox (package busybox-static)
with one applet link per tool the tests use and a document root for ``busybox httpd``; imported
into podman's local storage with ``podman import`` (no registry, no network). ~2 MB, under a
second to build; once per test session, removed at its end."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

#: The applets linked into /bin (busybox finds its applet from argv[0]).
APPLETS = ("sh", "cat", "echo", "sleep", "dd", "head", "awk", "httpd", "ls", "grep", "true", "wc", "tr")
STATIC_BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")


def static_busybox() -> str | None:
    """The host's busybox when it is a static executable (busybox-static), else None."""
    for path in STATIC_BUSYBOX:
        if os.path.isfile(path):
            head = Path(path).read_bytes()[: 4096 * 4]
            # A dynamic ELF names its interpreter; a static one has no PT_INTERP (the path string
            # of the dynamic loader is absent from its first pages).
            if b"ld-linux" not in head:
                return path
    return None


def _add(
    tar: tarfile.TarFile, name: str, *, data: bytes | None = None, mode: int = 0o755, link: str = ""
) -> None:
    info = tarfile.TarInfo(name)
    info.mode = mode
    if link:
        info.type = tarfile.SYMTYPE
        info.linkname = link
    elif data is None:
        info.type = tarfile.DIRTYPE
    else:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def rootfs_tar(busybox: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for directory in ("bin", "dev", "proc", "sys", "etc", "tmp", "run", "www"):
            _add(tar, directory, mode=0o1777 if directory == "tmp" else 0o755)
        _add(tar, "bin/busybox", data=Path(busybox).read_bytes())
        for applet in APPLETS:
            _add(tar, f"bin/{applet}", link="busybox")
        _add(tar, "www/ready", data=b"ready\n", mode=0o644)
        _add(tar, "etc/passwd", data=b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
        _add(tar, "etc/group", data=b"root:x:0:\n", mode=0o644)
    return out.getvalue()


def build_image(tag: str) -> str:
    """Import the image as ``tag``; raises RuntimeError saying what is missing."""
    podman = shutil.which("podman")
    if podman is None:
        raise RuntimeError("podman is not installed (apt-get install podman runc catatonit)")
    busybox = static_busybox()
    if busybox is None:
        raise RuntimeError("no static busybox on this host (apt-get install busybox-static)")
    done = subprocess.run(
        [podman, "import", "--change", "CMD=/bin/sh", "-", tag],
        input=rootfs_tar(busybox),
        capture_output=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"podman import failed: {done.stderr.decode(errors='replace').strip()}")
    return tag


def remove_image(tag: str) -> None:
    podman = shutil.which("podman")
    if podman is not None:
        subprocess.run([podman, "rmi", "--force", tag], capture_output=True, timeout=120, check=False)
