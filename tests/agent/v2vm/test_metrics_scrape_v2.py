"""The metrics scrape's carried figures on a pure cgroup v2 kernel: the same test as
tests/agent/test_metrics_scrape.py, where a slot's parent counts its children's memory by design
and CPU time comes from ``cpu.stat`` (the host runs it on v1)."""

from __future__ import annotations

from tests.agent.test_metrics_scrape import test_slot_stats_carry_the_slots_of_a_parent_that_did_not_move

__all__ = ["test_slot_stats_carry_the_slots_of_a_parent_that_did_not_move"]
