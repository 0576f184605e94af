"""A scrape hands the slots it listed to a stats provider that wants them (``prepare``), before it
asks for any slot's figures; the daemon's provider then needs no lookup per slot."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from nodeagent.agent.daemon import SlotStats
from nodeagent.agent.metrics import Metrics
from nodeagent.agent.slot import Slot
from nodeagent.cgroups.resources import CgroupStats, OomEvents
from nodeagent.schema.request import parse_slot_request
from tests.agent.fake_service import FakeSlotService

FIGURES = CgroupStats(
    cpu_usage_ns=1_000_000_000,
    cpu_periods=None,
    cpu_throttled_periods=None,
    cpu_throttled_ns=None,
    memory_current=4096,
    memory_peak=None,
    oom=OomEvents(oom=None, oom_kill=None),
    pids_current=1,
)


class PreparedProvider:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def prepare(self, slots: list[Slot]) -> None:
        self.calls.append(("prepare", sorted(s.name for s in slots)))

    def __call__(self, slot_id: str) -> CgroupStats | None:
        self.calls.append(("stats", slot_id))
        return FIGURES


def test_prepare_gets_the_listed_slots_before_any_figures_are_asked_for() -> None:
    service = FakeSlotService()
    ids = [
        service.allocate(parse_slot_request({"name": name, "qos": "best-effort"})).slot.id
        for name in ("a", "b")
    ]
    provider = PreparedProvider()
    text = Metrics(service, stats_provider=provider).render()[0].decode()
    assert provider.calls == [("prepare", ["a", "b"]), ("stats", ids[0]), ("stats", ids[1])]
    assert f'nodeagent_slot_memory_bytes{{name="a",slot="{ids[0]}"}} 4096.0' in text


class CountingManager:
    def __init__(self, views: dict[str, Slot]) -> None:
        self.views = views
        self.lookups: list[str] = []

    def get_slot(self, slot_id: str) -> Slot:
        self.lookups.append(slot_id)
        return self.views[slot_id]


@pytest.mark.root
def test_slot_stats_takes_each_slots_cgroup_from_the_scrapes_listing_and_looks_up_the_rest() -> None:
    service = FakeSlotService()
    for name in ("listed", "unlisted"):
        service.allocate(parse_slot_request({"name": name, "qos": "best-effort", "resources": {}}))
    listed, unlisted = (dataclasses.replace(view, applied=None) for view in service.list_slots())
    manager = CountingManager({listed.id: listed, unlisted.id: unlisted})
    stats = SlotStats(manager)  # type: ignore[arg-type]
    stats.prepare([listed])
    assert stats(listed.id) is None  # no cgroup: no figures
    assert manager.lookups == []
    assert stats(unlisted.id) is None
    assert manager.lookups == [unlisted.id]
