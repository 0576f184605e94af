"""Escape attempts from a default (sandboxed) slot on this host's kernel, each with its control.

A worker launched through the real agent path (SlotManager, kernel isolation, host keeper) runs
``attempts.py``: write itself into the root cgroup of every hierarchy, run on CPUs beyond its
slot's, open a device it was not given, mknod, mount, read the agent's token, state and memory,
signal and ptrace the agent and another slot's worker, reach the host and another slot over the
network, fork past pids.max, leave files in the host's /tmp and /dev/shm, and outlive its own
SIGKILL. Every attempt must fail; the same script run as root outside every slot (against cgroups
and directories the test owns) must succeed at each, so a verdict of "failed" means something.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.escape.harness import escape_suite

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_every_escape_fails_from_a_default_slot_and_succeeds_in_the_control(tmp_path: Path) -> None:
    escape_suite(tmp_path, "x", network=True)
