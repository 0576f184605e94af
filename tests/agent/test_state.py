"""The SQLite state store: round trips, transactions, migrations, concurrency."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from nodeagent.agent.state import MIGRATIONS, SlotRecord, StateError, StateStore, WorkerRecord


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    s = StateStore(tmp_path / "state.db")
    yield s
    s.close()


def slot(slot_id: str = "s1", name: str = "web", state: str = "pending") -> SlotRecord:
    return SlotRecord(
        id=slot_id,
        name=name,
        qos="guaranteed",
        request={"name": name, "qos": "guaranteed", "resources": {"cpus": 2}},
        assignment={"cpus": [2, 3], "exclusive": True},
        state=state,
    )


def test_pragmas_and_schema_version(store: StateStore, tmp_path: Path) -> None:
    assert store.schema_version == len(MIGRATIONS)
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_slot_round_trip_and_update(store: StateStore) -> None:
    stored = store.insert_slot(slot())
    assert store.get_slot("s1") == stored
    assert store.find_slot("web") == stored
    updated = store.update_slot("s1", state="ready", applied={"cgroup": "x/s1"}, cgroup="x/s1")
    assert updated.state == "ready"
    assert updated.applied == {"cgroup": "x/s1"}
    assert updated.assignment == {"cpus": [2, 3], "exclusive": True}
    assert [r.id for r in store.list_slots()] == ["s1"]


def test_name_is_unique(store: StateStore) -> None:
    store.insert_slot(slot())
    with pytest.raises(StateError, match="refused"):
        store.insert_slot(slot("s2", "web"))


def test_unknown_update_column_and_missing_slot(store: StateStore) -> None:
    with pytest.raises(ValueError, match="name"):
        store.update_slot("s1", name="other")
    with pytest.raises(StateError, match="not in the state database"):
        store.update_slot("nope", state="ready")


def test_workers_cascade_with_their_slot(store: StateStore) -> None:
    store.insert_slot(slot())
    store.put_worker(WorkerRecord(slot_id="s1", spec={"command": ["sleep", "1"]}))
    store.update_worker("s1", worker_pid=42, status={"phase": "running"}, restarts=1)
    worker = store.get_worker("s1")
    assert worker is not None
    assert (worker.worker_pid, worker.restarts, worker.status) == (42, 1, {"phase": "running"})
    store.delete_slot("s1")
    assert store.get_worker("s1") is None
    assert store.list_workers() == []


def test_worker_needs_an_existing_slot(store: StateStore) -> None:
    with pytest.raises(StateError):
        store.put_worker(WorkerRecord(slot_id="ghost", spec={}))


def test_transaction_rolls_back_everything_on_error(store: StateStore) -> None:
    store.insert_slot(slot())

    def failing_change() -> None:
        with store.transaction():
            store.update_slot("s1", state="ready")
            store.add_event("x", "inside")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        failing_change()
    record = store.get_slot("s1")
    assert record is not None
    assert record.state == "pending"
    assert store.events() == []


def test_events_are_ordered_and_filtered(store: StateStore) -> None:
    for n in range(5):
        store.add_event("k", f"m{n}", "s1" if n % 2 else None)
    assert [e.message for e in store.events()] == ["m0", "m1", "m2", "m3", "m4"]
    assert [e.message for e in store.events(limit=2)] == ["m3", "m4"]
    assert [e.message for e in store.events(slot_id="s1")] == ["m1", "m3"]


def test_data_survives_reopening(tmp_path: Path) -> None:
    first = StateStore(tmp_path / "db")
    first.insert_slot(slot())
    first.close()
    second = StateStore(tmp_path / "db")
    assert second.find_slot("web") is not None
    second.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "db")
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(StateError, match="newer than this agent"):
        StateStore(tmp_path / "db")


def test_concurrent_writers_do_not_lose_updates(store: StateStore) -> None:
    def writer(prefix: str) -> None:
        for n in range(50):
            store.insert_slot(slot(f"{prefix}{n}", f"{prefix}-{n}"))
            store.add_event("allocate", "x", f"{prefix}{n}")

    threads = [threading.Thread(target=writer, args=(p,)) for p in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.list_slots()) == 200
    assert len(store.events(limit=1000)) == 200
