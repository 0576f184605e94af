"""The SQLite state store: round trips, transactions, migrations, concurrency."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import stat
import threading
from pathlib import Path

import pytest

from nodeagent.agent import ballast as ballast_module
from nodeagent.agent.ballast import Ballast
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot import Slot, SlotState, Worker
from nodeagent.agent.state import MIGRATIONS, StateError, StateStore
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.placement import Assignment
from nodeagent.runtime.ports import PortWant, SlotPort
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.supervisor import Phase, WorkerStatus
from nodeagent.schema.request import parse_slot_request
from nodeagent.schema.worker import parse_worker_spec


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    s = StateStore(tmp_path / "state.db")
    yield s
    s.close()


def slot(slot_id: str = "s1", name: str = "web", state: SlotState = SlotState.PENDING) -> Slot:
    return Slot(
        id=slot_id,
        name=name,
        state=state,
        request=parse_slot_request({"name": name, "qos": "guaranteed", "resources": {"cpus": 2}}),
        assignment=Assignment(
            name=name,
            qos="guaranteed",
            cpus=(2, 3),
            exclusive=True,
            cpu_quota_millis=0,
            numa_nodes=(0,),
            memory_bytes=0,
            memory_by_node={},
        ),
    )


def applied(slot_id: str) -> AppliedSlot:
    return AppliedSlot(
        slot_id=slot_id,
        qos="guaranteed",
        cgroup=f"x/{slot_id}",
        cgroup_version="v1",
        procs_files=(f"/sys/fs/cgroup/cpuset/x/{slot_id}/cgroup.procs",),
        oom_events=None,
        cpus=frozenset({2, 3}),
        mems=None,
        memory_max=None,
        sched_idle=False,
        oom_score_adj=-998,
        device_rules=("c 1:3 rw",),
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
    updated = store.update_slot(dataclasses.replace(stored, state=SlotState.READY, applied=applied("s1")))
    assert store.get_slot("s1") == updated
    assert updated.state is SlotState.READY
    assert updated.cgroup == "x/s1"
    assert updated.assignment == stored.assignment
    assert [r.id for r in store.list_slots()] == ["s1"]


def test_name_is_unique(store: StateStore) -> None:
    store.insert_slot(slot())
    with pytest.raises(StateError, match="refused"):
        store.insert_slot(slot("s2", "web"))


def test_update_of_a_missing_slot_is_refused(store: StateStore) -> None:
    with pytest.raises(StateError, match="not in the state database"):
        store.update_slot(slot("nope"))


def test_workers_cascade_with_their_slot(store: StateStore) -> None:
    store.insert_slot(slot())
    store.put_worker(Worker(slot_id="s1", spec=parse_worker_spec({"command": ["sleep", "1"]})))
    last_exit = ExitRecord(1, None, False, 5.0, "exited")
    status = WorkerStatus(Phase.RUNNING, 42, 1, 0, last_exit, None, "pid 42 ready")
    store.update_worker("s1", status=status)
    store.update_worker("s1", desired="stopped")
    worker = store.get_worker("s1")
    assert worker is not None
    assert (worker.status, worker.desired) == (status, "stopped")
    store.delete_slot("s1")
    assert store.get_worker("s1") is None
    assert store.list_workers() == []


def test_worker_needs_an_existing_slot(store: StateStore) -> None:
    with pytest.raises(StateError):
        store.put_worker(Worker(slot_id="ghost", spec=parse_worker_spec({"command": ["x"]})))


def test_transaction_rolls_back_everything_on_error(store: StateStore) -> None:
    store.insert_slot(slot())

    def failing_change() -> None:
        with store.transaction():
            store.update_slot(slot(state=SlotState.READY))
            store.add_event("x", "inside")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        failing_change()
    record = store.get_slot("s1")
    assert record is not None
    assert record.state == "pending"
    assert store.events() == []


def test_standbys_are_listed_from_what_is_committed_and_staged(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "db")
    store.insert_slot(slot("s1", "pool.web.aaaaaa"))
    store.insert_slot(slot("s2", "web"))
    store.insert_slot(slot("s3", "pool.web.bbbbbb"))
    assert [s.id for s in store.list_slots(pooled=True)] == ["s1", "s3"]
    with store.transaction():
        store.rename_slot("s1", "claimed")  # a claim took it
        store.insert_slot(slot("s4", "pool.web.cccccc"))
        store.delete_slot("s3")
        assert [s.id for s in store.list_slots(pooled=True)] == ["s4"]  # the transaction's own view
    assert [s.id for s in store.list_slots(pooled=True)] == ["s4"]

    def rolled_back() -> None:
        with store.transaction():
            store.insert_slot(slot("s5", "pool.web.dddddd"))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        rolled_back()
    assert [s.id for s in store.list_slots(pooled=True)] == ["s4"]
    store.close()
    reopened = StateStore(tmp_path / "db")
    assert [s.id for s in reopened.list_slots(pooled=True)] == ["s4"]
    assert [s.id for s in reopened.list_slots()] == ["s1", "s2", "s4"]
    reopened.close()


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


def test_each_slot_keeps_its_own_sandbox_uid_until_its_row_goes(store: StateStore) -> None:
    store.insert_slot(slot("s1", "a"))
    store.insert_slot(slot("s2", "b"))
    host_users = {700000}  # the host's passwd names this one: never handed out
    first = store.sandbox_uid("s1", 700000, 700010, host_users.__contains__)
    second = store.sandbox_uid("s2", 700000, 700010, host_users.__contains__)
    assert (first, second) == (700001, 700002)
    assert store.sandbox_uid("s1", 700000, 700010, host_users.__contains__) == first  # kept
    assert store.sandbox_uids() == {"s1": first, "s2": second}
    store.delete_slot("s1")  # released: its uid is free again
    store.insert_slot(slot("s3", "c"))
    assert store.sandbox_uid("s3", 700000, 700010, host_users.__contains__) == first


def test_a_released_uid_rests_for_its_quarantine_before_another_slot_gets_it(tmp_path: Path) -> None:
    now = [1000.0]
    quarantined = StateStore(tmp_path / "q.db", clock=lambda: now[0])
    try:
        for slot_id, name in (("s1", "a"), ("s2", "b"), ("s3", "c")):
            quarantined.insert_slot(slot(slot_id, name))
        first = quarantined.sandbox_uid("s1", 700000, 700010, lambda uid: False, 600)
        assert first == 700000
        quarantined.delete_slot("s1")
        now[0] += 599
        assert quarantined.sandbox_uid("s2", 700000, 700010, lambda uid: False, 600) == 700001  # rests
        now[0] += 2
        assert quarantined.sandbox_uid("s3", 700000, 700010, lambda uid: False, 600) == first  # rested
    finally:
        quarantined.close()


def test_a_released_uid_still_rests_after_the_database_is_lost(tmp_path: Path) -> None:
    # serve --recover after a lost database: the uid "a" held rests as long as it would have,
    # noted beside the manifests (the database that said so is gone).
    now = [1000.0]
    manifests = Manifests(tmp_path / "slots")
    before = StateStore(tmp_path / "q.db", manifests=manifests, clock=lambda: now[0])
    try:
        before.insert_slot(slot("s1", "a"))
        first = before.sandbox_uid("s1", 700000, 700010, lambda uid: False, 600)
        before.delete_slot("s1")
    finally:
        before.close()
    assert manifests.slot_ids() == []  # the note is not taken for a slot's manifest
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"q.db{suffix}").unlink(missing_ok=True)
    now[0] += 300
    after = StateStore(tmp_path / "q.db", manifests=manifests, clock=lambda: now[0])
    try:
        after.insert_slot(slot("s2", "b"))
        after.insert_slot(slot("s3", "c"))
        assert after.sandbox_uid("s2", 700000, 700010, lambda uid: False, 600) != first  # rests
        now[0] += 301
        assert after.sandbox_uid("s3", 700000, 700010, lambda uid: False, 600) == first  # rested
    finally:
        after.close()
    assert stat.S_IMODE((tmp_path / "slots" / Manifests.RELEASED_UIDS).stat().st_mode) == 0o600


def test_an_unreadable_note_of_released_uids_is_no_release(tmp_path: Path) -> None:
    manifests = Manifests(tmp_path / "slots")
    (tmp_path / "slots").mkdir()
    for body in ("not json", "[1, 2]", '{"x": 1, "700000": "soon", "700001": true}'):
        (tmp_path / "slots" / Manifests.RELEASED_UIDS).write_text(body)
        assert manifests.released_uids() == {}
    store = StateStore(tmp_path / "q.db", manifests=manifests)
    try:
        store.insert_slot(slot("s1", "a"))
        assert store.sandbox_uid("s1", 700000, 700010, lambda uid: False, 600) == 700000
    finally:
        store.close()


def test_a_range_held_or_resting_says_so(tmp_path: Path) -> None:
    quarantined = StateStore(tmp_path / "q.db", clock=lambda: 1000.0)
    try:
        quarantined.insert_slot(slot("s1", "a"))
        quarantined.sandbox_uid("s1", 700000, 700000, lambda uid: False, 600)
        quarantined.delete_slot("s1")
        quarantined.insert_slot(slot("s2", "b"))
        with pytest.raises(StateError, match=r"1 rest after their slot's release.*shorten the quarantine"):
            quarantined.sandbox_uid("s2", 700000, 700000, lambda uid: False, 600)
    finally:
        quarantined.close()


def test_a_used_up_uid_range_is_refused_with_what_to_do(store: StateStore) -> None:
    store.insert_slot(slot("s1", "a"))
    store.insert_slot(slot("s2", "b"))
    store.sandbox_uid("s1", 700000, 700000, lambda uid: False)
    with pytest.raises(StateError, match=r"no free uid left in \[sandbox\] uid_range 700000-700000.*widen"):
        store.sandbox_uid("s2", 700000, 700000, lambda uid: False)


def test_the_database_and_its_wal_are_the_agents_alone_whatever_the_umask(tmp_path: Path) -> None:
    # It holds every slot's env: a worker sharing the host's file system must not read it.
    old = os.umask(0)
    try:
        (tmp_path / "old.db-wal").write_text("")  # an older agent's, born 0666 here
        for name in ("state.db", "old.db"):
            s = StateStore(tmp_path / name)
            with s.transaction():
                s.add_event("test", "written")
            s.close()
    finally:
        os.umask(old)
    made = sorted(p.name for p in tmp_path.iterdir())
    assert "state.db-wal" in made or "state.db" in made
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == dict.fromkeys(made, 0o600)


def test_the_ballast_is_given_up_before_a_write_on_a_full_disk_and_made_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = {"bytes": 1 << 30}
    monkeypatch.setattr(ballast_module, "_free", lambda directory: free["bytes"])
    ballast = Ballast(tmp_path)
    s = StateStore(tmp_path / "state.db", reserve=16 << 20, ballast=ballast)
    try:
        assert ballast.held()
        assert stat.S_IMODE(ballast.path.stat().st_mode) == 0o600
        assert ballast.path.stat().st_blocks * 512 >= ballast.size  # allocated, not sparse
        free["bytes"] = 4096  # something else filled the file system
        with s.transaction():
            s.add_event("test", "written with the ballast's room")
        assert not ballast.held()
        free["bytes"] = 20 << 20  # space again, but less than the reserve and the ballast
        s.check_space()
        assert not ballast.held()
        free["bytes"] = 1 << 30
        s.check_space()
        assert ballast.held()
    finally:
        s.close()


def test_the_slots_it_answers_from_memory_are_what_the_database_holds(tmp_path: Path) -> None:
    """Slots are read from the database once and then kept write-through: after inserts, updates,
    deletes, a rolled-back transaction and reads inside one, a store opened afresh on the same file
    reads back exactly what the first one answers."""
    path = tmp_path / "state.db"
    store = StateStore(path)
    try:
        store.insert_slot(slot("s1", "a"))
        store.insert_slot(slot("s2", "b"))
        store.insert_slot(slot("s3", "c"))
        store.update_slot(
            dataclasses.replace(store.get_slot("s1"), state=SlotState.READY, applied=applied("s1"))
        )
        store.delete_slot("s2")

        def rolled_back() -> None:
            with store.transaction():
                store.update_slot(dataclasses.replace(slot("s3", "c"), state=SlotState.FAILED, reason="x"))
                store.delete_slot("s1")
                # Inside the transaction its own writes are what it reads.
                assert store.get_slot("s1") is None
                assert store.find_slot("c").state == SlotState.FAILED
                assert [s.id for s in store.list_slots()] == ["s3"]
                raise RuntimeError("rolled back")

        with pytest.raises(RuntimeError):
            rolled_back()
        with store.transaction():
            store.insert_slot(slot("s4", "d"))
        answered = store.list_slots()
        assert [(s.id, s.state) for s in answered] == [
            ("s1", SlotState.READY),
            ("s3", SlotState.PENDING),
            ("s4", SlotState.PENDING),
        ]
        again = StateStore(path)
        try:
            assert again.list_slots() == answered
            assert again.find_slot("a") == store.find_slot("a")
        finally:
            again.close()
    finally:
        store.close()


def test_per_slot_uid_and_port_reads_follow_writes_cascades_and_rollbacks(store: StateStore) -> None:
    # get_sandbox_uid and slot_ports answer from a whole-table read kept between writes: every
    # write, a slot's cascade and a rolled-back transaction must show in the next read.
    store.insert_slot(slot("s1", "a"))
    store.insert_slot(slot("s2", "b"))
    assert store.get_sandbox_uid("s1") is None
    assert store.slot_ports("s1") == []
    uid = store.sandbox_uid("s1", 700000, 700010, lambda _: False)
    assert store.get_sandbox_uid("s1") == uid
    assert store.get_sandbox_uid("s2") is None
    ports = store.assign_ports("s2", {"http": PortWant("http", "tcp")}, 20000, 20009, lambda _: False)
    assert store.slot_ports("s2") == ports
    assert store.slot_ports("s1") == []
    seen: list[list[SlotPort]] = []

    def delete_then_fail() -> None:
        with store.transaction():
            store.delete_slot("s2")
            seen.append(store.slot_ports("s2"))  # the transaction sees its own write
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        delete_then_fail()
    assert seen == [[]]
    assert store.slot_ports("s2") == ports
    store.delete_slot("s1")  # ON DELETE CASCADE takes its uid
    assert store.get_sandbox_uid("s1") is None
