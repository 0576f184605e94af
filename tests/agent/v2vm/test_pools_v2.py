"""Warm standby pools on a pure cgroup v2 kernel: the same tests as tests/agent/test_pools.py, where
the freezer is ``cgroup.freeze`` in the slot's one cgroup instead of v1's freezer hierarchy, a
standby's class change moves it between cgroups of one tree, and a standby killed while frozen dies
at once (v1 holds the signal until the thaw). The tests of the API's refusals and of the memory
standbys give way are the same on both kernels and run on the host only."""

from __future__ import annotations

from tests.agent.test_pools import (
    daemon,
    test_a_standby_that_died_frozen_is_passed_over_and_an_agent_kill_keeps_them_frozen,
    test_deleting_a_pool_removes_its_standbys_and_their_cgroups,
    test_standbys_frozen_then_claimed_onto_an_exclusive_core_and_refilled,
)

__all__ = [
    "daemon",
    "test_a_standby_that_died_frozen_is_passed_over_and_an_agent_kill_keeps_them_frozen",
    "test_deleting_a_pool_removes_its_standbys_and_their_cgroups",
    "test_standbys_frozen_then_claimed_onto_an_exclusive_core_and_refilled",
]
