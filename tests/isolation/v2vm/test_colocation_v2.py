"""Colocation control on a pure cgroup v2 kernel (in the VM): per-cgroup PSI, cpu.max, memory.high
(which really throttles here) and the cpuset limit. Same scenarios as test_colocation_kernel.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent.isolation.isolator import SlotIsolator
from tests.isolation.colocation_scenarios import StartIn, cpu_scenario, memory_scenario

pytestmark = pytest.mark.slow


def test_best_effort_cpu_is_suppressed_under_online_load_and_given_back(
    isolator: SlotIsolator, start_in: StartIn, tmp_path: Path
) -> None:
    cpu_scenario(isolator, start_in, tmp_path)


def test_best_effort_memory_is_throttled_then_evicted_and_online_is_untouched(
    isolator: SlotIsolator, start_in: StartIn, tmp_path: Path
) -> None:
    memory_scenario(isolator, start_in, tmp_path)
