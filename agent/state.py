"""The agent's durable state: one SQLite database (WAL, synchronous=FULL, foreign keys) in the state dir.

Tables::

    slots    id, name UNIQUE, qos, request, assignment, state, reason, cgroup, network, applied,
             created_at, updated_at                         (JSON columns hold the API's JSON forms)
    workers  slot_id -> slots(id) ON DELETE CASCADE, spec, desired, keeper_pid, worker_pid,
             start_time, status, restarts, last_exit, updated_at
    events   id, time, slot_id (no foreign key: events outlive their slot), kind, message
    sandbox_ids  slot_id -> slots(id) ON DELETE CASCADE, uid UNIQUE  (each slot's own worker uid)
    slot_ports   slot_id -> slots(id) ON DELETE CASCADE, name, protocol, port UNIQUE  (its named ports)

Durability rule the slot manager builds on: a slot row is committed (``pending``, WITH its
assignment) before any kernel object exists, so after a crash the database names everything the
agent may have created. Every mutation runs in its own transaction (``BEGIN IMMEDIATE``); several
writes that must land together share one through :meth:`StateStore.transaction`.

Thread safety: one connection guarded by a re-entrant lock; the manager is the only writer.
Schema changes are numbered migrations recorded in ``PRAGMA user_version``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.agent.ballast import Ballast
from nodeagent.agent.recovery import Manifests
from nodeagent.agent.slot import Desired, Slot, SlotState, Worker
from nodeagent.errors import Conflict, InsufficientStorage, NodeAgentError
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.placement import Assignment
from nodeagent.runtime.ports import PortWant, SlotPort
from nodeagent.runtime.supervisor import WorkerStatus
from nodeagent.schema.request import parse_slot_request, request_to_dict
from nodeagent.schema.worker import PortProtocol, WorkerSpec, parse_worker_spec

log = logging.getLogger("nodeagent.state")


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
    # Each slot's own uid for its sandboxed workers (agent/sandbox.py): kept while the slot exists,
    # so a re-adopted or restarted worker keeps its files; freed with the slot's row.
    """
    CREATE TABLE sandbox_ids (
        slot_id  TEXT PRIMARY KEY REFERENCES slots(id) ON DELETE CASCADE,
        uid      INTEGER NOT NULL UNIQUE
    );
    """,
    # Each slot's named ports (runtime/ports.py): kept while the slot exists, so a restarted or
    # re-adopted worker serves where its clients were told; freed with the slot's row. A host port
    # belongs to one slot at a time.
    """
    CREATE TABLE slot_ports (
        slot_id   TEXT NOT NULL REFERENCES slots(id) ON DELETE CASCADE,
        name      TEXT NOT NULL,
        protocol  TEXT NOT NULL,
        port      INTEGER NOT NULL UNIQUE,
        PRIMARY KEY (slot_id, name)
    );
    """,
    # When each uid a released slot held was freed ([sandbox] uid_quarantine_seconds): what a
    # slot's uid left where the next owner of that uid could reach it (a world-writable directory
    # the sandbox does not cover) is not handed to another slot at once.
    """
    CREATE TABLE released_uids (
        uid          INTEGER PRIMARY KEY,
        released_at  REAL NOT NULL
    );
    """,
    # Warm standby pools (agent/pools.py): each pool's spec (a standby slot's name says its pool).
    """
    CREATE TABLE pools (
        name        TEXT PRIMARY KEY,
        spec        TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    """,
)

#: Bytes the WAL is truncated to after a checkpoint.
WAL_SIZE_LIMIT = 4 * 1024 * 1024
#: Below this much free space in the state directory, operations that grow the state are refused
#: before they change anything (507): an allocate then never stops half-way for want of a page.
#: The floor of [state] reserve, and the reserve of a store built without one.
MIN_FREE_BYTES = 16 * 1024 * 1024

#: Keep the event log bounded: older events are dropped beyond this many.
MAX_EVENTS = 10_000

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
#: What update_slot rewrites (id, name, qos and created_at never change).
_JSON_SLOT_COLUMNS = frozenset({"request", "assignment", "network", "applied"})
_UPDATED_SLOT_COLUMNS = (
    "request",
    "assignment",
    "state",
    "reason",
    "cgroup",
    "network",
    "applied",
    "updated_at",
)


@dataclass(frozen=True)
class EventRecord:
    id: int
    time: float
    slot_id: str | None
    kind: str
    message: str


def _protocol(value: Any) -> PortProtocol:
    text = str(value)
    if text == "grpc":
        return "grpc"
    return "tcp" if text == "tcp" else "http"


def _dump(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _load(text: str | None) -> Any:
    return None if text is None else json.loads(text)


#: The agent's log names every slot event (allocated, released, resized, a worker's phase and why)
#: in one structured line: the event log's kind, the slot and the message, for journald and log
#: shippers that never read the database.
events_log = logging.getLogger("nodeagent.events")


def _log_event(kind: str, message: str, slot_id: str | None) -> None:
    events_log.info(message, extra={"event": kind, "slot": slot_id})


def _private_file(path: Path) -> None:
    """Make the database file 0600 before SQLite opens it, whatever the umask: it holds every
    slot's env (secrets among them), and SQLite gives its WAL and shared-memory files the mode of
    the database file (those of an older agent are narrowed too)."""
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if name == path:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        with contextlib.suppress(FileNotFoundError):
            os.chmod(name, 0o600)


class StateStore:
    """The agent's database. Open once per process; close on shutdown."""

    def __init__(
        self,
        path: Path,
        *,
        manifests: Manifests | None = None,
        clock: Callable[[], float] = time.time,
        reserve: int = MIN_FREE_BYTES,
        ballast: Ballast | None = None,
    ) -> None:
        """``manifests``: where to keep each slot's manifest (agent.recovery), None for none.
        ``reserve``: free bytes on the state file system kept for the agent's own records
        ([state] reserve): what allocate leaves alone, and below which the store is ``short``.
        ``ballast``: room held for the agent's own writes when something else fills the file
        system (agent.ballast), given up before a write that would find none; None for none."""
        self.path = path
        self.reserve = reserve
        self._ballast = ballast
        self.manifests = manifests
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0
        self._durable = True
        #: Events of the transaction under way, logged when it commits (:func:`_log_event`).
        self._told: list[tuple[str, str, str | None]] = []
        #: Every slot as committed, by id: read from the database once, when it opens (outside
        #: any transaction, so it never holds a write that may roll back), then kept
        #: write-through. Reading 500 rows back and parsing their JSON and requests again cost
        #: GET /v1/slots and /metrics most of their time. Writes of the transaction under way
        #: wait in ``_staged`` (None: deleted) and reach it at COMMIT, never on a ROLLBACK.
        self._slots: dict[str, Slot] = {}
        self._staged: dict[str, Slot | None] = {}
        #: The ids of committed slots that are warm pools' standbys, kept with ``_slots``: the
        #: pools' loop asks for them every second and at every change, and copying 500 slots to
        #: keep none was a fifth of an idle agent's CPU at 500 slots (issue 23).
        self._pooled: set[str] = set()
        #: Every slot's sandbox uid and named ports, each table read whole on first use: listing
        #: 500 slots asked SQLite twice per slot, most of GET /v1/slots' time (issue 23). Kept
        #: write-through by the methods that write those tables (the slot's deletion, whose ON
        #: DELETE CASCADE removes its rows, included), so an operation never reads them back;
        #: dropped by a ROLLBACK (the transaction's own writes reached them already).
        self._uids_cache: dict[str, int] | None = None
        self._ports_cache: dict[str, tuple[SlotPort, ...]] | None = None
        #: Each slot's worker spec as last written or read, with its stored JSON: a row read back
        #: with the same JSON reuses the parsed spec (specs are frozen) instead of validating it
        #: again. The row itself is still read, so the database stays the word.
        self._worker_specs: dict[str, tuple[str, WorkerSpec]] = {}
        try:
            if ballast is not None:
                ballast.spare_room()  # opening recreates the WAL and shared-memory files
            _private_file(path)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # 256 KiB of page cache instead of 2 MiB: the database is small and read mostly at
            # start-up, and the daemon's memory is part of every host's bill (bench/api.py).
            self._db.execute("PRAGMA cache_size=-256")
            # After a checkpoint the WAL is cut back to this size instead of keeping its peak: a WAL
            # grown while the disk filled up would otherwise keep the space when it frees up.
            self._db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self._migrate()
            self._recall_released_uids()
            self._slots = _read_slots(self._db.execute(_SLOT_SELECT).fetchall(), path)
            self._pooled = {slot_id for slot_id, slot in self._slots.items() if slot.pool is not None}
        except (sqlite3.Error, OSError) as err:
            raise StateError(
                f"cannot open the state database {path}: {err}; check the state directory"
            ) from err
        if ballast is not None:
            ballast.restore(reserve)

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
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        """Group writes into one transaction (re-entrant: nested calls join the outer one, whose
        ``durable`` decides for all).

        ``durable=False`` commits without waiting for the disk: the commit is in the WAL, so it
        survives any crash of the agent, but not one of the machine. That is enough for a record
        whose only job is to survive the agent (a pending slot's row: the kernel objects it guards
        do not survive the machine either) or that is derived again after a restart (a worker's
        status); what a client was told succeeded is committed durably.
        """
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            if self._ballast is not None:
                self._ballast.spare_room()
            try:
                if durable is not self._durable:
                    # Only settable between transactions; FULL makes COMMIT wait for the disk.
                    self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
                    self._durable = durable
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as err:
                raise self._write_error(err) from err
            self._depth = 1
            self._told = []
            self._staged = {}
            try:
                yield
            except BaseException:
                self._depth = 0
                self._staged = {}
                self._drop_read_caches()
                if self._db.in_transaction:  # SQLITE_FULL may already have rolled it back
                    self._db.execute("ROLLBACK")
                raise
            self._depth = 0
            staged, self._staged = self._staged, {}
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as err:
                if self._db.in_transaction:  # a failed COMMIT may already have rolled back
                    self._db.execute("ROLLBACK")
                self._drop_read_caches()
                raise self._write_error(err) from err
            for slot_id, slot in staged.items():
                if slot is None:
                    self._slots.pop(slot_id, None)
                else:
                    self._slots[slot_id] = slot
                if slot is None or slot.pool is None:  # a claim renames its standby: no longer one
                    self._pooled.discard(slot_id)
                else:
                    self._pooled.add(slot_id)
            for event in self._told:  # what happened is logged once it is the record
                _log_event(*event)

    def _drop_read_caches(self) -> None:
        self._uids_cache = None
        self._ports_cache = None

    def _write(self, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> sqlite3.Cursor:
        with self.transaction():
            try:
                return self._db.execute(sql, params)
            except sqlite3.IntegrityError as err:
                raise StateError(f"state database refused a write ({err})") from err
            except sqlite3.Error as err:
                raise self._write_error(err) from err

    def _write_error(self, err: sqlite3.Error) -> NodeAgentError:
        if getattr(err, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return InsufficientStorage(
                f"the state directory {self.path.parent} is full ({err}); nothing was changed. Free space "
                "there, then retry"
            )
        return StateError(f"cannot write the state database {self.path}: {err}")

    def free_bytes(self) -> int | None:
        """Free bytes on the state file system for the agent (None: cannot tell)."""
        try:
            stat = os.statvfs(self.path.parent)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def check_space(self, minimum: int | None = None) -> None:
        """Refuse (InsufficientStorage) when the state directory has less than ``minimum`` bytes
        free (default: the reserve)."""
        minimum = self.reserve if minimum is None else minimum
        free = self.free_bytes()
        if free is not None and free < minimum:  # None: let the writes themselves say
            raise InsufficientStorage(
                f"the state directory {self.path.parent} has {free // 1024} KiB free, below the "
                f"{minimum // (1024 * 1024)} MiB the agent keeps for its records ([state] reserve); "
                "nothing was changed. Free space there, then retry"
            )
        if self._ballast is not None:
            self._ballast.restore(self.reserve)  # given up when the disk filled, back once it has room

    def short(self) -> str | None:
        """Why the state file system is below the reserve, for /v1/node's ``degraded``; None when
        it is not (or cannot be told)."""
        free = self.free_bytes()
        if free is None or free >= self.reserve:
            return None
        return (
            f"state directory {self.path.parent}: {free >> 20} MiB free, below the agent's reserve of "
            f"{self.reserve // (1024 * 1024)} MiB ([state] reserve): allocate refuses and slots' log "
            "output is dropped until space is freed there"
        )

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

    def insert_slot(self, slot: Slot) -> Slot:
        now = self._clock()
        stored = _as_stored(dataclasses.replace(slot, created_at=now, updated_at=now))
        with self.transaction():
            self._write(_SLOT_INSERT, _slot_row(stored))
            self._staged[stored.id] = stored
        self._keep_manifest(stored)
        return stored

    def update_slot(self, slot: Slot) -> Slot:
        """Write ``slot``'s request, assignment, state, reason and applied state; returns it as stored."""
        changed = _as_stored(dataclasses.replace(slot, updated_at=self._clock()))
        row = dict(zip(_SLOT_COLUMNS, _slot_row(changed), strict=True))
        values = {k: row[k] for k in _UPDATED_SLOT_COLUMNS}
        assignments = ", ".join(f"{k} = :{k}" for k in values)
        with self.transaction():
            cursor = self._write(
                f"UPDATE slots SET {assignments} WHERE id = :_id",  # noqa: S608
                {**values, "_id": slot.id},
            )
            if cursor.rowcount != 1:
                raise StateError(f"slot {slot.id!r} is not in the state database")
            # As a read back would give it: created_at is never updated.
            before = self._staged.get(slot.id) or self._slots.get(slot.id)
            if before is not None:
                changed = dataclasses.replace(changed, name=before.name, created_at=before.created_at)
            self._staged[slot.id] = changed
        self._keep_manifest(changed)
        return changed

    def rename_slot(self, slot_id: str, name: str) -> Slot:
        """Give a slot another name (a standby taken by a claim gets the claim's); Conflict when a
        slot has that name already."""
        if self.find_slot(name) is not None:
            raise Conflict(f"slot name {name!r} is taken; release that slot first or choose another name")
        with self.transaction():
            self._write("UPDATE slots SET name = ? WHERE id = ?", (name, slot_id))
            before = self.get_slot(slot_id)
            if before is None:
                raise StateError(f"slot {slot_id!r} is not in the state database")
            renamed = dataclasses.replace(before, name=name)
            self._staged[slot_id] = renamed
        self._keep_manifest(renamed)
        return renamed

    # --- pools --------------------------------------------------------------------------------

    def put_pool(self, name: str, spec: dict[str, Any]) -> None:
        """Add or replace a pool's spec (its JSON form, schema/pool.py)."""
        with self.transaction():
            self._write(
                "INSERT INTO pools (name, spec, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET spec = excluded.spec",
                (name, _dump(spec), self._clock()),
            )

    def delete_pool(self, name: str) -> None:
        with self.transaction():
            self._write("DELETE FROM pools WHERE name = ?", (name,))

    def list_pools(self) -> list[tuple[str, dict[str, Any], float]]:
        """Every pool: its name, its spec as stored and when it was created, oldest first."""
        rows = self._read("SELECT name, spec, created_at FROM pools ORDER BY created_at, name")
        return [(name, _load(spec), created) for name, spec, created in rows]

    def _keep_manifest(self, slot: Slot, worker: Worker | None = None) -> None:
        """Rewrite the slot's manifest: its record and its worker's spec (agent.recovery)."""
        if self.manifests is None:
            return
        record = slot_record(slot)
        worker = worker or self.get_worker(slot.id)
        record["worker"] = None if worker is None else worker_record(worker)
        # The uid its workers run as: a worker re-adopted after the database was lost keeps it.
        record["sandbox_uid"] = self.get_sandbox_uid(slot.id)
        # A worker re-adopted after the database was lost still listens where it was told.
        record["ports"] = [dataclasses.asdict(p) for p in self.slot_ports(slot.id)]
        self.manifests.write(record)

    def delete_slot(self, slot_id: str) -> None:
        now = self._clock()
        with self.transaction():
            uid = self.get_sandbox_uid(slot_id)
            self._write(
                "INSERT OR REPLACE INTO released_uids (uid, released_at) "
                "SELECT uid, ? FROM sandbox_ids WHERE slot_id = ?",
                (now, slot_id),
            )
            self._write("DELETE FROM slots WHERE id = ?", (slot_id,))
            self._staged[slot_id] = None
            self._worker_specs.pop(slot_id, None)
            # Its uid and ports went with the row (ON DELETE CASCADE).
            if self._uids_cache is not None:
                self._uids_cache.pop(slot_id, None)
            if self._ports_cache is not None:
                self._ports_cache.pop(slot_id, None)
        if self.manifests is not None:
            if uid is not None:
                self.manifests.note_released(uid, now)
            self.manifests.remove(slot_id)

    def _visible(self) -> dict[str, Slot]:
        """What a read sees: the committed slots, with the transaction under way's own writes
        (only its thread reads while it runs: it holds the lock)."""
        with self._lock:
            slots = dict(self._slots)
            for slot_id, slot in self._staged.items():
                if slot is None:
                    slots.pop(slot_id, None)
                else:
                    slots[slot_id] = slot
            return slots

    def get_slot(self, slot_id: str) -> Slot | None:
        with self._lock:
            if slot_id in self._staged:
                return self._staged[slot_id]
            return self._slots.get(slot_id)

    def find_slot(self, name: str) -> Slot | None:
        with self._lock:
            staged = (slot for slot in self._staged.values() if slot is not None)
            committed = (slot for key, slot in self._slots.items() if key not in self._staged)
            return next((slot for slot in (*staged, *committed) if slot.name == name), None)

    def list_slots(self, *, pooled: bool = False) -> list[Slot]:
        """Every slot, oldest first; ``pooled``: only warm pools' standbys (the pools' loop asks every
        second, and sorting 500 slots to keep none was most of its idle cost)."""
        slots: Iterable[Slot]
        if pooled:
            with self._lock:  # the committed standbys and the transaction under way's own writes
                candidates = (self.get_slot(slot_id) for slot_id in self._pooled.union(self._staged))
                slots = [slot for slot in candidates if slot is not None and slot.pool is not None]
        else:
            slots = self._visible().values()
        return sorted(slots, key=lambda slot: (slot.created_at, slot.id))

    # --- workers ------------------------------------------------------------------------------

    def put_worker(self, worker: Worker) -> Worker:
        stored = dataclasses.replace(worker, updated_at=self._clock())
        row = _worker_row(stored)
        self._write(_WORKER_UPSERT, row)
        self._worker_specs[worker.slot_id] = (row[_WORKER_COLUMNS.index("spec")], worker.spec)
        slot = self.get_slot(worker.slot_id)
        if slot is not None:
            self._keep_manifest(slot, stored)
        return stored

    def update_worker(
        self, slot_id: str, *, desired: Desired | None = None, status: WorkerStatus | None = None
    ) -> None:
        """Record what the operator wants of the slot's worker, or its new status."""
        values: dict[str, Any] = {"updated_at": self._clock()}
        if desired is not None:
            values["desired"] = desired
        if status is not None:
            values.update(_status_columns(status))
        assignments = ", ".join(f"{k} = :{k}" for k in values)
        sql = f"UPDATE workers SET {assignments} WHERE slot_id = :_id"  # noqa: S608
        self._write(sql, {**values, "_id": slot_id})
        slot = self.get_slot(slot_id) if desired is not None else None
        if slot is not None:
            self._keep_manifest(slot)

    def delete_worker(self, slot_id: str) -> None:
        self._write("DELETE FROM workers WHERE slot_id = ?", (slot_id,))
        self._worker_specs.pop(slot_id, None)

    def get_worker(self, slot_id: str) -> Worker | None:
        rows = self._read(_WORKER_SELECT + " WHERE slot_id = ?", (slot_id,))
        return _worker_from_row(rows[0], self._spec_of) if rows else None

    def list_workers(self) -> list[Worker]:
        rows = self._read(_WORKER_SELECT + " ORDER BY slot_id")
        return [_worker_from_row(r, self._spec_of) for r in rows]

    def _spec_of(self, slot_id: str, text: str) -> WorkerSpec:
        """The worker spec stored as ``text`` for the slot, parsed once per change."""
        with self._lock:
            known = self._worker_specs.get(slot_id)
            if known is not None and known[0] == text:
                return known[1]
            spec = parse_worker_spec(_load(text))
            self._worker_specs[slot_id] = (text, spec)
            return spec

    # --- sandbox uids ---------------------------------------------------------------------------

    def sandbox_uid(
        self,
        slot_id: str,
        first: int,
        last: int,
        taken: Callable[[int], bool],
        quarantine_seconds: float = 0.0,
    ) -> int:
        """The slot's own uid: the one it has, else the lowest of ``first``..``last`` that no other
        slot holds, no slot released within ``quarantine_seconds`` held, and ``taken`` (the host's
        own users) does not refuse, recorded now. A slot keeps it until its row is deleted.
        StateError when the range is used up."""
        with self.transaction():
            uids = self._uids()
            if slot_id in uids:
                return uids[slot_id]
            held = {uid for uid in uids.values() if first <= uid <= last}
            resting = {
                int(r[0])
                for r in self._read(
                    "SELECT uid FROM released_uids WHERE released_at > ? AND uid BETWEEN ? AND ?",
                    (self._clock() - quarantine_seconds, first, last),
                )
            }
            uid = next(
                (u for u in range(first, last + 1) if u not in held and u not in resting and not taken(u)),
                None,
            )
            if uid is None:
                raise StateError(
                    f"no free uid left in [sandbox] uid_range {first}-{last} ({len(held)} slots hold one, "
                    f"{len(resting)} rest after their slot's release for [sandbox] uid_quarantine_seconds); "
                    "widen the range or shorten the quarantine"
                )
            self._write("INSERT INTO sandbox_ids (slot_id, uid) VALUES (?, ?)", (slot_id, uid))
            uids[slot_id] = uid
            self._keep_uid_in_manifest(slot_id)
            return uid

    def _recall_released_uids(self) -> None:
        """Take back the releases noted beside the manifests that the database does not know (it
        was lost, or is older): their uids rest as long as they would have."""
        if self.manifests is None:
            return
        known = dict(self._read("SELECT uid, released_at FROM released_uids"))
        newer = [(u, t) for u, t in self.manifests.released_uids().items() if t > known.get(u, float("-inf"))]
        if not newer:
            return
        try:
            with self.transaction():
                for uid, at in newer:
                    self._write(
                        "INSERT OR REPLACE INTO released_uids (uid, released_at) VALUES (?, ?)", (uid, at)
                    )
        except NodeAgentError as err:
            # A start on a full disk must still work; the next start that can write takes them back.
            log.warning("released uids not taken back", extra={"reason": str(err)})

    def restore_sandbox_uid(self, slot_id: str, uid: int) -> None:
        """Give a rebuilt slot back the uid its worker runs as (start-up after a lost database);
        Conflict when another slot holds it."""
        with self.transaction():
            rows = self._read("SELECT slot_id FROM sandbox_ids WHERE uid = ?", (uid,))
            if rows and str(rows[0][0]) != slot_id:
                raise Conflict(f"uid {uid} is held by slot {rows[0][0]}")
            self._write("INSERT OR REPLACE INTO sandbox_ids (slot_id, uid) VALUES (?, ?)", (slot_id, uid))
            self._write("DELETE FROM released_uids WHERE uid = ?", (uid,))
            self._uids()[slot_id] = uid
            self._keep_uid_in_manifest(slot_id)

    def _keep_uid_in_manifest(self, slot_id: str) -> None:
        slot = self.get_slot(slot_id)
        if slot is not None:
            self._keep_manifest(slot)

    def get_sandbox_uid(self, slot_id: str) -> int | None:
        return self._uids().get(slot_id)

    def _uids(self) -> dict[str, int]:
        """Every slot's uid, kept write-through (read from the table once, on first use)."""
        with self._lock:
            if self._uids_cache is None:
                self._uids_cache = self.sandbox_uids()
            return self._uids_cache

    def sandbox_uids(self) -> dict[str, int]:
        """Every slot's uid (slot id -> uid)."""
        return {str(r[0]): int(r[1]) for r in self._read("SELECT slot_id, uid FROM sandbox_ids")}

    # --- ports ----------------------------------------------------------------------------------

    def assign_ports(
        self,
        slot_id: str,
        wanted: Mapping[str, PortWant],
        first: int,
        last: int,
        in_use: Callable[[int], bool],
    ) -> list[SlotPort]:
        """The slot's named ports, made to match ``wanted``: a port it holds already stays (unless
        the worker now asks for another number); one asked for by number is taken when no other slot
        holds it and ``in_use`` (a listener on the host) does not refuse it; the others get the lowest
        free port of ``first``..``last``. Names no longer wanted are freed. Conflict, naming the port
        and its holder, when a port asked for is taken or the range is used up; nothing changes then.
        """
        with self.transaction():
            held = {p.name: p for p in self.slot_ports(slot_id)}
            slots = self._visible()
            others = {
                port.port: (slots[holder].name if holder in slots else holder, port.name)
                for holder, ports in self._ports().items()
                if holder != slot_id
                for port in ports
            }
            keep = {
                name: dataclasses.replace(mine, protocol=wanted[name].protocol)
                for name, mine in held.items()
                if name in wanted and wanted[name].port in (None, mine.port)
            }
            taken = set(others) | {p.port for p in keep.values()}
            result = dict(keep)
            for name, want in sorted(wanted.items()):
                if name in result or want.port is None:
                    continue
                if want.port in others:
                    slot_name, port_name = others[want.port]
                    raise Conflict(
                        f"port {name!r}: host port {want.port} is held by slot {slot_name!r} (its port "
                        f"{port_name!r}); ask for another, or leave the number out to get a free one"
                    )
                if want.port in taken or in_use(want.port):
                    raise Conflict(
                        f"port {name!r}: host port {want.port} is in use on this host by a process outside "
                        "the agent's slots; ask for another, or leave the number out to get a free one"
                    )
                result[name] = SlotPort(name, want.protocol, want.port)
                taken.add(want.port)
            for name, want in sorted(wanted.items()):
                if name in result:
                    continue
                number = next((p for p in range(first, last + 1) if p not in taken and not in_use(p)), None)
                if number is None:
                    raise Conflict(
                        f"port {name!r}: no free port left in [workers] port_range {first}-{last} "
                        f"({len(taken)} held by slots); widen the range or release a slot"
                    )
                result[name] = SlotPort(name, want.protocol, number)
                taken.add(number)
            if result != held:
                self._put_ports(slot_id, result.values())
            return sorted(result.values(), key=lambda p: p.name)

    def restore_ports(self, slot_id: str, ports: Iterable[SlotPort]) -> None:
        """Record ports a slot held before the database was lost (from its manifest), unchecked: its
        worker listens on them. Conflict when another slot holds one."""
        with self.transaction():
            try:
                self._put_ports(slot_id, ports)
            except StateError as err:
                raise Conflict(
                    f"slot {slot_id}: its recorded ports are held by another slot ({err})"
                ) from err

    def _put_ports(self, slot_id: str, ports: Iterable[SlotPort]) -> None:
        with self.transaction():
            self._write("DELETE FROM slot_ports WHERE slot_id = ?", (slot_id,))
            kept = tuple(sorted(ports, key=lambda p: p.name))
            for p in kept:
                self._write(
                    "INSERT INTO slot_ports (slot_id, name, protocol, port) VALUES (?, ?, ?, ?)",
                    (slot_id, p.name, p.protocol, p.port),
                )
            held = self._ports()
            if kept:
                held[slot_id] = kept
            else:
                held.pop(slot_id, None)
            slot = self.get_slot(slot_id)
            if slot is not None:
                self._keep_manifest(slot)

    def slot_ports(self, slot_id: str) -> list[SlotPort]:
        """The slot's named ports, by name."""
        return list(self._ports().get(slot_id, ()))

    def _ports(self) -> dict[str, tuple[SlotPort, ...]]:
        """Every slot's named ports, by name, kept write-through (read once, on first use)."""
        with self._lock:
            if self._ports_cache is None:
                ports: dict[str, list[SlotPort]] = {}
                sql = "SELECT slot_id, name, protocol, port FROM slot_ports ORDER BY slot_id, name"
                rows = self._read(sql)
                for r in rows:
                    ports.setdefault(str(r[0]), []).append(SlotPort(str(r[1]), _protocol(r[2]), int(r[3])))
                self._ports_cache = {slot_id: tuple(held) for slot_id, held in ports.items()}
            return self._ports_cache

    # --- events -------------------------------------------------------------------------------

    def add_event(self, kind: str, message: str, slot_id: str | None = None) -> None:
        """Append to the event log (on its own not waiting for the disk: the log informs, it is not
        the record; inside a durable transaction it is as durable as the rest).

        On its own it never fails the operation it describes for want of space: the event is
        logged instead. Inside a transaction it is part of the unit, and fails with it."""
        if self._depth == 0:
            try:
                self._add_event(kind, message, slot_id)
            except InsufficientStorage as err:
                log.warning(
                    "event not stored: %s", message, extra={"kind": kind, "slot": slot_id, "reason": str(err)}
                )
            _log_event(kind, message, slot_id)
            return
        self._add_event(kind, message, slot_id)
        self._told.append((kind, message, slot_id))

    def _add_event(self, kind: str, message: str, slot_id: str | None) -> None:
        with self.transaction(durable=False):
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


def slot_record(slot: Slot) -> dict[str, Any]:
    """A slot as the database holds it, in JSON (also each slot's manifest file)."""
    return {
        "id": slot.id,
        "name": slot.name,
        "qos": slot.qos,
        "request": request_to_dict(slot.request),
        "assignment": None if slot.assignment is None else slot.assignment.to_dict(),
        "state": str(slot.state),
        "reason": slot.reason,
        # cgroup and network repeat parts of applied, for people reading the database by hand.
        "cgroup": slot.cgroup,
        "network": None if slot.network is None else slot.network.to_json(),
        "applied": None if slot.applied is None else slot.applied.to_json(),
        "created_at": slot.created_at,
        "updated_at": slot.updated_at,
    }


def ports_from_record(values: Mapping[str, Any]) -> list[SlotPort]:
    """The ports a slot's manifest recorded (none in manifests older than ports)."""
    recorded = values.get("ports") or []
    return [SlotPort(str(p["name"]), _protocol(p.get("protocol")), int(p["port"])) for p in recorded]


def slot_from_record(values: Mapping[str, Any]) -> Slot:
    """Read back :func:`slot_record`."""
    assignment = values["assignment"]
    applied = values["applied"]
    return Slot(
        id=values["id"],
        name=values["name"],
        state=SlotState(values["state"]),
        request=parse_slot_request(values["request"]),
        assignment=None if assignment is None else Assignment.from_dict(assignment),
        applied=None if applied is None else AppliedSlot.from_json(applied),
        reason=values["reason"],
        created_at=values["created_at"],
        updated_at=values["updated_at"],
    )


def _slot_row(slot: Slot) -> tuple[Any, ...]:
    record = slot_record(slot)
    return tuple(_dump(record[c]) if c in _JSON_SLOT_COLUMNS else record[c] for c in _SLOT_COLUMNS)


def _as_stored(slot: Slot) -> Slot:
    """``slot`` as the database holds it: without what the service adds when it is read (worker
    status, foreign CPU, uid, QoS actions, endpoints), which live elsewhere or are measured."""
    return dataclasses.replace(
        slot, worker=None, foreign_cpu=None, sandbox_uid=None, qos_actions=(), qos_evicted=False, endpoints=()
    )


def _read_slots(rows: Iterable[tuple[Any, ...]], path: Path) -> dict[str, Slot]:
    slots: dict[str, Slot] = {}
    for row in rows:
        try:
            slot = _slot_from_row(row)
        except (ValueError, KeyError, TypeError) as err:  # pydantic's ValidationError is a ValueError
            problem = f"{row[0]!r}: {err}"
            raise StateError(f"the state database {path} holds a slot it cannot read ({problem})") from err
        slots[slot.id] = slot
    return slots


def _slot_from_row(row: tuple[Any, ...]) -> Slot:
    values = dict(zip(_SLOT_COLUMNS, row, strict=True))
    return slot_from_record({k: _load(v) if k in _JSON_SLOT_COLUMNS else v for k, v in values.items()})


def _status_columns(status: WorkerStatus) -> dict[str, Any]:
    body = status.to_json()
    return {
        "worker_pid": status.pid,
        "status": _dump(body),
        "restarts": status.restarts,
        "last_exit": _dump(body["last_exit"]),
    }


def _worker_row(worker: Worker) -> tuple[Any, ...]:
    columns: dict[str, Any] = {
        "slot_id": worker.slot_id,
        "spec": _dump(worker.spec.model_dump(mode="json", exclude_unset=True)),
        "desired": worker.desired,
        "keeper_pid": None,
        "worker_pid": None,
        "start_time": None,
        "status": None,
        "restarts": 0,
        "last_exit": None,
        "updated_at": worker.updated_at,
    }
    if worker.status is not None:
        columns.update(_status_columns(worker.status))
    return tuple(columns[c] for c in _WORKER_COLUMNS)


def worker_record(worker: Worker) -> dict[str, Any]:
    """What a manifest keeps of a worker: its spec and what the operator wants of it."""
    return {"spec": worker.spec.model_dump(mode="json", exclude_unset=True), "desired": worker.desired}


def worker_from_record(slot_id: str, values: Mapping[str, Any]) -> Worker:
    """Read back :func:`worker_record`."""
    return Worker(
        slot_id=slot_id,
        spec=parse_worker_spec(values["spec"]),
        desired="stopped" if values.get("desired") == "stopped" else "running",
    )


def _worker_from_row(row: tuple[Any, ...], spec_of: Callable[[str, str], WorkerSpec]) -> Worker:
    values = dict(zip(_WORKER_COLUMNS, row, strict=True))
    status = _load(values["status"])
    desired = values["desired"]
    return Worker(
        slot_id=values["slot_id"],
        spec=spec_of(values["slot_id"], values["spec"]),
        desired="stopped" if desired == "stopped" else "running",
        status=None if status is None else WorkerStatus.from_json(status),
        updated_at=values["updated_at"],
    )


__all__ = [
    "EventRecord",
    "StateError",
    "StateStore",
    "slot_from_record",
    "slot_record",
    "worker_from_record",
    "worker_record",
]
