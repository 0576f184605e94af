"""The escape suite (tests/escape/harness.py) on a pure cgroup v2 kernel: the root cgroup.procs of
the unified hierarchy instead of each v1 hierarchy's; every other attempt as on v1. The VM's kernel
has no nf_tables, so the slots here have no network namespace and the network attempts (which do
not depend on the cgroup version) run on the v1 host only."""

from __future__ import annotations

from pathlib import Path

from tests.escape.harness import escape_suite


def test_every_escape_fails_from_a_default_slot_on_cgroup_v2(tmp_path: Path) -> None:
    escape_suite(tmp_path, "v", network=False)
