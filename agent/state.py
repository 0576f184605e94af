"""The agent's durable state: one SQLite database (WAL, synchronous=FULL, foreign keys) in the state dir.

Tables::

    slots    id, name UNIQUE, qos, request, assignment, state, reason, cgroup, network, applied,
             created_at, updated_at                         (JSON columns hold the API's JSON forms)
    workers  slot_id -> slots(id) ON DELETE CASCADE, spec, desired, keeper_pid, worker_pid,
             start_time, status, restarts, last_exit, updated_at
    events   id, time, slot_id (no foreign key: events outlive their slot), kind, message

Durability rule the slot manager builds on: a slot row is committed (``pending``, WITH its
assignment) before any kernel object exists, so after a crash the database names everything the
agent may have created. Every mutation runs in its own transaction (``BEGIN IMMEDIATE``); several
writes that must land together share one through :meth:`StateStore.transaction`.

Thread safety: one connection guarded by a re-entrant lock; the manager is the only writer.
Schema changes are numbered migrations recorded in ``PRAGMA user_version``.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.errors import NodeAgentError


class StateError(NodeAgentError):
    """The state database could not be read or written."""

    code = "state_error"


#: Migrations, in order; ``user_version`` is how many have been applied.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE slots (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL UNIQUE,
        qos         TEXT NOT NULL,
        request     TEXT NOT NULL,
        assignment  TEXT,
        state       TEXT NOT NULL,
        reason      TEXT,
        cgroup      TEXT,
        network     TEXT,
        applied     TEXT,
        created_at  REAL NOT NULL,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE workers (
        slot_id     TEXT PRIMARY KEY REFERENCES slots(id) ON DELETE CASCADE,
        spec        TEXT NOT NULL,
        desired     TEXT NOT NULL DEFAULT 'running',
        keeper_pid  INTEGER,
        worker_pid  INTEGER,
        start_time  INTEGER,
        status      TEXT,
        restarts    INTEGER NOT NULL DEFAULT 0,
        last_exit   TEXT,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE events (
        id       INTEGER PRIMARY KEY AUTOINCREMENT,
        time     REAL NOT NULL,
        slot_id  TEXT,
        kind     TEXT NOT NULL,
        message  TEXT NOT NULL
    );
    CREATE INDEX events_by_slot ON events(slot_id, id);
    """,
)

#: Keep the event log bounded: older events are dropped beyond this many.
MAX_EVENTS = 10_000

_JSON_SLOT_COLUMNS = ("request", "assignment", "network", "applied")
_JSON_WORKER_COLUMNS = ("spec", "status", "last_exit")
_SLOT_COLUMNS = (
    "id",
    "name",
    "qos",
    "request",
    "assignment",
    "state",
    "reason",
    "cgroup",
    "network",
    "applied",
    "created_at",
    "updated_at",
)
_WORKER_COLUMNS = (
    "slot_id",
    "spec",
    "desired",
    "keeper_pid",
    "worker_pid",
    "start_time",
    "status",
    "restarts",
    "last_exit",
    "updated_at",
)


def _qmarks(columns: tuple[str, ...]) -> str:
    return ", ".join("?" for _ in columns)


# Column lists are fixed tuples above and update keys are checked against the sets below, so the
# SQL text never carries caller input; values always travel as parameters.
_SLOT_SELECT = f"SELECT {', '.join(_SLOT_COLUMNS)} FROM slots"  # noqa: S608
_SLOT_INSERT = f"INSERT INTO slots ({', '.join(_SLOT_COLUMNS)}) VALUES ({_qmarks(_SLOT_COLUMNS)})"  # noqa: S608
_WORKER_SELECT = f"SELECT {', '.join(_WORKER_COLUMNS)} FROM workers"  # noqa: S608
_WORKER_UPSERT = (
    f"INSERT OR REPLACE INTO workers ({', '.join(_WORKER_COLUMNS)}) VALUES ({_qmarks(_WORKER_COLUMNS)})"  # noqa: S608
)
_EVENT_SELECT = "SELECT id, time, slot_id, kind, message FROM events"
_UPDATABLE_SLOT = frozenset({"request", "assignment", "state", "reason", "cgroup", "network", "applied"})
_UPDATABLE_WORKER = frozenset(_WORKER_COLUMNS[1:9])


@dataclass(frozen=True)
class SlotRecord:
    id: str
    name: str
    qos: str
    request: Mapping[str, Any]
    assignment: Mapping[str, Any] | None
    state: str
    reason: str | None = None
    cgroup: str | None = None
    network: Mapping[str, Any] | None = None
    #: What isolation built (its AppliedSlot as JSON): what release must take down.
    applied: Mapping[str, Any] | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass(frozen=True)
class WorkerRecord:
    slot_id: str
    spec: Mapping[str, Any]
    desired: str = "running"  #: "running" or "stopped": what the operator asked for
    keeper_pid: int | None = None
    worker_pid: int | None = None
    start_time: int | None = None
    status: Mapping[str, Any] | None = None
    restarts: int = 0
    last_exit: Mapping[str, Any] | None = None
    updated_at: float = 0.0


@dataclass(frozen=True)
class EventRecord:
    id: int
    time: float
    slot_id: str | None
    kind: str
    message: str


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class StateStore:
    """The agent's database. Open once per process; close on shutdown."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # 256 KiB of page cache instead of 2 MiB: the database is small and read mostly at
            # start-up, and the daemon's memory is part of every host's bill (bench/api.py).
            self._db.execute("PRAGMA cache_size=-256")
            self._migrate()
        except sqlite3.Error as err:
            raise StateError(
                f"cannot open the state database {path}: {err}; check the state directory"
            ) from err

    # --- plumbing -----------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > len(MIGRATIONS):
            raise StateError(
                f"the state database {self.path} has schema version {version}, newer than this agent "
                f"knows ({len(MIGRATIONS)}); run a newer nodeagent or move the database away"
            )
        for number in range(version, len(MIGRATIONS)):
            # executescript commits first, so wrap the migration and its version bump by hand.
            self._db.executescript(
                f"BEGIN IMMEDIATE;\n{MIGRATIONS[number]}\nPRAGMA user_version = {number + 1};\nCOMMIT;"
            )

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes into one transaction (re-entrant: nested calls join the outer one)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as err:
                raise StateError(f"cannot write the state database {self.path}: {err}") from err
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self._db.execute("ROLLBACK")
                raise
            self._depth = 0
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as err:
                self._db.execute("ROLLBACK")
                raise StateError(f"cannot commit to the state database {self.path}: {err}") from err

    def _write(self, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> sqlite3.Cursor:
        with self.transaction():
            try:
                return self._db.execute(sql, params)
            except sqlite3.IntegrityError as err:
                raise StateError(f"state database refused a write ({err})") from err
            except sqlite3.Error as err:
                raise StateError(f"cannot write the state database {self.path}: {err}") from err

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.Error as err:
                raise StateError(f"cannot read the state database {self.path}: {err}") from err

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- slots --------------------------------------------------------------------------------

    def insert_slot(self, slot: SlotRecord) -> SlotRecord:
        now = self._clock()
        stored = SlotRecord(**{**slot.__dict__, "created_at": now, "updated_at": now})
        row = _slot_row(stored)
        self._write(_SLOT_INSERT, row)
        return stored

    def update_slot(self, slot_id: str, **changes: Any) -> SlotRecord:
        unknown = set(changes) - _UPDATABLE_SLOT
        if unknown:
            raise ValueError(f"not updatable slot columns: {sorted(unknown)}")
        values = {k: _dump(v) if k in _JSON_SLOT_COLUMNS else v for k, v in changes.items()}
        values["updated_at"] = self._clock()
        assignments = ", ".join(f"{k} = :{k}" for k in values)
        with self.transaction():
            cursor = self._write(
                f"UPDATE slots SET {assignments} WHERE id = :_id",  # noqa: S608
                {**values, "_id": slot_id},
            )
            if cursor.rowcount != 1:
                raise StateError(f"slot {slot_id!r} is not in the state database")
            found = self.get_slot(slot_id)
        assert found is not None
        return found

    def delete_slot(self, slot_id: str) -> None:
        self._write("DELETE FROM slots WHERE id = ?", (slot_id,))

    def get_slot(self, slot_id: str) -> SlotRecord | None:
        rows = self._read(_SLOT_SELECT + " WHERE id = ?", (slot_id,))
        return _slot_from_row(rows[0]) if rows else None

    def find_slot(self, name: str) -> SlotRecord | None:
        rows = self._read(_SLOT_SELECT + " WHERE name = ?", (name,))
        return _slot_from_row(rows[0]) if rows else None

    def list_slots(self) -> list[SlotRecord]:
        rows = self._read(_SLOT_SELECT + " ORDER BY created_at, id")
        return [_slot_from_row(r) for r in rows]

    # --- workers ------------------------------------------------------------------------------

    def put_worker(self, worker: WorkerRecord) -> WorkerRecord:
        stored = WorkerRecord(**{**worker.__dict__, "updated_at": self._clock()})
        row = tuple(
            _dump(getattr(stored, c)) if c in _JSON_WORKER_COLUMNS else getattr(stored, c)
            for c in _WORKER_COLUMNS
        )
        self._write(_WORKER_UPSERT, row)
        return stored

    def update_worker(self, slot_id: str, **changes: Any) -> None:
        unknown = set(changes) - _UPDATABLE_WORKER
        if unknown:
            raise ValueError(f"not updatable worker columns: {sorted(unknown)}")
        values = {k: _dump(v) if k in _JSON_WORKER_COLUMNS else v for k, v in changes.items()}
        values["updated_at"] = self._clock()
        assignments = ", ".join(f"{k} = :{k}" for k in values)
        sql = f"UPDATE workers SET {assignments} WHERE slot_id = :_id"  # noqa: S608
        self._write(sql, {**values, "_id": slot_id})

    def delete_worker(self, slot_id: str) -> None:
        self._write("DELETE FROM workers WHERE slot_id = ?", (slot_id,))

    def get_worker(self, slot_id: str) -> WorkerRecord | None:
        rows = self._read(_WORKER_SELECT + " WHERE slot_id = ?", (slot_id,))
        return _worker_from_row(rows[0]) if rows else None

    def list_workers(self) -> list[WorkerRecord]:
        rows = self._read(_WORKER_SELECT + " ORDER BY slot_id")
        return [_worker_from_row(r) for r in rows]

    # --- events -------------------------------------------------------------------------------

    def add_event(self, kind: str, message: str, slot_id: str | None = None) -> None:
        with self.transaction():
            cursor = self._write(
                "INSERT INTO events (time, slot_id, kind, message) VALUES (?, ?, ?, ?)",
                (self._clock(), slot_id, kind, message),
            )
            if cursor.lastrowid is not None and cursor.lastrowid % 1000 == 0:
                self._write("DELETE FROM events WHERE id <= ?", (cursor.lastrowid - MAX_EVENTS,))

    def events(self, *, slot_id: str | None = None, limit: int = 100) -> list[EventRecord]:
        """The newest ``limit`` events, oldest first."""
        where, params = ("WHERE slot_id = ?", (slot_id,)) if slot_id is not None else ("", ())
        rows = self._read(
            f"{_EVENT_SELECT} {where} ORDER BY id DESC LIMIT ?",
            (*params, limit),
        )
        return [EventRecord(*r) for r in reversed(rows)]


def _slot_row(slot: SlotRecord) -> tuple[Any, ...]:
    return tuple(
        _dump(getattr(slot, c)) if c in _JSON_SLOT_COLUMNS else getattr(slot, c) for c in _SLOT_COLUMNS
    )


def _slot_from_row(row: tuple[Any, ...]) -> SlotRecord:
    values = dict(zip(_SLOT_COLUMNS, row, strict=True))
    for column in _JSON_SLOT_COLUMNS:
        values[column] = _load(values[column])
    return SlotRecord(**values)


def _worker_from_row(row: tuple[Any, ...]) -> WorkerRecord:
    values = dict(zip(_WORKER_COLUMNS, row, strict=True))
    for column in _JSON_WORKER_COLUMNS:
        values[column] = _load(values[column])
    return WorkerRecord(**values)


__all__ = ["EventRecord", "SlotRecord", "StateError", "StateStore", "WorkerRecord"]
