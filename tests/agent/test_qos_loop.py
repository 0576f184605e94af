"""The agent's QoS loop with a scripted sampler, a recording actuator and a small fake manager:
what it carries out, what it records where (slot view, counters, batch), admission and errors."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nodeagent.agent.qos_loop import RECENT_ACTIONS, REFRESH_SECONDS, RELIST_SECONDS, QosLoop
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.errors import CgroupError, NotFound, PlacementError
from nodeagent.isolation.colocation import Action, ColocationConfig, GroupUsage, Sample
from nodeagent.isolation.colocation_kernel import SlotInfo
from nodeagent.runtime.supervisor import Phase, WorkerStatus
from nodeagent.schema.request import parse_slot_request
from tests.isolation.colocation_series import GiB, Period, Series, load

F = frozenset


def slot(slot_id: str, qos: str, *, priority: int = 0, phase: Phase | None = Phase.RUNNING) -> Slot:
    body: dict[str, Any] = {"name": slot_id, "qos": qos, "resources": {"memory": "64Mi"}}
    if qos == "guaranteed":
        body["resources"]["cpus"] = 1
    if priority:
        body["priority"] = priority
    worker = None if phase is None else WorkerStatus(phase, 100, 0, 0, None, None, str(phase))
    return Slot(
        id=slot_id,
        name=slot_id,
        state=SlotState.RUNNING,
        request=parse_slot_request(body),
        assignment=None,
        applied=None,
        created_at=1000.0 + len(slot_id),
        worker=worker,
    )


class FakeManager:
    def __init__(self, slots: list[Slot]) -> None:
        self.slots = {s.id: s for s in slots}
        self.evicted: list[str] = []
        self.restored: list[str] = []
        self.subscribers: list[Callable[[], None]] = []

    def list_slots(self) -> list[Slot]:
        # The real manager's slots carry a cgroup; the loop skips those without.
        return [replace(s, applied=_applied(s)) for s in self.slots.values()]

    def get_slot(self, slot_id: str) -> Slot:
        if slot_id not in self.slots:
            raise NotFound(slot_id)
        return replace(self.slots[slot_id], applied=_applied(self.slots[slot_id]))

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.subscribers.append(callback)

    def set_phase(self, slot_id: str, phase: Phase) -> None:
        self.slots[slot_id] = replace(
            self.slots[slot_id], worker=WorkerStatus(phase, None, 0, 0, None, None, str(phase))
        )

    def evict_worker(self, slot_id: str, reason: str) -> bool:
        self.evicted.append(slot_id)
        self.set_phase(slot_id, Phase.STOPPING)
        return True

    def restore_worker(self, slot_id: str, reason: str) -> bool:
        self.restored.append(slot_id)
        self.set_phase(slot_id, Phase.RUNNING)
        return True


def _applied(s: Slot) -> Any:
    from nodeagent.isolation.isolator import AppliedSlot

    return AppliedSlot(s.id, s.qos, f"na.slice/{s.id}", "v1", (), None, F(), None, None, False, 0, ())


@dataclass
class ScriptedSampler:
    """Hands out the samples of a Series; ``period`` says what happens next."""

    series: Series
    period: Period | None = None
    seen: list[Sequence[SlotInfo]] = field(default_factory=list)
    slots_read: list[bool] = field(default_factory=list)
    traffic: Any = None  # no cache-miss counters

    def sample(
        self, slots: Sequence[SlotInfo], now: float, *, read_slots: Callable[[Sample], bool] | bool = True
    ) -> Sample:
        """The series' next sample, with what the agent told the sampler (as the real one does);
        without ``read_slots``, the slots' own usage is left out as the real one leaves it."""
        self.seen.append(list(slots))
        period, self.period = self.period, None
        sample = self.series.sample(period)
        infos = {i.slot_id: i for i in slots}
        sample = replace(
            sample,
            best_effort=tuple(
                replace(s, running=infos[s.slot_id].running, evicted=infos[s.slot_id].evicted)
                if s.slot_id in infos
                else s
                for s in sample.best_effort
            ),
            best_effort_memory_bytes=sum(s.usage.memory_bytes or 0 for s in sample.best_effort),
        )
        partial = replace(
            sample,
            best_effort=tuple(replace(s, usage=GroupUsage()) for s in sample.best_effort),
            slots_read=False,
        )
        read = read_slots if isinstance(read_slots, bool) else read_slots(partial)
        self.slots_read.append(read)
        return sample if read else partial


class RecordingActuator:
    host = None
    resctrl_ready = False

    def __init__(self) -> None:
        self.applied: list[Action] = []
        self.killed: list[str] = []
        self.tended: list[list[str]] = []
        self.fail: type[Exception] | None = None

    def apply(self, action: Action) -> None:
        if self.fail is not None:
            raise self.fail("refused")
        self.applied.append(action)

    def tend(self, slot_ids: list[str]) -> int:
        self.tended.append(list(slot_ids))
        return 0

    def kill(self, cgroup: str) -> None:
        self.killed.append(cgroup)

    def prepare_resctrl(self) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_loop(
    slots: list[Slot], series: Series, **kwargs: Any
) -> tuple[QosLoop, FakeManager, ScriptedSampler, RecordingActuator, Clock]:
    manager = FakeManager(slots)
    sampler = ScriptedSampler(series)
    actuator = RecordingActuator()
    clock = Clock()
    loop = QosLoop(
        manager,  # type: ignore[arg-type]
        sampler,  # type: ignore[arg-type]
        actuator,  # type: ignore[arg-type]
        kwargs.pop("config", ColocationConfig(restore_after_seconds=2.0)),
        clock=clock,
        wall=lambda: 1_700_000_000.0,
        **kwargs,
    )
    return loop, manager, sampler, actuator, clock


def step(loop: QosLoop, sampler: ScriptedSampler, clock: Clock, period: Period | None = None) -> None:
    sampler.period = period
    clock.now += 1.0
    loop.run_once()


def test_cpu_actions_are_carried_out_and_shown_on_every_best_effort_slot() -> None:
    slots = [slot("web", "burstable"), slot("e1", "best-effort"), slot("e2", "best-effort")]
    series = Series()
    loop, _, sampler, actuator, clock = make_loop(slots, series)
    step(loop, sampler, clock)
    assert loop.batch() is None  # nothing measured yet
    step(loop, sampler, clock, load(0.3, 1.5, host=0.2))
    (action,) = actuator.applied
    assert action.kind == "cpu_suppress"
    for slot_id in ("e1", "e2"):
        actions, evicted = loop.slot_view(slot_id)
        assert not evicted
        assert [a["action"] for a in actions] == ["cpu_suppress"]
        assert actions[0]["cpus"] == [1]
        assert actions[0]["seq"] == 1
    assert loop.slot_view("web") == ((), False)
    assert loop.counts["cpu_suppress"] == 1
    batch = loop.batch()
    assert batch is not None
    assert batch["cpus"] == pytest.approx(1.5)
    assert batch["best_effort_allowed"] == {"cpus": 1.0, "cpuset": "1"}
    assert batch["host_used"] == {"cpus": pytest.approx(0.2)}
    # The sampler was told which slots exist, their class and their priorities.
    assert {(i.slot_id, i.qos) for i in sampler.seen[-1]} == {
        ("web", "burstable"),
        ("e1", "best-effort"),
        ("e2", "best-effort"),
    }
    assert actuator.tended[-1] == ["e1", "e2"]


def test_the_hosts_use_counts_as_online_while_a_kubernetes_burstable_container_holds_a_slot() -> None:
    # An NRI container's work runs in the kubelet's cgroup: the burstable class does not see it,
    # so the host's use (which holds it) counts as online while such a slot exists.
    slots = [slot("nri-0123456789abcdef", "burstable"), slot("e1", "best-effort")]
    loop, manager, sampler, _, clock = make_loop(slots, Series())
    step(loop, sampler, clock)
    step(loop, sampler, clock, load(0.0, 1.0, host=0.9))
    assert loop.measured is not None
    assert loop.measured.online_cpu == pytest.approx(0.9)
    assert loop.state.cpu_limit is not None
    assert loop.state.cpu_limit.quota == pytest.approx(0.9)
    # Released: the host's use is the host's again.
    manager.slots.pop("nri-0123456789abcdef")
    loop._on_change()  # the manager's change notice
    step(loop, sampler, clock, load(0.0, 1.0, host=0.9))
    assert loop.measured.online_cpu == pytest.approx(0.0)


def test_recent_actions_are_bounded() -> None:
    loop = make_loop([slot("e1", "best-effort")], Series())[0]
    action = Action("slot_cpu_quota", "e1", "x", quota_cpus=0.5)
    for _ in range(RECENT_ACTIONS + 5):
        loop._record(action, ["e1"])
    actions, _ = loop.slot_view("e1")
    assert len(actions) == RECENT_ACTIONS
    assert actions[-1]["seq"] == RECENT_ACTIONS + 5


def memory_setup() -> tuple[QosLoop, FakeManager, ScriptedSampler, RecordingActuator, Clock, Series]:
    from nodeagent.isolation.colocation import BestEffortSlot

    slots = [slot("web", "burstable"), slot("hog", "best-effort")]
    series = Series(memory_total=10 * GiB, memory_used=5 * GiB)
    series.best_effort = (BestEffortSlot("hog", running=True),)
    series.slot_memory = {"hog": 3 * GiB}
    loop, manager, sampler, actuator, clock = make_loop(slots, series, evict_grace_seconds=2.0)
    step(loop, sampler, clock)
    return loop, manager, sampler, actuator, clock, series


def test_eviction_goes_through_the_manager_then_kills_after_the_grace_then_restores() -> None:

    loop, manager, sampler, actuator, clock, series = memory_setup()
    step(loop, sampler, clock, Period(memory_used=int(9.2 * GiB)))
    assert manager.evicted == ["hog"]
    actions, evicted = loop.slot_view("hog")
    assert evicted
    assert actions[-1]["action"] == "evict"
    assert "calm" in actions[-1]["restart"]
    assert loop.evicted == F({"hog"})
    # Still stopping after the grace period: the loop kills the slot's processes.
    step(loop, sampler, clock, Period(memory_used=int(9.2 * GiB)))
    assert actuator.killed == []
    step(loop, sampler, clock, Period(memory_used=int(9.2 * GiB)))
    assert actuator.killed == ["na.slice/hog"]
    manager.set_phase("hog", Phase.STOPPED)
    series.slot_memory = {"hog": 0}
    for _ in range(5):
        # 4 GiB used + the 3 GiB it had = 70%: fits below 75% once calm for 2 s.
        step(loop, sampler, clock, Period(memory_used=4 * GiB))
    assert manager.restored == ["hog"]
    actions, evicted = loop.slot_view("hog")
    assert not evicted
    assert actions[-1]["action"] == "restore"
    assert loop.counts["evict"] == loop.counts["restore"] == 1


def test_an_eviction_the_manager_cannot_do_is_not_recorded() -> None:
    loop, manager, sampler, _, clock, _ = memory_setup()
    manager.evict_worker = lambda slot_id, reason: False  # type: ignore[method-assign]
    step(loop, sampler, clock, Period(memory_used=int(9.2 * GiB)))
    actions, evicted = loop.slot_view("hog")
    assert not evicted
    assert "evict" not in [a["action"] for a in actions]
    assert loop.counts["evict"] == 0
    assert "hog" not in loop.state.evicted


def test_a_worker_the_operator_starts_again_is_left_alone() -> None:
    loop, manager, sampler, actuator, clock, _ = memory_setup()
    step(loop, sampler, clock, Period(memory_used=int(9.2 * GiB)))
    manager.set_phase("hog", Phase.STOPPED)
    step(loop, sampler, clock)
    manager.set_phase("hog", Phase.RUNNING)  # POST /v1/slots/hog/worker
    step(loop, sampler, clock)
    assert loop.evicted == F()
    assert actuator.killed == []


def test_a_failed_action_is_counted_and_tried_again_next_period() -> None:
    loop, _, sampler, actuator, clock = make_loop([slot("e1", "best-effort")], Series())
    step(loop, sampler, clock)
    actuator.fail = CgroupError
    step(loop, sampler, clock, load(0.3, 1.5))
    assert loop.errors == 1
    assert loop.state.cpu_limit is None
    assert loop.slot_view("e1") == ((), False)
    actuator.fail = None
    step(loop, sampler, clock, load(0.3, 1.5))
    assert [a.kind for a in actuator.applied] == ["cpu_suppress"]


def test_batch_admission_bounds_best_effort_requests() -> None:
    loop, _, sampler, _, clock = make_loop(
        [slot("web", "burstable")],
        Series(memory_total=10 * GiB, memory_used=4 * GiB),
        admission="batch",
        best_effort_overcommit=2.0,
    )
    request = parse_slot_request(
        {"name": "b", "qos": "best-effort", "resources": {"cpus": 2, "memory": "1Gi"}}
    )
    step(loop, sampler, clock)
    loop.admit(request, 0.0, 0)  # nothing measured yet: placement decides alone
    step(loop, sampler, clock, load(0.8, 0.0))
    # Batch: 2 * 0.9 - 0.8 = 1.0 CPU, x2 overcommit = 2.0.
    loop.admit(request, 0.0, 0)
    with pytest.raises(PlacementError, match=r"holds? 0.5 and may hold 2.00 now .*x2 overcommit"):
        loop.admit(request, 0.5, 0)
    big = parse_slot_request({"name": "m", "qos": "best-effort", "resources": {"memory": "8Gi"}})
    with pytest.raises(PlacementError, match="batch memory"):
        loop.admit(big, 0.0, 0)
    loop.admission = "allocatable"
    loop.admit(big, 100.0, 0)


def test_metrics_collector_exports_the_loop() -> None:
    slots = [slot("web", "burstable"), slot("e1", "best-effort")]
    loop, _, sampler, _, clock = make_loop(slots, Series())
    step(loop, sampler, clock)
    step(loop, sampler, clock, load(0.3, 1.5, host=0.1))
    registry = CollectorRegistry()
    registry.register(loop.collector())
    text = generate_latest(registry).decode()
    assert 'nodeagent_qos_actions_total{action="cpu_suppress"} 1.0' in text
    assert 'nodeagent_qos_actions_total{action="evict"} 0.0' in text
    assert 'nodeagent_qos_best_effort_cpus{kind="quota"} 1.0' in text
    assert 'nodeagent_batch_capacity{resource="cpus"} 1.5' in text
    usage = {
        kind: float(value)
        for kind, value in re.findall(r'nodeagent_qos_pool_cpu_usage\{kind="(\w+)"\} (\S+)', text)
    }
    assert usage == {
        "online": pytest.approx(0.3),
        "best_effort": pytest.approx(1.5),
        "host": pytest.approx(0.1),
    }
    assert "nodeagent_qos_periods_total 2.0" in text
    assert "nodeagent_qos_loop_cpu_seconds_total" in text


def test_slots_without_a_cgroup_are_not_sampled() -> None:
    loop, manager, sampler, _, clock = make_loop([slot("e1", "best-effort")], Series())
    manager.list_slots = lambda: [manager.slots["e1"]]  # type: ignore[method-assign]
    step(loop, sampler, clock)
    assert sampler.seen[-1] == []


def test_slot_list_is_read_again_on_change_notices_only() -> None:
    loop, manager, sampler, actuator, clock = make_loop([slot("e1", "best-effort", priority=5)], Series())
    loop.start()  # subscribes to the manager's change notices (and runs a first period)
    loop.stop()
    assert len(manager.subscribers) == 1
    calls: list[int] = []
    original = manager.list_slots
    manager.list_slots = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    tended = len(actuator.tended)
    step(loop, sampler, clock)
    step(loop, sampler, clock)
    assert calls == []
    assert len(actuator.tended) == tended  # processes are tended when slots change, not every period
    assert sampler.seen[-1][0].priority == 5
    manager.subscribers[0]()
    step(loop, sampler, clock)
    step(loop, sampler, clock)
    assert calls == [1]
    assert len(actuator.tended) == tended + 1
    clock.now += REFRESH_SECONDS  # processes are tended at least every REFRESH_SECONDS ...
    step(loop, sampler, clock)
    assert len(actuator.tended) == tended + 1  # ... once best-effort ran since (nothing did)
    step(loop, sampler, clock, Period(best_effort_cpu=0.5))
    assert calls == [1]
    assert len(actuator.tended) == tended + 2
    step(loop, sampler, clock, Period(best_effort_cpu=0.5))
    assert len(actuator.tended) == tended + 2
    clock.now += RELIST_SECONDS  # and the list read again at least every RELIST_SECONDS
    step(loop, sampler, clock)
    assert calls == [1, 1]


def test_calm_periods_read_the_slots_only_every_slot_detail_period_and_when_memory_nears_the_line() -> None:
    from nodeagent.isolation.colocation import SLOT_DETAIL_EVERY, BestEffortSlot

    slots = [slot("e1", "best-effort"), slot("e2", "best-effort")]
    series = Series(best_effort=(BestEffortSlot("e1"), BestEffortSlot("e2")))
    loop, _, sampler, _, clock = make_loop(slots, series)
    for _ in range(2 * SLOT_DETAIL_EVERY):
        step(loop, sampler, clock, load(0.2, 0.3))
    # The first period (nothing to rate against) and then every SLOT_DETAIL_EVERY-th.
    read = [n for n, was_read in enumerate(sampler.slots_read) if was_read]
    assert read == [0, SLOT_DETAIL_EVERY]
    # Node memory near the throttle line: every period reads each slot, and the throttle that
    # follows is decided from their sizes.
    step(loop, sampler, clock, Period(memory_used=13 * GiB))
    step(loop, sampler, clock, Period(memory_used=13 * GiB))
    assert sampler.slots_read[-2:] == [True, True]
    assert "memory_throttle" in [a["action"] for a in loop.slot_view("e1")[0]]
