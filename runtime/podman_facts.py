"""What ``podman info`` says about the host's container engine (for ``nodeagent doctor``).

A module of its own, on the standard library alone: the doctor imports it without the runtime's
launch path (and pydantic) behind runtime/container.py.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class PodmanFacts:
    version: str
    runtime: str
    runtime_version: str
    cgroup_manager: str


def podman_facts(podman: str) -> PodmanFacts:
    """``podman info`` (about 0.1-0.3 s); raises OSError or ValueError when podman cannot answer."""
    done = subprocess.run(
        [podman, "info", "--format", "json"], capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise ValueError(done.stderr.strip() or f"podman info exited with {done.returncode}")
    info = json.loads(done.stdout)
    host = info.get("host", {})
    runtime = host.get("ociRuntime", {})
    version = str(runtime.get("version") or "?")
    return PodmanFacts(
        version=str(info.get("version", {}).get("Version", "?")),
        runtime=str(runtime.get("name", "?")),
        runtime_version=version.splitlines()[0] if version else "?",
        cgroup_manager=str(host.get("cgroupManager", "?")),
    )


__all__ = ["PodmanFacts", "podman_facts"]
