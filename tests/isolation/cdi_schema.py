"""A JSON Schema for CDI specs, written for these tests from the CDI specification (SPEC.md of
https://github.com/cncf-tags/container-device-interface, versions 0.3.0 to 0.5.0), stricter than
the project's own schema/schema.json where the text says more than that file checks: the shape
of ``kind``, device names, semver ``cdiVersion``, absolute paths, ``KEY=value`` environment
entries, and no field the declared version does not have (``hostPath`` on a device node is 0.5.0,
a mount's ``type`` 0.4.0; ``annotations`` are 0.6.0 and never allowed here).
"""

from __future__ import annotations

from typing import Any

_ABSOLUTE = {"type": "string", "pattern": "^/"}
_VENDOR = r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?"
_CLASS = r"[A-Za-z0-9]([A-Za-z0-9_-]*[A-Za-z0-9])?$"
_STRINGS = {"type": "array", "items": {"type": "string"}}


def cdi_schema(version: str) -> dict[str, Any]:
    """The schema a spec declaring ``version`` must satisfy."""
    node: dict[str, Any] = {
        "type": "object",
        "properties": {
            "path": _ABSOLUTE,
            "type": {"enum": ["b", "c", "u", "p"]},
            "major": {"type": "integer"},
            "minor": {"type": "integer"},
            "fileMode": {"type": "integer"},
            "permissions": {"type": "string", "pattern": "^[rwm]{1,3}$"},
            "uid": {"type": "integer", "minimum": 0, "maximum": 4294967295},
            "gid": {"type": "integer", "minimum": 0, "maximum": 4294967295},
        },
        "required": ["path"],
        "additionalProperties": False,
    }
    mount: dict[str, Any] = {
        "type": "object",
        "properties": {"hostPath": _ABSOLUTE, "containerPath": _ABSOLUTE, "options": _STRINGS},
        "required": ["hostPath", "containerPath"],
        "additionalProperties": False,
    }
    if version >= "0.4.0":
        mount["properties"]["type"] = {"type": "string"}
    if version >= "0.5.0":
        node["properties"]["hostPath"] = _ABSOLUTE
    hook = {
        "type": "object",
        "properties": {
            "hookName": {"type": "string"},
            "path": _ABSOLUTE,
            "args": _STRINGS,
            "env": _STRINGS,
            "timeout": {"type": "integer", "minimum": 1},
        },
        "required": ["hookName", "path"],
        "additionalProperties": False,
    }
    edits = {
        "type": "object",
        "properties": {
            "env": {"type": "array", "items": {"type": "string", "pattern": "^[^=]+="}},
            "deviceNodes": {"type": "array", "items": node},
            "mounts": {"type": "array", "items": mount},
            "hooks": {"type": "array", "items": hook},
        },
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "cdiVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
            "kind": {
                "type": "string",
                "pattern": _VENDOR + "/" + _CLASS,
            },
            "devices": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "pattern": r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$"},
                        "containerEdits": edits,
                    },
                    "required": ["name", "containerEdits"],
                    "additionalProperties": False,
                },
            },
            "containerEdits": edits,
        },
        "required": ["cdiVersion", "kind", "devices"],
        "additionalProperties": False,
    }
