"""Fixtures for the sandbox tests: children started by the test, host directories outside /tmp.

The tests in ``v2vm/`` need a pure cgroup v2 kernel; they are collected only when
NODEAGENT_IN_CGROUP2_VM=1 (set inside the VM that runs them), so ordinary runs never see them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.sandbox.child import sandboxed

__all__ = ["sandboxed"]

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A world-readable directory outside /tmp (which the sandbox replaces), removed afterwards."""
    made = Path(tempfile.mkdtemp(prefix=f"natest{os.getpid()}-", dir="/var/tmp"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)
