"""CDI (Container Device Interface) specs for slots: what a container runtime needs to give a
container exactly one slot's devices, environment and slot file.

A CDI spec is a JSON file in a directory the runtimes scan (``/var/run/cdi`` for specs that live
as long as the host runs, ``/etc/cdi`` for static ones); ``podman run --device
nodeagent.io/slot=NAME`` (or containerd/CRI-O with CDI on) reads it and edits the container's OCI
spec: device nodes created inside, environment variables set, files bind-mounted. The agent writes
one file per slot, with two devices of the same content: one named by the slot's name, one by its
id (``nodeagent.io/slot=mlp`` and ``nodeagent.io/slot=s0123456789ab``), and, where configured, one
file per kind of accelerator (``nodeagent.io/gpu=0``, ``nodeagent.io/fpga=0000:3b:00.0``).

This module is pure where it can be: :func:`slot_spec` and :func:`device_spec` build the JSON
object, :func:`required_version` names the oldest CDI version whose features the object uses
(that is the ``cdiVersion`` it declares, so the oldest runtime that can read it does: podman 4.3
vendors a CDI library that knows 0.3.0 to 0.5.0), and :class:`CdiSpecDir` writes, lists and
removes the agent's own files (``<prefix><slot id>.json``) atomically. The agent decides what
goes in (isolation/ does not import the runtime's environment rules).

Rules from the CDI specification (SPEC.md of cncf-tags/container-device-interface) kept here:

- ``kind`` is ``vendor/class``; the vendor a DNS-like name, the class alphanumerics with ``-``
  and ``_``; both begin and end with an alphanumeric;
- a device name begins and ends with an alphanumeric and holds alphanumerics, ``-``, ``_``, ``.``
  and ``:`` between (slot names, ``[a-z0-9][a-z0-9._-]*``, and ids, ``s`` + hex, always do, except
  a name ending in ``.``, ``-`` or ``_``: that slot's device is named by its id alone);
- each device has ``containerEdits``; a device node needs ``path`` (the host's node of the same
  path is used when ``hostPath`` is absent); a mount needs ``hostPath`` and ``containerPath``;
- two spec files must not define the same device of a kind: slot names are unique on a host, and
  the agent removes a slot's file before another slot can take its name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.atomicfile import is_temporary, write_atomic
from nodeagent.errors import KernelError, translate_os_error

#: The kind of every slot device: ``--device nodeagent.io/slot=<slot name or id>``.
SLOT_KIND = "nodeagent.io/slot"
GPU_KIND = "nodeagent.io/gpu"
FPGA_KIND = "nodeagent.io/fpga"
#: ``[placement] allowed_devices``, each by its name (:func:`allowed_device_name`).
DEVICE_KIND = "nodeagent.io/device"
#: The standard directory for specs generated at run time (``/etc/cdi`` is for static ones).
DEFAULT_CDI_DIR = "/var/run/cdi"
#: File names of the agent's slot specs start with this; files without it are never touched.
DEFAULT_PREFIX = "nodeagent-slot-"
#: Where a container finds its slot description (``NODEAGENT_SLOT_FILE`` inside it).
CONTAINER_SLOT_FILE = "/run/nodeagent/slot.json"

#: A temporary file this old is a write that died (a write takes well under a millisecond).
STRAY_SECONDS = 60.0
#: CDI versions in order, and the first one that has each feature the agent may use.
CDI_VERSIONS = ("0.3.0", "0.4.0", "0.5.0")
_MOUNT_TYPE_VERSION = "0.4.0"  # Mount.type
_HOST_PATH_VERSION = "0.5.0"  # DeviceNode.hostPath

_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_VENDOR = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_CLASS = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_-]*[A-Za-z0-9])?")


def valid_device_name(name: str) -> bool:
    return _DEVICE_NAME.fullmatch(name) is not None


def allowed_device_name(path: str) -> str:
    """An allowed device's name in the agent's CDI spec and device plugin (``/dev/loop0`` ->
    ``loop0``): its file name with what a resource or CDI name cannot hold replaced by '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).name).strip("-._") or "x"


def valid_kind(kind: str) -> bool:
    vendor, sep, cls = kind.partition("/")
    return bool(sep) and _VENDOR.fullmatch(vendor) is not None and _CLASS.fullmatch(cls) is not None


@dataclass(frozen=True)
class CdiMount:
    """A bind mount of a host file into the container, read-only unless ``writable``."""

    host_path: str
    container_path: str
    writable: bool = False

    def to_json(self) -> dict[str, Any]:
        options = ["rw" if self.writable else "ro", "nosuid", "nodev", "bind"]
        return {
            "hostPath": self.host_path,
            "containerPath": self.container_path,
            "options": options,
            "type": "bind",
        }


@dataclass(frozen=True)
class CdiEdits:
    """What requesting one device does to a container: device nodes (same path inside as on the
    host), environment variables, mounts."""

    device_nodes: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    mounts: tuple[CdiMount, ...] = ()

    def to_json(self) -> dict[str, Any]:
        edits: dict[str, Any] = {}
        if self.device_nodes:
            # Only "path": the runtime reads type and numbers from the host's node at that path,
            # and "permissions" defaults to rw (the slot's device cgroup grants no more anyway).
            edits["deviceNodes"] = [{"path": path} for path in self.device_nodes]
        if self.env:
            edits["env"] = [f"{name}={value}" for name, value in self.env]
        if self.mounts:
            edits["mounts"] = [mount.to_json() for mount in self.mounts]
        return edits


def _spec(kind: str, devices: Iterable[tuple[str, CdiEdits]]) -> dict[str, Any]:
    if not valid_kind(kind):
        raise ValueError(f"CDI kind {kind!r} is not vendor/class")
    listed = []
    for name, edits in devices:
        if not valid_device_name(name):
            raise ValueError(f"CDI device name {name!r} is not valid (alphanumerics, - _ . : between)")
        listed.append({"name": name, "containerEdits": edits.to_json()})
    if not listed:
        raise ValueError("a CDI spec needs at least one device")
    spec: dict[str, Any] = {"cdiVersion": "", "kind": kind, "devices": listed}
    spec["cdiVersion"] = required_version(spec)
    return spec


def slot_spec(
    slot_id: str,
    slot_name: str,
    device_nodes: Iterable[str],
    env: Mapping[str, str],
    slot_file: str | None,
) -> dict[str, Any]:
    """The spec of one slot: devices ``slot_name`` and ``slot_id``, each with the slot's device
    nodes, ``env`` and, when given, the host's ``slot_file`` mounted read-only at
    :data:`CONTAINER_SLOT_FILE` (``env`` should name that path in ``NODEAGENT_SLOT_FILE``)."""
    edits = CdiEdits(
        device_nodes=tuple(dict.fromkeys(device_nodes)),
        env=tuple(sorted(env.items())),
        mounts=() if slot_file is None else (CdiMount(slot_file, CONTAINER_SLOT_FILE),),
    )
    names = [n for n in dict.fromkeys((slot_name, slot_id)) if valid_device_name(n)]
    return _spec(SLOT_KIND, ((name, edits) for name in names))


def device_spec(kind: str, devices: Mapping[str, Iterable[str]]) -> dict[str, Any]:
    """A spec of one kind of device the agent manages (GPUs, FPGAs): device name -> its nodes."""
    edits = ((name, CdiEdits(device_nodes=tuple(nodes))) for name, nodes in sorted(devices.items()))
    return _spec(kind, edits)


def required_version(spec: Mapping[str, Any]) -> str:
    """The oldest CDI version that has every feature ``spec`` uses."""
    version = CDI_VERSIONS[0]
    for device in spec.get("devices", ()):
        edits = device.get("containerEdits", {})
        if any("type" in mount for mount in edits.get("mounts", ())):
            version = max(version, _MOUNT_TYPE_VERSION, key=CDI_VERSIONS.index)
        if any("hostPath" in node for node in edits.get("deviceNodes", ())):
            version = max(version, _HOST_PATH_VERSION, key=CDI_VERSIONS.index)
    return version


def qualified_name(kind: str, name: str) -> str:
    """What a runtime is given: ``nodeagent.io/slot=mlp``."""
    return f"{kind}={name}"


class CdiSpecDir:
    """The agent's files in a CDI spec directory: ``<prefix><key>.json``, written atomically
    (a runtime scanning the directory never reads half a file), world-readable (runtimes may run
    as any user; a spec holds no secret)."""

    def __init__(self, directory: Path, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or "/" in prefix:
            raise ValueError(f"CDI file prefix {prefix!r}: give a non-empty file name prefix")
        self.directory = directory
        self.prefix = prefix

    def path_for(self, key: str) -> Path:
        return self.directory / f"{self.prefix}{key}.json"

    def write(self, key: str, spec: Mapping[str, Any]) -> Path:
        path = self.path_for(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Its temporary is a dot file ending .tmp: runtimes read only *.json and *.yaml.
            write_atomic(path, json.dumps(spec, indent=2, sort_keys=True) + "\n", mode=0o644)
        except OSError as err:
            raise translate_os_error(f"write CDI spec {path}", err, KernelError) from err
        return path

    def read(self, key: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path_for(key).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise KernelError(f"read CDI spec {self.path_for(key)}: {err}") from err
        return data if isinstance(data, dict) else None

    def remove(self, key: str) -> bool:
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as err:
            raise translate_os_error(f"remove CDI spec {self.path_for(key)}", err, KernelError) from err
        return True

    def keys(self) -> set[str]:
        """Keys of the agent's files present now (leftover temporary files are not keys)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return set()
        except OSError as err:
            raise translate_os_error(f"list CDI specs in {self.directory}", err, KernelError) from err
        return {
            name[len(self.prefix) : -len(".json")]
            for name in names
            if name.startswith(self.prefix) and name.endswith(".json")
        }

    def remove_except(
        self, keep: Iterable[str], owned: Callable[[dict[str, Any]], bool] | None = None
    ) -> list[str]:
        """Remove the agent's files whose key is not in ``keep``, and stray temporary files older
        than a minute (a write that died; a younger one may be a write under way); the keys
        removed, sorted. ``owned``: only files it accepts are removed, so that two agents sharing
        a directory and a prefix do not remove each other's."""
        keep = set(keep)
        stale = []
        for key in sorted(self.keys() - keep):
            if owned is not None:
                try:
                    spec = self.read(key)
                except KernelError:
                    continue  # not readable as a spec: not provably ours
                if spec is None or not owned(spec):
                    continue
            if self.remove(key):
                stale.append(key)
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            entries = []
        old = time.time() - STRAY_SECONDS
        for entry in entries:
            if entry.name.startswith(f".{self.prefix}") and is_temporary(entry.name):
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < old:
                        os.unlink(entry.path)
        return stale


__all__ = [
    "CDI_VERSIONS",
    "CONTAINER_SLOT_FILE",
    "DEFAULT_CDI_DIR",
    "DEFAULT_PREFIX",
    "DEVICE_KIND",
    "FPGA_KIND",
    "GPU_KIND",
    "SLOT_KIND",
    "CdiEdits",
    "CdiMount",
    "CdiSpecDir",
    "allowed_device_name",
    "device_spec",
    "qualified_name",
    "required_version",
    "slot_spec",
    "valid_device_name",
    "valid_kind",
]
