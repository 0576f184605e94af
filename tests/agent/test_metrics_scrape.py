"""A scrape hands the slots it listed to a stats provider that wants them (``prepare``), before it
asks for any slot's figures; the daemon's provider then needs no lookup per slot. The per-slot
families the agent writes itself are the text prometheus-client would have written."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from nodeagent.agent.daemon import SlotStats
from nodeagent.agent.metrics import Metrics, SlotFamily, SlotLabels
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.cgroups import detect, open_manager
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


@pytest.mark.root
def test_slot_stats_carry_the_slots_of_a_parent_that_did_not_move() -> None:
    """Scrape after scrape, a slot under a parent that used no CPU and whose memory did not move is
    shown as before without a read; once a task ran under it, its slots are read again."""
    host = detect()
    parent_path = f"natest{os.getpid()}-scrape"
    parent, slot_group = open_manager(host, parent_path), open_manager(host, f"{parent_path}/a")
    parent.create()
    slot_group.create()
    try:
        listed = [cast(Slot, SimpleNamespace(id="a", cgroup=f"{parent_path}/a"))]
        stats = SlotStats(CountingManager({}))  # type: ignore[arg-type]
        # A group just made: its memory in use (v1's memory.usage_in_bytes) can still move with
        # nothing running in it (the charges of its creation settling: 256 KiB -> 12 KiB, seen in
        # 2 of 300 fresh groups), and a parent whose memory moved is read again, rightly. Scrape
        # until two in a row agree: from then on nothing moves while nothing runs.
        first, carried = None, False
        for _ in range(50):
            stats.prepare(listed)
            now = stats("a")
            assert now is not None
            carried = now is first  # carried: nothing under the parent ran
            if carried:
                break
            first = now
            time.sleep(0.02)
        assert carried
        assert first is not None
        worker = subprocess.Popen(
            ["sh", "-c", "read go; i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done"], stdin=subprocess.PIPE
        )
        try:
            slot_group.add_pid(worker.pid)
            assert worker.stdin is not None
            worker.stdin.close()  # go: it runs inside the slot's group
            assert worker.wait(timeout=30) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        stats.prepare(listed)
        ran = stats("a")
        assert ran is not None
        assert ran is not first
        assert (ran.cpu_usage_ns or 0) > (first.cpu_usage_ns or 0)
    finally:
        slot_group.delete()
        parent.delete()


# --------------------------------------------------------------------------- per-slot families as text


def _slot(slot_id: str, name: str) -> Slot:
    return Slot(
        id=slot_id,
        name=name,
        state=SlotState.RUNNING,
        request=parse_slot_request({"name": "a", "qos": "best-effort"}),
        assignment=None,
    )


def _library_text(kind: str, rows: list[tuple[Slot, float, str]], extra: str | None) -> str:
    labels = ("slot", "name", *((extra,) if extra else ()))
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
        "nodeagent_x", 'Help with a \\ backslash, "quotes" and\na newline.', labels=labels
    )
    for slot, value, extra_value in rows:
        family.add_metric((slot.id, slot.name, *((extra_value,) if extra else ())), value)

    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            yield family

    return generate_latest(One()).decode()


LABEL_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
VALUES = st.one_of(
    st.integers(min_value=0, max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["counter", "gauge"]),
    extra=st.sampled_from([None, "phase"]),
    rows=st.lists(st.tuples(LABEL_TEXT, LABEL_TEXT, VALUES, LABEL_TEXT), max_size=5),
)
def test_a_slot_family_is_written_as_prometheus_client_writes_it(
    kind: str, extra: str | None, rows: list[tuple[str, str, float, str]]
) -> None:
    samples = [(_slot(slot_id, name), value, extra_value) for slot_id, name, value, extra_value in rows]
    family = SlotFamily("nodeagent_x", kind, 'Help with a \\ backslash, "quotes" and\na newline.', extra)  # type: ignore[arg-type]
    for slot, value, extra_value in samples:
        family.add(SlotLabels(slot), value, extra_value)
    assert family.text() == _library_text(kind, samples, extra)
