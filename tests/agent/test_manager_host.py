"""The slot manager's one wire to host partitioning: the host follows the exclusive CPUs the slots
hold (allocate, resize, release, rollback, reconcile), foreign CPU time shows on guaranteed slots,
and the interrupt load reaches placement."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.state import StateStore
from nodeagent.errors import CgroupError
from nodeagent.isolation.foreign import ForeignCpu
from nodeagent.schema.pool import standby_name
from nodeagent.schema.request import ResourcesPatch, parse_slot_request
from tests.agent.test_manager import TOPOLOGY, FakeIsolation, FakeRuntime, World, guaranteed, store_name

F = frozenset


class FakeHost:
    """Records what the manager tells it."""

    def __init__(self, irq_load: Mapping[int, int] | None = None) -> None:
        self.calls: list[frozenset[int]] = []
        self.closed: list[bool] = []
        self.started = 0
        self.released: list[str] = []
        self._irq_load = irq_load

    def partition(self, exclusive: frozenset[int]) -> None:
        self.calls.append(frozenset(exclusive))

    def foreign_cpu(self, slot_id: str, cpus: frozenset[int], cgroup: str | None) -> ForeignCpu | None:
        return ForeignCpu(seconds=0.5, fraction=0.01, since=7.0, irq_seconds=0.1, elapsed=25.0)

    def slot_released(self, slot_id: str) -> None:
        self.released.append(slot_id)

    def irq_load(self) -> Mapping[int, int] | None:
        return self._irq_load

    def status(self) -> dict[str, Any]:
        return {"mode": "auto", "active": bool(self.calls and self.calls[-1])}

    def start(self) -> None:
        self.started += 1

    def close(self, *, exclusive_held: bool) -> None:
        self.closed.append(exclusive_held)


@pytest.fixture
def build(tmp_path: Path, world: World) -> Iterator[Any]:
    managers: list[SlotManager] = []

    def make(host: FakeHost, *, supervise: bool = False) -> SlotManager:
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        isolation = FakeIsolation(world, names=lambda slot_id: store_name(store, slot_id))
        manager = SlotManager(store, TOPOLOGY, isolation, FakeRuntime(world), host=host)
        managers.append(manager)
        manager.start(supervise=supervise)
        return manager

    yield make
    for manager in managers:
        manager.close()


@pytest.fixture
def world() -> World:
    return World()


def test_the_host_follows_the_exclusive_cpus_through_a_slots_life(build: Any) -> None:
    host = FakeHost()
    manager = build(host)
    assert host.calls == [F()]  # reconcile: nothing held, so whatever a crash left is put back
    web = manager.allocate(parse_slot_request(guaranteed("web", cpus=2))).slot
    assert web.assignment is not None
    cpus = F(web.assignment.cpus)
    assert host.calls[-1] == cpus
    manager.resize(web.id, ResourcesPatch(cpus=4))
    grown = manager.get_slot(web.id)
    assert grown.assignment is not None
    assert host.calls[-1] == F(grown.assignment.cpus)
    assert len(grown.assignment.cpus) == 4
    shared = {"name": "b", "qos": "burstable", "resources": {"cpus": 0.5, "memory": "64Mi"}}
    manager.allocate(parse_slot_request(shared))
    assert len(host.calls) == 3  # shared slots change nothing exclusive
    manager.release(web.id)
    assert host.calls[-1] == F()
    assert host.released == [web.id]


def test_a_failed_allocate_puts_the_host_back(build: Any, world: World) -> None:
    host = FakeHost()
    manager = build(host)
    world.fail_apply.add("web")
    with pytest.raises(CgroupError):
        manager.allocate(parse_slot_request(guaranteed("web")))
    # Confined before isolation ran (the slot's CPUs were held), put back when it was rolled back.
    assert len(host.calls[1]) == 2
    assert host.calls[-1] == F()


def test_foreign_cpu_shows_on_guaranteed_slots_only(build: Any) -> None:
    manager = build(FakeHost())
    web = manager.allocate(parse_slot_request(guaranteed("web"))).slot
    shared = manager.allocate(
        parse_slot_request({"name": "b", "qos": "burstable", "resources": {"cpus": 0.5, "memory": "64Mi"}})
    ).slot
    assert web.to_json()["foreign_cpu"] == {
        "seconds": 0.5,
        "fraction": 0.01,
        "since": 7.0,
        "irq_seconds": 0.1,
    }
    assert shared.to_json()["foreign_cpu"] is None
    assert manager.node().to_dict()["host_partitioning"] == {"mode": "auto", "active": True}


def test_a_restart_with_exclusive_slots_confines_once_and_close_keeps_it(build: Any) -> None:
    first = FakeHost()
    manager = build(first, supervise=True)
    web = manager.allocate(parse_slot_request(guaranteed("web"))).slot
    manager.close()
    assert first.closed == [True]  # exclusive CPUs still held: the host stays confined
    assert first.started == 1
    second = FakeHost()
    build(second)
    assert web.assignment is not None
    assert second.calls == [F(web.assignment.cpus)]


def test_interrupt_load_breaks_ties_between_cores(tmp_path: Path, world: World) -> None:
    # Node 0 of the synthetic topology has cores 0-3 (CPUs k and k+8); core 0 is reserved. Without
    # interrupt counts the first free core (CPUs 1, 9) is taken; with CPU 1 the busiest, the next.
    chosen = []
    for name, load in (("plain", None), ("quiet", {0: 0, 1: 10_000, 2: 0, 3: 0})):
        store = StateStore(tmp_path / f"{name}.db", manifests=Manifests(tmp_path / name))
        manager = SlotManager(
            store, TOPOLOGY, FakeIsolation(World()), FakeRuntime(World()), host=FakeHost(load)
        )
        manager.start(supervise=False)
        slot = manager.allocate(parse_slot_request(guaranteed("web", cpus=2, numa="single"))).slot
        assert slot.assignment is not None
        chosen.append(slot.assignment.cpus)
        manager.close()
    assert chosen == [(1, 9), (2, 10)]


def test_metrics_show_foreign_cpu_and_the_hosts_confinement(build: Any) -> None:
    from nodeagent.agent.metrics import Metrics

    host = FakeHost()
    manager = build(host)
    web = manager.allocate(parse_slot_request(guaranteed("web"))).slot
    host.status = lambda: {  # type: ignore[method-assign]
        "mode": "auto",
        "active": True,
        "last": {"confined": {"tasks": 12, "irq": 3}, "immovable": ["a", "b"]},
    }
    text = Metrics(manager).render()[0].decode()
    labels = f'name="web",slot="{web.id}"'
    assert f"nodeagent_slot_foreign_cpu_seconds_total{{{labels}}} 0.5" in text
    assert f"nodeagent_slot_foreign_irq_seconds_total{{{labels}}} 0.1" in text
    assert f"nodeagent_slot_foreign_cpu_fraction{{{labels}}} 0.01" in text
    assert "nodeagent_host_partitioning_active 1.0" in text
    assert 'nodeagent_host_confined_items{kind="tasks"} 12.0' in text
    assert "nodeagent_host_immovable_items 2.0" in text


def test_the_host_is_kept_off_the_cpus_a_pools_next_claim_will_take(build: Any) -> None:
    host = FakeHost()
    manager = build(host)
    standby = manager.allocate(
        parse_slot_request(
            {
                "name": standby_name("web", "a1b2c3"),
                "qos": "burstable",
                "resources": {"cpus": 0.5, "memory": "64Mi"},
            }
        )
    ).slot
    claim = parse_slot_request(guaranteed("a", cpus=2))
    reserved = manager.reserve_for_claims([(standby.id, claim)])
    assert len(reserved) == 2
    assert host.calls[-1] == reserved  # confined ahead; the ledger holds nothing more
    assert manager.reserve_for_claims([(standby.id, claim)]) == reserved
    calls = len(host.calls)
    # Any allocation placed there (a claim, or here a cold one) finds the host confined already.
    taken = manager.allocate(claim).slot
    assert taken.assignment is not None
    assert F(taken.assignment.cpus) == reserved
    # The same pass confined the next claim's CPUs, predicted again with the new ledger.
    assert len(host.calls) == calls + 1
    following = host.calls[-1] - reserved
    assert len(following) == 2
    # A release whose CPUs the next claim will take keeps them confined in its one pass.
    manager.release(taken.id)
    assert host.calls[-1] == reserved
    assert F() not in host.calls[1:], "the host was never put back on the next claim's CPUs"
    # Nothing to claim for: only what slots hold stays confined (nothing).
    manager.reserve_for_claims([])
    assert host.calls[-1] == F()
    # A claim that cannot fit, or a standby gone, reserves nothing (and fails nothing).
    assert manager.reserve_for_claims([(standby.id, parse_slot_request(guaranteed("c", cpus=64)))]) == F()
    assert manager.reserve_for_claims([("gone", claim)]) == F()
