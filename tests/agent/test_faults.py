"""Every operation is all-or-nothing when the state directory fills up at any step: the call fails
with InsufficientStorage (507), and once space returns, the same call converges (no CPU held
twice, no kernel object without its row, no worker launched twice). The disk is made to fail at
the Nth write to the state store, for every N an operation makes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot import HOLDING, SlotState
from nodeagent.agent.state import StateStore
from nodeagent.errors import InsufficientStorage
from nodeagent.schema.request import ResourcesPatch, parse_slot_request
from tests.agent.test_manager import TOPOLOGY, WORKER, FakeIsolation, FakeRuntime, World, guaranteed


class FillingStore(StateStore):
    """A store whose disk fills up at its ``fail_at``-th write from now (None: never)."""

    fail_at: int | None = None
    writes = 0

    def _write(self, sql: str, params: Any) -> Any:
        self.writes += 1
        if self.fail_at is not None and self.writes >= self.fail_at:
            raise InsufficientStorage(f"the state directory {self.path.parent} is full (injected)")
        return super()._write(sql, params)

    def fill_after(self, writes: int | None) -> None:
        self.writes = 0
        self.fail_at = writes


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def manager(tmp_path: Path, world: World) -> Iterator[SlotManager]:
    store = FillingStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
    manager = SlotManager(store, TOPOLOGY, FakeIsolation(world), FakeRuntime(world))
    manager.start(supervise=False)
    yield manager
    manager.close()


def store_of(manager: SlotManager) -> FillingStore:
    store = manager._store
    assert isinstance(store, FillingStore)
    return store


def consistent(manager: SlotManager, world: World) -> None:
    """The database and the kernel agree, and nothing is held twice."""
    slots = manager.list_slots()
    holding = {s.id for s in slots if s.state in HOLDING}
    assert set(world.cgroups) <= holding, f"kernel objects without a row: {set(world.cgroups) - holding}"
    held = [
        cpu
        for s in slots
        if s.state in HOLDING and s.assignment is not None and s.assignment.exclusive
        for cpu in s.assignment.cpus
    ]
    assert len(held) == len(set(held))
    for slot in slots:
        if slot.state in (SlotState.READY, SlotState.RUNNING):
            assert slot.id in world.cgroups


REQUEST = {**guaranteed(cpus=2), "worker": WORKER}


@pytest.mark.parametrize("fail_at", range(1, 12))
def test_allocate_is_all_or_nothing_and_its_retry_converges(
    manager: SlotManager, world: World, fail_at: int
) -> None:
    store_of(manager).fill_after(fail_at)
    try:
        manager.allocate(parse_slot_request(REQUEST))
    except InsufficientStorage:
        consistent(manager, world)
        assert world.launches == []  # no worker runs for an allocate that failed
    store_of(manager).fill_after(None)
    result = manager.allocate(parse_slot_request(REQUEST))
    consistent(manager, world)
    assert result.slot.state in (SlotState.READY, SlotState.RUNNING)
    assert [s.name for s in manager.list_slots()] == ["web"]
    assert world.launches == [result.slot.id]  # launched once, whichever attempt did it


@pytest.mark.parametrize("fail_at", range(1, 8))
def test_release_is_all_or_nothing_and_its_retry_converges(
    manager: SlotManager, world: World, fail_at: int
) -> None:
    slot = manager.allocate(parse_slot_request(REQUEST)).slot
    store_of(manager).fill_after(fail_at)
    try:
        manager.release(slot.id)
    except InsufficientStorage:
        consistent(manager, world)
    store_of(manager).fill_after(None)
    if manager.list_slots():
        manager.release(slot.id)
    assert manager.list_slots() == []
    assert world.cgroups == {}
    consistent(manager, world)


@pytest.mark.parametrize("fail_at", range(1, 8))
def test_resize_is_all_or_nothing(manager: SlotManager, world: World, fail_at: int) -> None:
    slot = manager.allocate(parse_slot_request(guaranteed(cpus=2))).slot
    store_of(manager).fill_after(fail_at)
    try:
        resized = manager.resize(slot.id, ResourcesPatch.model_validate({"cpus": 4}))
    except InsufficientStorage:
        after = manager.get_slot(slot.id)
        assert after.assignment == slot.assignment  # as it was, in the database ...
        assert world.cgroups[slot.id]["cpus"] == list(slot.assignment.cpus)  # ... and in the kernel
    else:
        assert resized.assignment is not None
        assert len(resized.assignment.cpus) == 4
    consistent(manager, world)


def test_a_full_disk_refuses_before_anything_changes(manager: SlotManager, world: World) -> None:
    store_of(manager).check_space = lambda minimum=0: (_ for _ in ()).throw(  # type: ignore[method-assign]
        InsufficientStorage("the state directory /x has 12 KiB free")
    )
    with pytest.raises(InsufficientStorage, match="12 KiB free"):
        manager.allocate(parse_slot_request(REQUEST))
    assert manager.list_slots() == []
    assert world.cgroups == {}


def test_a_release_killed_before_its_directory_went_is_finished_at_the_next_start(
    tmp_path: Path, world: World
) -> None:
    class OnDisk(FakeRuntime):
        """Worker directories on disk by slot id."""

        def __init__(self, dirs: set[str]) -> None:
            super().__init__(world)
            self.dirs = dirs

        def reap(self, keep: Iterable[str]) -> list[str]:
            gone = sorted(self.dirs - set(keep))
            self.dirs -= set(gone)
            return gone

    def started(dirs: set[str]) -> tuple[SlotManager, OnDisk]:
        runtime = OnDisk(dirs)
        store = StateStore(tmp_path / "state.db", manifests=Manifests(tmp_path / "slots"))
        manager = SlotManager(store, TOPOLOGY, FakeIsolation(world), runtime)
        manager.start(supervise=False)
        return manager, runtime

    manager, _ = started(set())
    held = manager.allocate(parse_slot_request(REQUEST)).slot
    manager.close()
    # The agent again: a SIGKILL during an earlier release left that slot's directory behind.
    manager, runtime = started({held.id, "s0left0behind"})
    try:
        assert manager.report is not None
        assert manager.report.worker_dirs_removed == ["s0left0behind"]
        assert runtime.dirs == {held.id}  # a slot the database holds keeps its directory
    finally:
        manager.close()


def test_below_the_reserve_node_says_degraded_allocate_refuses_and_release_works(
    manager: SlotManager, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_of(manager)
    held = manager.allocate(parse_slot_request(REQUEST)).slot
    assert not [d for d in manager.node().degraded if "reserve" in d]
    monkeypatch.setattr(store, "free_bytes", lambda: store.reserve - 4096)
    said = [d for d in manager.node().degraded if "reserve" in d]
    assert said
    assert "allocate refuses and slots' log output is dropped" in said[0]
    with pytest.raises(InsufficientStorage, match=r"below the \d+ MiB the agent keeps .*\[state\] reserve"):
        manager.allocate(parse_slot_request({**REQUEST, "name": "another"}))
    manager.release(held.id)  # the reserve is there for this
    assert manager.list_slots() == []
    consistent(manager, world)
