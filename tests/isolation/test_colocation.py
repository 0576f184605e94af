"""The colocation decision (pure): usage and pressure series in, actions on best-effort out."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

import pytest

from nodeagent.errors import ConfigError
from nodeagent.isolation.colocation import (
    Action,
    BestEffortSlot,
    ColocationConfig,
    CpuLimit,
    Decision,
    GroupUsage,
    LoopState,
    actions_by_slot,
    choose_cpus,
    decide,
    needs_slot_detail,
)
from tests.isolation.colocation_series import GiB, MiB, Period, Series, load, recorded, run

F = frozenset
CONFIG = ColocationConfig()


def kinds(actions: tuple[Action, ...]) -> list[str]:
    return [a.kind for a in actions]


def memory_actions(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    return tuple(a for a in actions if a.kind not in ("cpu_suppress", "cpu_release", "slot_cpu_quota"))


# --------------------------------------------------------------------------- CPU


def test_first_sample_measures_nothing_and_touches_no_cpu() -> None:
    first = run(CONFIG, Series(), [])[0]
    assert first.measured is None
    assert first.batch is None
    assert first.actions == ()
    assert first.state.cpu_limit is None


def test_best_effort_gets_what_online_leaves_minus_the_margin_on_the_far_cpus() -> None:
    # 2-CPU pool, online uses 0.3 CPU on CPU 0, best-effort hogs the rest.
    decisions = run(CONFIG, Series(), [load(0.3, 1.7)])
    last = decisions[-1]
    assert last.measured is not None
    assert last.measured.online_cpu == pytest.approx(0.3)
    assert last.measured.allowed_cpus == pytest.approx(2 * 0.9 - 0.3)
    (action,) = last.actions
    assert action.kind == "cpu_suppress"
    assert action.slot_id is None
    # floor(1.5) = one CPU, from the high end; the quota cannot exceed what the cpuset holds.
    assert action.cpus == F({1})
    assert action.quota_cpus == 1.0
    assert "0.30 of 2 pool CPUs" in action.reason


def test_rising_online_load_cuts_within_one_period_and_falling_load_gives_back_later() -> None:
    series = Series()
    quiet, busy = load(0.3, 1.0), load(1.4, 0.6)
    decisions = run(CONFIG, series, [quiet, quiet, busy, quiet, quiet, quiet, quiet])
    limits = [d.state.cpu_limit for d in decisions]
    assert limits[2] == CpuLimit(F({1}), 1.0)
    # The period online rose to 1.4 CPUs: 1.8 - 1.4 = 0.4 CPU at once.
    assert limits[3] == CpuLimit(F({1}), 0.4)
    assert kinds(decisions[3].actions) == ["cpu_suppress"]
    # Held for cpu_release_periods (3) periods including the busy one, then given back.
    assert limits[4] == limits[5] == CpuLimit(F({1}), 0.4)
    assert decisions[4].actions == decisions[5].actions == ()
    assert limits[6] == CpuLimit(F({1}), 1.0)
    assert kinds(decisions[6].actions) == ["cpu_release"]


def test_small_changes_inside_the_band_make_no_action() -> None:
    decisions = run(CONFIG, Series(), [load(0.3, 1.0), load(0.35, 1.0), load(0.28, 1.0)])
    assert kinds(decisions[1].actions) == ["cpu_suppress"]
    assert decisions[2].actions == decisions[3].actions == ()


@pytest.mark.parametrize(
    ("stall", "fragment"),
    [
        pytest.param({"cpu": 0.25}, "online cpu pressure 25%", id="cpu-psi"),
        pytest.param({"io": 0.3}, "online io pressure 30%", id="io-psi"),
    ],
)
def test_online_pressure_cuts_best_effort_to_the_minimum_and_holds_it(stall: dict, fragment: str) -> None:
    series = Series()
    calm = load(0.2, 1.0)
    hot = load(0.2, 1.0)
    hot.online_stall = stall
    calm.online_stall = {}
    decisions = run(CONFIG, series, [calm, hot, calm, calm, calm])
    assert decisions[2].state.cpu_limit == CpuLimit(F({1}), 0.01)
    (action,) = decisions[2].actions
    assert action.kind == "cpu_suppress"
    assert fragment in action.reason
    assert decisions[3].state.cpu_limit == decisions[4].state.cpu_limit == CpuLimit(F({1}), 0.01)
    assert decisions[5].state.cpu_limit == CpuLimit(F({1}), 1.0)


def test_pressure_below_threshold_does_not_suppress() -> None:
    period = load(0.2, 1.0)
    period.online_stall = {"cpu": 0.05, "io": 0.1}
    decisions = run(CONFIG, Series(), [period])
    assert decisions[-1].state.cpu_limit == CpuLimit(F({1}), 1.0)


def test_v1_uses_no_cpu_pressure_but_node_memory_pressure() -> None:
    # Node-wide CPU "some" counts best-effort tasks waiting for each other: ignored.
    series = Series(per_group_psi=False)
    period = load(0.2, 1.0)
    period.node_stall = {"cpu": 0.9, "memory": 0.02}
    last = run(CONFIG, series, [period])[-1]
    assert last.measured is not None
    assert last.measured.online_pressure == {
        "cpu": None,
        "memory": pytest.approx(0.02),
        "io": pytest.approx(0.0),
    }
    assert last.state.cpu_limit == CpuLimit(F({1}), 1.0)


def test_the_hosts_other_use_is_counted_apart_from_online_work() -> None:
    # Online slots use 0.3 CPU and other tenants 0.9 of a 4-CPU pool: best-effort may use what
    # the online slots leave (3.6 - 0.3), not what everything leaves (3.6 - 1.2).
    series = Series(pool=F({0, 1, 2, 3}))
    last = run(CONFIG, series, [load(0.3, 2.0, pool=range(4), host=0.9)])[-1]
    assert last.measured is not None
    assert last.measured.online_cpu == pytest.approx(0.3)
    assert last.measured.host_cpu == pytest.approx(0.9)
    assert last.measured.allowed_cpus == pytest.approx(4 * 0.9 - 0.3)
    assert last.state.cpu_limit == CpuLimit(F({3, 2, 1}), 3.0)
    assert last.batch is not None
    assert last.batch.cpus == pytest.approx(4 * 0.9 - 0.3)


def test_host_cpu_as_online_counts_everything_but_best_effort() -> None:
    config = ColocationConfig(host_cpu_as_online=True)
    series = Series(pool=F({0, 1, 2, 3}))
    last = run(config, series, [load(0.3, 2.0, pool=range(4), host=0.9)])[-1]
    assert last.measured is not None
    assert last.measured.online_cpu == pytest.approx(1.2)
    assert last.measured.host_cpu == pytest.approx(0.9)
    assert last.state.cpu_limit == CpuLimit(F({3, 2}), 2.0)
    assert "1.20 of 4 pool CPUs" in last.actions[0].reason


def test_without_the_online_slots_own_cpu_time_the_host_counts_as_online() -> None:
    # 0.8 CPU busy on CPU 0 and best-effort at 1.0, the burstable class unreadable: whatever is
    # not best-effort is protected.
    series = Series(online_cpu_readable=False)
    period = Period(busy={0: 0.8, 1: 1.0}, best_effort_cpu=1.0, online_cpu=0.1)
    last = run(CONFIG, series, [period])[-1]
    assert last.measured is not None
    assert last.measured.online_cpu == pytest.approx(0.8)
    assert last.measured.host_cpu is None
    assert last.state.cpu_limit == CpuLimit(F({1}), 1.0)


def test_the_slots_never_count_for_more_than_the_pools_use_beside_best_effort() -> None:
    # The class's clock ran a little ahead of /proc/stat's ticks: online is capped, host is 0.
    period = Period(busy={0: 0.5, 1: 1.0}, best_effort_cpu=1.0, online_cpu=0.52)
    last = run(CONFIG, Series(), [period])[-1]
    assert last.measured is not None
    assert last.measured.online_cpu == pytest.approx(0.5)
    assert last.measured.host_cpu == pytest.approx(0.0)


def test_a_pool_that_shrinks_under_the_limit_moves_best_effort() -> None:
    series = Series(pool=F({0, 1, 2, 3}))
    decisions = run(CONFIG, series, [load(0.2, 1.0, pool=range(4))])
    assert decisions[-1].state.cpu_limit == CpuLimit(F({2, 3, 1}), 3.0)
    series.pool = F({0, 1})  # a guaranteed slot took CPUs 2 and 3
    series.exclusive = F({2, 3})
    nxt = decide(CONFIG, decisions[-1].state, series.sample(load(0.2, 0.5)))
    assert nxt.state.cpu_limit == CpuLimit(F({1}), 1.0)
    assert kinds(nxt.actions) == ["cpu_suppress"]


def test_a_gap_between_samples_gives_no_rates() -> None:
    series = Series()
    decisions = run(CONFIG, series, [load(0.3, 1.0)])
    gap = load(1.5, 0.0)
    gap.seconds = 30.0  # the loop stalled (or the host slept): no rate from this
    after = decide(CONFIG, decisions[-1].state, series.sample(gap))
    assert after.measured is None
    assert after.actions == ()
    assert after.state.cpu_limit == decisions[-1].state.cpu_limit


@pytest.mark.parametrize(
    ("pool", "core_of", "count", "tainted", "expected"),
    [
        pytest.param(F({0, 1, 2, 3}), {0: 0, 1: 1, 2: 2, 3: 3}, 2, F(), F({2, 3}), id="no-smt-high-end"),
        pytest.param(F({0, 1, 2, 3}), {0: 0, 1: 1, 2: 2, 3: 3}, 0, F(), F({3}), id="at-least-one"),
        pytest.param(F({0, 1}), {0: 0, 1: 1}, 5, F(), F({0, 1}), id="no-more-than-the-pool"),
        # SMT: CPUs n and n+4 are siblings; best-effort takes whole cores from the top.
        pytest.param(
            F({1, 2, 3, 5, 6, 7}),
            {1: 1, 5: 1, 2: 2, 6: 2, 3: 3, 7: 3},
            2,
            F(),
            F({3, 7}),
            id="smt-whole-core",
        ),
        pytest.param(
            F({1, 2, 3, 5, 6, 7}),
            {1: 1, 5: 1, 2: 2, 6: 2, 3: 3, 7: 3},
            2,
            F({3, 7}),
            F({2, 6}),
            id="smt-tainted",
        ),
        pytest.param(F({1, 5}), {1: 1, 5: 1}, 1, F({1, 5}), F({5}), id="all-tainted-still-one"),
        pytest.param(F(), {}, 3, F(), F(), id="empty-pool"),
    ],
)
def test_choose_cpus(
    pool: frozenset[int], core_of: dict, count: int, tainted: frozenset[int], expected: frozenset[int]
) -> None:
    assert choose_cpus(pool, core_of, count, tainted) == expected


def test_best_effort_keeps_off_the_siblings_of_a_busy_guaranteed_core() -> None:
    # Cores (n, n+4). A guaranteed slot holds CPU 3 only (whole_cores off); its sibling 7 is in the pool.
    core_of = {cpu: cpu % 4 for cpu in range(8)}
    pool = F({1, 2, 5, 6, 7})
    series = Series(pool=pool, core_of=core_of, exclusive=F({3}))
    busy = {3: 1.0, 1: 0.1}
    last = run(CONFIG, series, [Period(busy=busy, best_effort_cpu=0.0)])[-1]
    limit = last.state.cpu_limit
    assert limit is not None
    assert 7 not in limit.cpus
    # 5 * 0.9 - 0.1 = 4.4 -> 4 CPUs: cores 2 (6, 2) and 1 (5, 1) whole, never 7.
    assert limit.cpus == F({1, 2, 5, 6})
    idle = run(CONFIG, Series(pool=pool, core_of=core_of, exclusive=F({3})), [Period(busy={1: 0.1})])[-1]
    assert idle.state.cpu_limit is not None
    assert 7 in idle.state.cpu_limit.cpus  # an idle guaranteed core taints nothing


def test_priorities_give_lower_levels_what_higher_ones_leave() -> None:
    slots = (BestEffortSlot("high", priority=10), BestEffortSlot("low", priority=0))
    series = Series(pool=F({0, 1, 2, 3}), best_effort=slots)
    periods = []
    high_use = 1.0
    for _ in range(6):
        period = load(0.2, 3.0, pool=range(4))
        period.slot_cpu = {"high": high_use, "low": 3.0 - high_use}
        periods.append(period)
        high_use = min(3.0, high_use * 1.4)
    decisions = run(CONFIG, series, periods)
    first = {a.slot_id: a for a in decisions[1].actions if a.kind == "slot_cpu_quota"}
    # Allowed 4 * 0.9 - 0.2 = 3.4 -> 3 CPUs. High may use all of it; low what high's use leaves.
    assert first["high"].quota_cpus == 3.0
    assert first["low"].quota_cpus == pytest.approx(3.0 - (1.0 * 1.25 + 0.05), abs=0.01)
    quotas = decisions[-1].state.slot_quota
    assert quotas["high"] == 3.0
    assert quotas["low"] == 0.01  # squeezed to the minimum once high uses everything
    # The high slot idles: low gets the rest back.
    idle = load(0.2, 2.5, pool=range(4))
    idle.slot_cpu = {"high": 0.0, "low": 2.5}
    back = decide(CONFIG, decisions[-1].state, series.sample(idle))
    low = [a for a in back.actions if a.slot_id == "low"]
    assert low
    assert low[0].quota_cpus == pytest.approx(3.0 - 0.05)


def test_one_priority_sets_no_slot_quota_and_lifts_one_set_before() -> None:
    slots = (BestEffortSlot("a", priority=1), BestEffortSlot("b", priority=0))
    series = Series(best_effort=slots)
    decisions = run(CONFIG, series, [load(0.2, 1.0)])
    assert set(decisions[-1].state.slot_quota) == {"a", "b"}
    series.best_effort = (BestEffortSlot("a", priority=1),)  # b was released
    after = decide(CONFIG, decisions[-1].state, series.sample(load(0.2, 1.0)))
    (lift,) = [a for a in after.actions if a.kind == "slot_cpu_quota"]
    assert lift.slot_id == "a"
    assert lift.quota_cpus is None
    assert after.state.slot_quota == {}


# --------------------------------------------------------------------------- memory bandwidth

MB = 1_000_000


def _bandwidth(
    online: float, periods: int, traffic: dict[str, float], slot_cpu: dict[str, float]
) -> list[Period]:
    out = []
    for _ in range(periods):
        period = load(online, sum(slot_cpu.values()))
        period.slot_cpu = slot_cpu
        period.slot_traffic = traffic
        out.append(period)
    return out


def test_a_bandwidth_hog_gets_the_quota_that_keeps_it_within_the_budget_while_online_runs() -> None:
    slots = (BestEffortSlot("stream"), BestEffortSlot("compute"))
    series = Series(best_effort=slots, traffic_counted=True)
    # stream: 8000 MB/s on 0.8 CPU = 10 GB per CPU-second; compute: 20 MB/s on 0.7 CPU.
    busy = _bandwidth(0.3, 3, {"stream": 8000 * MB, "compute": 20 * MB}, {"stream": 0.8, "compute": 0.7})
    decisions = run(CONFIG, series, busy)
    cut = [a for a in decisions[1].actions if a.kind == "slot_cpu_quota"]
    assert [a.slot_id for a in cut] == ["stream"]  # the compute slot is no hog
    # 1000 MB/s / 10000 MB per CPU-second = 0.1 CPU.
    assert cut[0].quota_cpus == pytest.approx(0.1)
    assert "10000 MB per CPU-second" in cut[0].reason
    assert "no MBA" in cut[0].reason
    assert decisions[1].measured is not None
    assert decisions[1].measured.best_effort_traffic == pytest.approx(8020 * MB, rel=1e-6)
    # Cut, its traffic falls with its CPU; the intensity (traffic per CPU-second) does not.
    state = decisions[-1].state
    for period in _bandwidth(
        0.3, 3, {"stream": 1000 * MB, "compute": 20 * MB}, {"stream": 0.1, "compute": 0.7}
    ):
        decision = decide(CONFIG, state, series.sample(period))
        assert all(a.kind != "slot_cpu_quota" for a in decision.actions)
        state = decision.state
    assert state.bandwidth_capped == {"stream": pytest.approx(0.1)}


def test_the_bandwidth_cut_is_lifted_once_online_work_stops() -> None:
    series = Series(best_effort=(BestEffortSlot("stream"),), traffic_counted=True)
    busy = _bandwidth(0.3, 2, {"stream": 8000 * MB}, {"stream": 0.8})
    decisions = run(CONFIG, series, busy)
    assert decisions[-1].state.slot_quota == {"stream": pytest.approx(0.1)}
    after = [decisions[-1]]
    for period in _bandwidth(0.0, 4, {"stream": 1000 * MB}, {"stream": 0.1}):
        after.append(decide(CONFIG, after[-1].state, series.sample(period)))
    after = after[1:]
    lifted = [(i, a) for i, d in enumerate(after) for a in d.actions if a.kind == "slot_cpu_quota"]
    # Held while online's peak over the release periods (3) stays up, then lifted.
    assert [i for i, _ in lifted] == [2]
    assert lifted[0][1].quota_cpus is None
    assert after[-1].state.bandwidth_capped == {}


def test_hogs_share_the_budget_and_a_slot_that_barely_ran_keeps_its_cut() -> None:
    slots = (BestEffortSlot("a"), BestEffortSlot("b"))
    series = Series(best_effort=slots, traffic_counted=True)
    busy = _bandwidth(0.3, 1, {"a": 5000 * MB, "b": 2500 * MB}, {"a": 0.5, "b": 0.5})
    decisions = run(CONFIG, series, busy)
    quotas = decisions[-1].state.slot_quota
    # Two hogs, 500 MB/s each: a at 10 GB per CPU-second -> 0.05 CPU, b at 5 GB -> 0.1 CPU.
    assert quotas == {"a": pytest.approx(0.05), "b": pytest.approx(0.1)}
    (idle_a,) = _bandwidth(0.3, 1, {"a": 0, "b": 500 * MB}, {"a": 0.0, "b": 0.1})
    after = decide(CONFIG, decisions[-1].state, series.sample(idle_a))
    assert after.state.bandwidth_capped["a"] == pytest.approx(0.05)


def test_without_traffic_counters_or_with_a_zero_budget_nothing_is_cut() -> None:
    traffic = {"stream": 8000 * MB}
    for series, config in (
        (Series(best_effort=(BestEffortSlot("stream"),), traffic_counted=False), CONFIG),
        (
            Series(best_effort=(BestEffortSlot("stream"),), traffic_counted=True),
            replace(CONFIG, best_effort_bandwidth_mb_per_s=0.0),
        ),
    ):
        decisions = run(config, series, _bandwidth(0.3, 3, traffic, {"stream": 0.8}))
        assert all(a.kind != "slot_cpu_quota" for d in decisions for a in d.actions)


def test_priorities_and_the_bandwidth_cut_take_the_smaller_quota() -> None:
    slots = (BestEffortSlot("high", priority=5), BestEffortSlot("low", priority=0))
    series = Series(pool=F({0, 1, 2, 3}), best_effort=slots, traffic_counted=True)
    period = load(0.2, 3.0, pool=range(4))
    period.slot_cpu = {"high": 2.0, "low": 1.0}
    period.slot_traffic = {"high": 40_000 * MB, "low": 10 * MB}
    decision = run(CONFIG, series, [period])[-1]
    quotas = {a.slot_id: a for a in decision.actions if a.kind == "slot_cpu_quota"}
    # high: 20 GB per CPU-second -> 0.05 CPU (below the 3 CPUs its priority allows).
    assert quotas["high"].quota_cpus == pytest.approx(0.05)
    assert "MB per CPU-second" in quotas["high"].reason
    assert "priority 0" in quotas["low"].reason


def test_resctrl_share_narrows_in_the_first_busy_period_and_widens_after_the_release_window() -> None:
    series = Series(best_effort=(BestEffortSlot("a"),), resctrl_group=True)
    periods = [load(0.0, 1.0), load(0.0, 1.0), load(0.5, 1.0), load(0.0, 1.0), load(0.0, 1.0), load(0.0, 1.0)]
    decisions = run(CONFIG, series, periods)
    shares = [[a.kind for a in d.actions if a.kind.startswith("resctrl")] for d in decisions]
    # Made narrow; idle -> wide in the first measured period; narrow the period online load comes;
    # wide again once the release window (3 periods) holds no online work.
    assert shares == [[], ["resctrl_wide"], [], ["resctrl_narrow"], [], [], ["resctrl_wide"]]
    narrow = next(a for a in decisions[3].actions if a.kind == "resctrl_narrow")
    assert narrow.slot_id is None
    assert "0.50 CPUs" in narrow.reason
    without = run(CONFIG, Series(best_effort=(BestEffortSlot("a"),)), periods)
    assert not [a for d in without for a in d.actions if a.kind.startswith("resctrl")]


def test_the_bandwidth_proxy_reads_every_slot_while_online_runs() -> None:
    series = Series(best_effort=(BestEffortSlot("a"),), traffic_counted=True)
    state = run(CONFIG, series, [load(0.3, 0.5)])[-1].state
    assert needs_slot_detail(CONFIG, state, series.sample(load(0.3, 0.5)), priorities=1)
    quiet = run(CONFIG, series, [load(0.0, 0.5)] * 3)[-1].state
    assert not needs_slot_detail(CONFIG, quiet, series.sample(load(0.0, 0.5)), priorities=1)
    counted_off = Series(best_effort=(BestEffortSlot("a"),))
    state = run(CONFIG, counted_off, [load(0.3, 0.5)])[-1].state
    assert not needs_slot_detail(CONFIG, state, counted_off.sample(load(0.3, 0.5)), priorities=1)


# --------------------------------------------------------------------------- memory


def memory_series(**kwargs: object) -> Series:
    slots = (
        BestEffortSlot("old-low", priority=0, started_at=10.0, memory_high=None),
        BestEffortSlot("young-low", priority=0, started_at=50.0, memory_high=None),
        BestEffortSlot("high", priority=5, started_at=60.0, memory_high=None),
    )
    series = Series(memory_total=10 * GiB, memory_used=5 * GiB, best_effort=slots, **kwargs)  # type: ignore[arg-type]
    series.slot_memory = {"old-low": 1 * GiB, "young-low": 512 * MiB, "high": 1 * GiB}
    return series


def test_memory_throttle_holds_best_effort_at_its_size_then_lets_go() -> None:
    series = memory_series()
    decisions = run(
        CONFIG,
        series,
        [Period(memory_used=int(8.2 * GiB)), Period(memory_used=int(7.8 * GiB)), Period(memory_used=7 * GiB)],
    )
    throttle = memory_actions(decisions[1].actions)
    assert kinds(throttle) == ["memory_throttle"] * 3
    assert {a.slot_id: a.memory_high for a in throttle} == {
        "old-low": 1 * GiB,
        "young-low": 512 * MiB,
        "high": 1 * GiB,
    }
    assert "node memory 82% used (throttle at 80%)" in throttle[0].reason
    assert memory_actions(decisions[2].actions) == ()  # 78%: inside the hysteresis, held
    unthrottle = memory_actions(decisions[3].actions)
    assert kinds(unthrottle) == ["memory_unthrottle"] * 3
    assert all(a.memory_high is None for a in unthrottle)
    assert decisions[3].state.throttled == {}


def test_a_slot_under_its_own_lower_limit_is_not_throttled() -> None:
    series = memory_series()
    series.best_effort = (BestEffortSlot("small", memory_high=256 * MiB),)
    series.slot_memory = {"small": 300 * MiB}
    decisions = run(CONFIG, series, [Period(memory_used=int(8.5 * GiB))])
    assert memory_actions(decisions[-1].actions) == ()


def test_eviction_goes_lowest_priority_then_youngest_until_under_the_target() -> None:
    series = memory_series()
    # 91%: evict down below 85%: young-low (0.5 GiB -> 86%), then old-low (1 GiB -> 76%).
    decisions = run(CONFIG, series, [Period(memory_used=int(9.1 * GiB))])
    evictions = [a for a in decisions[-1].actions if a.kind == "evict"]
    assert [a.slot_id for a in evictions] == ["young-low", "old-low"]
    assert evictions[0].memory_bytes == 512 * MiB
    assert "node memory 91% used (evict at 90%, down to 85%)" in evictions[0].reason
    assert set(decisions[-1].state.evicted) == {"young-low", "old-low"}


def test_online_memory_pressure_evicts_one_per_period() -> None:
    series = memory_series()
    hot = Period(online_stall={"memory": 0.3})
    decisions = run(CONFIG, series, [hot])
    evictions = [a for a in decisions[-1].actions if a.kind == "evict"]
    assert [a.slot_id for a in evictions] == ["young-low"]
    assert "online memory pressure 30%" in evictions[0].reason


def test_evicted_workers_come_back_after_calm_highest_priority_first_when_they_fit() -> None:
    config = ColocationConfig(restore_after_seconds=3.0)
    series = memory_series()
    series.slot_memory = {"old-low": 200 * MiB, "young-low": 200 * MiB, "high": 200 * MiB}
    decisions = run(config, series, [Period(memory_used=int(9.5 * GiB))])
    evicted = set(decisions[-1].state.evicted)
    assert evicted == {"young-low", "old-low", "high"}
    # The agent stopped them: the next samples say so, and memory falls.
    series.best_effort = tuple(
        BestEffortSlot(s.slot_id, s.priority, s.started_at, running=False, evicted=True)
        for s in series.best_effort
    )
    series.slot_memory = {}
    state = decisions[-1].state
    restored: list[tuple[int, str]] = []
    for second in range(12):
        decision = decide(config, state, series.sample(Period(memory_used=int(6 * GiB), slot_memory={})))
        state = decision.state
        for action in memory_actions(decision.actions):
            assert action.kind == "restore"
            restored.append((second, action.slot_id or ""))
            series.best_effort = tuple(
                BestEffortSlot(s.slot_id, s.priority, s.started_at) if s.slot_id == action.slot_id else s
                for s in series.best_effort
            )
    # Calm from the first period; one restore every 3 s; high first, then the low ones in the
    # order they were evicted (youngest first, as eviction went).
    assert [name for _, name in restored] == ["high", "young-low", "old-low"]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(restored)]
    assert all(gap >= 3 for gap in gaps)


def test_a_worker_that_would_not_fit_is_not_restored() -> None:
    config = ColocationConfig(restore_after_seconds=0.0)
    series = memory_series()
    series.best_effort = (BestEffortSlot("big", running=False, evicted=True),)
    from nodeagent.isolation.colocation import Eviction

    state = LoopState(evicted={"big": Eviction(at=0.0, memory_bytes=3 * GiB, reason="test")})
    first = decide(config, state, series.sample())
    # 5 GiB used + 3 GiB = 80% >= 75%: it stays evicted.
    nxt = decide(config, first.state, series.sample(Period()))
    assert memory_actions(nxt.actions) == ()
    assert "big" in nxt.state.evicted


def test_an_operator_start_forgets_the_eviction() -> None:
    series = memory_series()
    decisions = run(CONFIG, series, [Period(memory_used=int(9.1 * GiB))])
    assert "young-low" in decisions[-1].state.evicted
    # The agent reports it not evicted any more (started by hand): the loop lets it be.
    after = decide(CONFIG, decisions[-1].state, series.sample(Period(memory_used=6 * GiB)))
    assert "young-low" not in after.state.evicted
    assert not [a for a in after.actions if a.kind in ("restore", "evict")]


# --------------------------------------------------------------------------- batch


def test_batch_is_what_online_leaves_over_the_window_minus_the_margins() -> None:
    config = ColocationConfig(batch_window_seconds=3.0)
    series = Series(memory_total=10 * GiB, memory_used=4 * GiB, online_memory=2 * GiB)
    series.best_effort = (BestEffortSlot("e"),)
    series.slot_memory = {"e": 1 * GiB}
    spike = load(1.2, 0.5)
    spike.online_memory = 3 * GiB
    spike.memory_used = 5 * GiB
    after = load(0.2, 1.0)
    after.online_memory = 2 * GiB
    after.memory_used = 4 * GiB
    decisions = run(
        config, series, [load(0.2, 1.0), spike, after, load(0.2, 1.0), load(0.2, 1.0), load(0.2, 1.0)]
    )
    # Right after the spike: online peak 1.2 CPUs -> 2 * 0.9 - 1.2 = 0.6.
    batch = decisions[2].batch
    assert batch is not None
    assert batch.cpus == pytest.approx(0.6)
    assert batch.online_memory_peak == 3 * GiB
    # A few periods later memory is back at 2 GiB but the window still holds the 3 GiB peak:
    # available 6 GiB + best-effort's 1 GiB - 20% margin (2 GiB) - (3 - 2) GiB peak headroom = 4 GiB.
    later = decisions[4].batch
    assert later is not None
    assert later.memory_bytes == 6 * GiB + 1 * GiB - 2 * GiB - 1 * GiB
    # Once the spike leaves the 3 s window, both come back.
    final = decisions[-1].batch
    assert final is not None
    assert final.cpus == pytest.approx(1.6)
    assert final.memory_bytes == 6 * GiB + 1 * GiB - 2 * GiB
    assert final.to_json()["online_used_peak"] == {"cpus": 0.2, "memory_bytes": 2 * GiB}


# --------------------------------------------------------------------------- plumbing


def test_actions_by_slot_puts_class_actions_under_every_best_effort_slot() -> None:
    suppress = Action("cpu_suppress", None, "x", cpus=F({1}), quota_cpus=0.5)
    evict = Action("evict", "a", "y", memory_bytes=1)
    assert actions_by_slot([suppress, evict], ["a", "b"]) == {"a": [suppress, evict], "b": [suppress]}
    assert suppress.to_json() == {
        "action": "cpu_suppress",
        "slot_id": None,
        "reason": "x",
        "cpus": [1],
        "quota_cpus": 0.5,
    }
    assert evict.to_json() == {"action": "evict", "slot_id": "a", "reason": "y", "memory_bytes": 1}


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        pytest.param({"cpu_margin": 1.0}, "qos.cpu_margin is 1.0", id="margin"),
        pytest.param({"period_seconds": 0}, "qos.period_seconds", id="period"),
        pytest.param({"memory_evict_target_percent": 95.0}, "below memory_evict_percent", id="target"),
        pytest.param(
            {"memory_throttle_percent": 95.0}, "throttled before it is evicted", id="throttle-above-evict"
        ),
        pytest.param({"cpu_release_periods": 0}, "qos.cpu_release_periods", id="release-periods"),
    ],
)
def test_config_errors_name_the_key(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ColocationConfig(**kwargs)


# --------------------------------------------------------------------------- a recorded series


def _replay(config: ColocationConfig) -> list[Decision]:
    state = LoopState()
    decisions = []
    for sample in recorded("colocation-recorded"):
        decision = decide(config, state, sample)
        state = decision.state
        decisions.append(decision)
    return decisions


@pytest.mark.parametrize(
    "config", [CONFIG, ColocationConfig(host_cpu_as_online=True)], ids=["apart", "as-online"]
)
def test_recorded_series_from_a_loaded_host(config: ColocationConfig) -> None:
    """bench/colocation.py --record on the 2-vCPU development VM, first round of the loop: an online
    OIP worker under 100 req/s starting after the loop, best-effort CPU and bandwidth hogs, and the
    host's other tenants taking what best-effort gives up."""
    decisions = _replay(config)
    measured = [d.measured for d in decisions]
    assert measured[0] is None
    assert all(m is not None for m in measured[1:])
    # The first rated period already cuts best-effort to what online work leaves less the margin
    # (its cpuset whole CPUs of that, the quota no more than the cpuset holds).
    first = decisions[1]
    assert first.measured is not None
    assert [a.kind for a in first.actions] == ["cpu_suppress"]
    allowed = 2 * 0.9 - first.measured.online_cpu
    assert first.actions[0].quota_cpus == pytest.approx(min(allowed, max(1, math.floor(allowed))), abs=0.011)
    # The kernel held best-effort to each period's quota (recorded use in the next period), and the
    # quota never let it into the margin above online use.
    limits = [d.state.cpu_limit for d in decisions]
    for limit, after in zip(limits[1:], measured[2:], strict=False):
        assert limit is not None
        assert after is not None
        assert after.best_effort_cpu <= limit.quota + 0.05
    for decision in decisions[1:]:
        assert decision.measured is not None
        assert decision.state.cpu_limit is not None
        assert decision.state.cpu_limit.quota <= max(
            CONFIG.min_cpus, 2 * 0.9 - decision.measured.online_cpu + 0.01
        )
    # Steady load, no flapping: a handful of CPU actions over the whole series.
    assert sum(len(d.actions) for d in decisions) <= 8


def test_recorded_other_tenants_no_longer_take_best_effort_s_allowance() -> None:
    """The same recording: the host's other tenants used CPU in most periods; counted apart, they
    leave best-effort a larger allowance than when they count as online work."""
    apart, as_online = _replay(CONFIG), _replay(ColocationConfig(host_cpu_as_online=True))
    hosts = [d.measured.host_cpu for d in apart[1:] if d.measured is not None]
    assert all(h is not None for h in hosts)
    assert statistics.median(h for h in hosts if h is not None) > 0.1

    def mean_allowed(decisions: list[Decision]) -> float:
        return statistics.fmean(d.measured.allowed_cpus for d in decisions[1:] if d.measured is not None)

    assert mean_allowed(apart) > mean_allowed(as_online) + 0.1


# --------------------------------------------------------------------------- when slots are read


def _calm() -> tuple[Series, LoopState]:
    """Two best-effort slots of one priority, node memory at 25 %, one period already decided."""
    series = Series(best_effort=(BestEffortSlot("a"), BestEffortSlot("b")))
    state = decide(CONFIG, LoopState(), series.sample()).state
    return series, state


def test_a_calm_period_is_decided_from_the_class_totals() -> None:
    series, state = _calm()
    assert not needs_slot_detail(CONFIG, state, series.sample(load(0.2, 0.3)), priorities=1)


def test_the_first_period_and_a_gap_read_every_slot() -> None:
    series = Series(best_effort=(BestEffortSlot("a"),))
    assert needs_slot_detail(CONFIG, LoopState(), series.sample(), priorities=1)


@pytest.mark.parametrize(
    ("used_gib", "wanted"),
    [(11.0, False), (11.3, True), (13.0, True)],  # 16 GiB: the line is 80 - 5 - 5 = 70 % (11.2 GiB)
    ids=["below-the-line", "near-the-throttle", "throttling"],
)
def test_memory_near_the_throttle_line_reads_every_slot(used_gib: float, wanted: bool) -> None:
    series, state = _calm()
    sample = series.sample(Period(memory_used=int(used_gib * GiB)))
    assert needs_slot_detail(CONFIG, state, sample, priorities=1) is wanted


def test_online_memory_pressure_reads_every_slot() -> None:
    series, state = _calm()
    sample = series.sample(Period(online_stall={"memory": CONFIG.memory_pressure_threshold / 2}))
    assert needs_slot_detail(CONFIG, state, sample, priorities=1)


def test_slots_the_loop_holds_or_two_priorities_read_every_slot() -> None:
    series, state = _calm()
    sample = series.sample(load(0.2, 0.3))
    assert needs_slot_detail(CONFIG, state, sample, priorities=2)
    for held in (
        {"throttled": {"a": 64 * MiB}},
        {"slot_quota": {"a": 0.5}},
    ):
        assert needs_slot_detail(CONFIG, replace(state, **held), sample, priorities=1), held


def test_a_period_without_the_slots_decides_the_same_cpu_limit_and_batch_memory() -> None:
    # What the class totals decide alone must be what the full read decides when nothing
    # per slot is called for: the same actions, and the batch's best-effort memory from the class.
    series, state = _calm()
    full = series.sample(load(1.2, 0.3))
    total = sum(s.usage.memory_bytes or 0 for s in full.best_effort)
    partial = replace(
        full,
        best_effort=tuple(replace(s, usage=GroupUsage()) for s in full.best_effort),
        best_effort_memory_bytes=total,
        slots_read=False,
    )
    a, b = decide(CONFIG, state, full), decide(CONFIG, state, partial)
    assert a.actions == b.actions
    assert a.batch is not None
    assert b.batch is not None
    assert a.batch.best_effort_memory == b.batch.best_effort_memory == total
