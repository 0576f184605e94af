"""Colocation control on this host's kernel (cgroup v1 or hybrid, root): a best-effort CPU hog is
suppressed within two periods of online load and given back after; a best-effort memory hog is
held at its size, then evicted, and the online slot is untouched. The same scenarios run on a pure
cgroup v2 kernel in tests/isolation/v2vm/test_colocation_v2.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.isolation.isolator import SlotIsolator
from tests.isolation.colocation_scenarios import StartIn, cpu_scenario, memory_scenario
from tests.isolation.test_slot_kernel import host, isolator, start_in  # noqa: F401 - fixtures

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_best_effort_cpu_is_suppressed_under_online_load_and_given_back(
    isolator: SlotIsolator,  # noqa: F811
    start_in: StartIn,  # noqa: F811
    tmp_path: Path,
) -> None:
    cpu_scenario(isolator, start_in, tmp_path)


def test_best_effort_memory_is_throttled_then_evicted_and_online_is_untouched(
    isolator: SlotIsolator,  # noqa: F811
    start_in: StartIn,  # noqa: F811
    tmp_path: Path,
) -> None:
    memory_scenario(isolator, start_in, tmp_path)
