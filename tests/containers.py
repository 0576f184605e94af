"""A tiny container image built here, offline: the host's static busybox (package busybox-static)
with one applet link per tool the tests use and a document root for ``busybox httpd``; imported
into podman's local storage with ``podman import`` (no registry, no network). ~2 MB, under a
second to build; once per test session, removed at its end.

Also what the container worker suites (on this kernel and in the cgroup v2 VM) share: what they
need of the host, and an agent that writes CDI specs and cleans up every container and cgroup.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from nodeagent.agent.config import apply_overrides, parse_config
from nodeagent.agent.daemon import build_isolation
from nodeagent.cgroups import detect
from nodeagent.devices.discovery import discover
from nodeagent.isolation.backend import KernelIsolation
from nodeagent.runtime.container import PodmanConfig, container_name, container_slots
from tests.daemon import DaemonProcess

#: The applets linked into /bin (busybox finds its applet from argv[0]).
APPLETS = ("sh", "cat", "echo", "sleep", "dd", "head", "awk", "httpd", "ls", "grep", "true", "wc", "tr")
STATIC_BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")
#: Two devices every host with the loop driver has: one the slot is given, one it is not.
ALLOWED, OTHER = "/dev/loop0", "/dev/loop1"


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


def device_httpd_request(image: str, port: int, *, period: float, grace: float) -> dict[str, Any]:
    """A guaranteed slot "ctr" holding ALLOWED whose container reads the device (printing
    "device-ok"), then serves /www on ``port``, ready when /ready answers."""
    script = f"dd if={ALLOWED} of=/dev/null count=0 && echo device-ok; exec httpd -f -p {port} -h /www"
    return {
        "name": "ctr",
        "qos": "guaranteed",
        "resources": {"cpus": 1, "memory": "256Mi", "devices": [ALLOWED]},
        "worker": {
            "container": {"image": image, "command": ["/bin/sh", "-c", script], "read_only": True},
            "readiness": {"http": {"port": port, "path": "/ready"}, "period_seconds": period},
            "restart": "on-failure",
            "stop_grace_seconds": grace,
        },
    }


def missing_for_containers() -> str | None:
    """What the host lacks for the container worker suites (None: nothing)."""
    if shutil.which("podman") is None:
        return "podman is not installed (run-tests installs it as root)"
    if static_busybox() is None:
        return "no static busybox (apt-get install busybox-static)"
    if not (os.path.exists(ALLOWED) and os.path.exists(OTHER)):
        return f"{ALLOWED} and {OTHER} are needed (the loop driver)"
    return None


@contextlib.contextmanager
def container_daemon(
    tmp_path: Path, isolation: Mapping[str, str], cdi: Mapping[str, str]
) -> Iterator[DaemonProcess]:
    """A ``nodeagent serve`` that may give slots ALLOWED and writes CDI specs as ``cdi`` says; at
    the end its containers (one per spec it left), specs, keeper and cgroups go."""
    toml = (
        "[isolation]\n"
        + "".join(f'{k} = "{v}"\n' for k, v in isolation.items())
        + f'[placement]\nallowed_devices = ["{ALLOWED}"]\n'
        + f'[cdi]\ndir = "{cdi["dir"]}"\nprefix = "{cdi["prefix"]}"\n'
    )
    d = DaemonProcess(tmp_path, toml)
    try:
        yield d
    finally:
        d.stop()
        d.stop_keeper()
        for spec in Path(cdi["dir"]).glob(f"{cdi['prefix']}*.json"):
            slot_id = spec.name[len(cdi["prefix"]) : -len(".json")]
            subprocess.run(
                ["podman", "rm", "-f", "--ignore", container_name(slot_id)], capture_output=True, check=False
            )
            spec.unlink()
        config = parse_config({"isolation": dict(isolation), "cdi": dict(cdi)})
        cfg = apply_overrides(config, state_dir=d.state)
        kernel = build_isolation(cfg, discover(gpus=False, fpgas=False), detect())
        if isinstance(kernel, KernelIsolation):
            kernel.isolator.remove_all()


def has_container(slot_id: str) -> bool:
    """Whether podman holds the slot's container, in any state."""
    return slot_id in container_slots("podman", PodmanConfig())
