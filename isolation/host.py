"""Host partitioning: exclusive CPUs kept free of everything the agent does not own.

A guaranteed slot's cpuset keeps the agent's other slots off its CPUs, but not the rest of the host:
system daemons, user sessions, cron jobs, unbound kernel threads and device interrupts keep their
full affinity. While any exclusive CPU is held, :class:`HostPartitioner` confines all of them to the
CPUs that are not exclusive (the shared pool and the reserved CPUs), and puts them back when the
CPUs are freed. What moves, and how:

========================  =======================================================================
part                      mechanism
========================  =======================================================================
``processes``             cgroup v2: the cpuset of every cgroup beside the path to the agent's
                          parent (systemd's ``AllowedCPUs=`` when systemd owns it); tasks those
                          cannot reach (cgroup v1, tasks in the root cgroup, PID 1): their
                          affinity, so what they fork inherits it
``kernel-threads``        kthreadd and every unbound kernel thread: their affinity
``workqueue``             the unbound workqueue cpumask (moves the unbound kworkers)
``irqs``                  every interrupt's ``smp_affinity_list`` and ``default_smp_affinity``;
                          irqbalance is told to ban the CPUs too
========================  =======================================================================

What cannot move is reported, not forced: per-CPU kernel threads, managed interrupts (the kernel
answers EIO), tasks a foreign cpuset pins to an exclusive CPU.

The decision is pure (:func:`plan_host`): from what the host looks like now (:class:`HostView`,
plain data), the exclusive CPUs and the record of what was changed before (:class:`HostRecord`),
it says what each item should hold. Each item's *wish* is what it would hold without the agent: the
recorded "before" while it still holds what the agent gave it; what it holds now once its owner
changed it since (that owner's choice wins when the CPUs are freed); for a task born while the host
was confined, the wish of the ancestor it inherited the confinement from. Its target is the wish
without the exclusive CPUs (or all host CPUs when nothing would remain), or the wish itself when
nothing is exclusive: the same function confines, follows changes of the exclusive set, puts things
back, and repairs the host after a crash of the agent.

Every change is **recorded** first (a JSON file written atomically before anything is changed), so
an agent that dies at any instant finds at its next start what it had changed and derives what to
put back from the slots that exist then; ``nodeagent serve --restore-host`` puts everything back.
New tasks inherit the confinement from their parent, but a task may widen its own affinity, and the
kernel sends no event for that (the proc connector reports fork, exec and exit, not affinity), so a
periodic :meth:`HostPartitioner.sweep` finds and confines them again, along with interrupts that
irqbalance or a hot-plug moved, and new unbound kernel threads (which the kernel starts on its
housekeeping CPUs whatever kthreadd's affinity is).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from nodeagent.atomicfile import fsync_dir, write_atomic
from nodeagent.cpulist import format_cpulist, parse_cpulist
from nodeagent.errors import (
    NO_SPACE,
    ConfigError,
    InsufficientStorage,
    InvalidRequest,
    KernelError,
    os_error_message,
)

log = logging.getLogger("nodeagent.host")

Part = Literal["processes", "kernel-threads", "workqueue", "irqs"]
PARTS: tuple[Part, ...] = ("processes", "kernel-threads", "workqueue", "irqs")
KnobKind = Literal["cgroup", "irq", "irq-default", "workqueue"]
#: Which part each kind of setting belongs to.
KNOB_PART: Mapping[KnobKind, Part] = {
    "cgroup": "processes",
    "irq": "irqs",
    "irq-default": "irqs",
    "workqueue": "workqueue",
}
RECORD_SCHEMA = "nodeagent.host-partition/v1"

# task flags (include/linux/sched.h), /proc/PID/stat field 9
PF_WQ_WORKER = 0x00000020
PF_KTHREAD = 0x00200000
PF_NO_SETAFFINITY = 0x04000000


def validate_parts(parts: Iterable[str]) -> frozenset[Part]:
    """The configured parts; ConfigError names an unknown one."""
    chosen = frozenset(parts)
    unknown = sorted(chosen - set(PARTS))
    if unknown:
        raise ConfigError(
            f"host partitioning part(s) {', '.join(map(repr, unknown))} unknown; "
            f"use any of {', '.join(PARTS)}"
        )
    return frozenset(p for p in PARTS if p in chosen)


# =========================================================================== what the host looks like


@dataclass(frozen=True)
class Task:
    """One thread, as /proc shows it. ``start`` (field 22) tells a reused tid from the task we saw."""

    tid: int
    pid: int  #: its thread group (process)
    ppid: int
    start: int
    comm: str
    cpus: frozenset[int]
    flags: int = 0
    #: inside the agent's own cgroups: its slots' cpusets confine it already
    in_slot: bool = False
    #: in a cgroup whose cpuset the host partitioner sets (cgroup v2): its affinity is left alone
    cgroup_confined: bool = False

    @property
    def key(self) -> str:
        return f"{self.tid}:{self.start}"

    @property
    def kthread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)

    @property
    def pinned(self) -> bool:
        """The kernel refuses to change its affinity (per-CPU kthreads, workqueue workers)."""
        return bool(self.flags & PF_NO_SETAFFINITY)

    @property
    def kthreadd(self) -> bool:
        return self.kthread and self.ppid == 0 and self.comm == "kthreadd"

    @property
    def part(self) -> Part:
        return "kernel-threads" if self.kthread else "processes"


@dataclass(frozen=True)
class Knob:
    """A host setting that holds a CPU set: a cgroup's cpuset, an interrupt's affinity, the
    workqueue cpumask. An empty set on a cgroup means "the parent's" (cgroup v2)."""

    kind: KnobKind
    key: str  #: cgroup relpath, IRQ number, "default" or "unbound"
    cpus: frozenset[int]
    label: str = ""  #: the interrupt's name, the cgroup's systemd unit

    @property
    def ident(self) -> str:
        return f"{self.kind}:{self.key}"


@dataclass(frozen=True)
class HostView:
    """What the host holds now: online CPUs, tasks and settings (plain data, read by the backends)."""

    online: frozenset[int]
    tasks: tuple[Task, ...] = ()
    knobs: tuple[Knob, ...] = ()


# =========================================================================== the record


@dataclass(frozen=True)
class Entry:
    """One thing the agent changed: what it held before (its wish) and what the agent set."""

    before: frozenset[int]
    after: frozenset[int]
    label: str = ""  #: command name of a task, an interrupt's name, a cgroup's unit
    pid: int = 0  #: tasks: the process it belongs to (for the inheritance of a thread's mask)


@dataclass(frozen=True)
class HostRecord:
    """Everything changed on the host, keyed by task key (``tid:start``) or knob ident."""

    exclusive: frozenset[int] = frozenset()
    tasks: Mapping[str, Entry] = field(default_factory=dict)
    knobs: Mapping[str, Entry] = field(default_factory=dict)
    irqbalance: Mapping[str, Any] | None = None  #: pid and banned CPUs of the irqbalance we told

    @property
    def empty(self) -> bool:
        return not self.tasks and not self.knobs and self.irqbalance is None

    def to_json(self) -> dict[str, Any]:
        def entries(items: Mapping[str, Entry]) -> dict[str, Any]:
            return {
                key: {
                    "before": format_cpulist(e.before),
                    "after": format_cpulist(e.after),
                    "label": e.label,
                    **({"pid": e.pid} if e.pid else {}),
                }
                for key, e in sorted(items.items())
            }

        return {
            "schema": RECORD_SCHEMA,
            "exclusive": format_cpulist(self.exclusive),
            "tasks": entries(self.tasks),
            "knobs": entries(self.knobs),
            "irqbalance": None if self.irqbalance is None else dict(self.irqbalance),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "the host record") -> HostRecord:
        def entries(raw: Any) -> dict[str, Entry]:
            if not isinstance(raw, dict):
                raise TypeError("entries are not an object")
            return {
                str(key): Entry(
                    parse_cpulist(str(e["before"])),
                    parse_cpulist(str(e["after"])),
                    str(e.get("label", "")),
                    int(e.get("pid", 0)),
                )
                for key, e in raw.items()
            }

        try:
            if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
                raise ValueError(f"not a {RECORD_SCHEMA} document")
            irqbalance = data.get("irqbalance")
            return cls(
                exclusive=parse_cpulist(str(data.get("exclusive", ""))),
                tasks=entries(data.get("tasks", {})),
                knobs=entries(data.get("knobs", {})),
                irqbalance=dict(irqbalance) if isinstance(irqbalance, dict) else None,
            )
        except (KeyError, TypeError, ValueError, InvalidRequest) as err:
            raise ConfigError(
                f"{where} is malformed ({err}); what it recorded cannot be put back automatically: move it "
                "aside, then check CPU affinities (taskset -p, /proc/irq/*/smp_affinity_list) by hand"
            ) from None


class RecordFile:
    """The record on disk: written whole or not at all, and flushed, before any change it names."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> HostRecord:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return HostRecord()
        except OSError as err:
            raise KernelError(os_error_message(f"reading the host record {self.path}", err)) from err
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"the host record {self.path} is not JSON ({err}); move it aside") from None
        return HostRecord.from_json(data, str(self.path))

    def save(self, record: HostRecord) -> None:
        if record.empty:
            self.remove()
            return
        body = json.dumps(record.to_json(), indent=1)
        try:
            # Durable before the change it describes: after a power loss or a crash the next
            # start must still know what to put back.
            write_atomic(self.path, body, mode=0o600, durable=True)
        except OSError as err:
            if err.errno in NO_SPACE:
                raise InsufficientStorage(
                    f"cannot write the host record {self.path}: its filesystem is full, so the host is left "
                    "as it is (exclusive CPUs are shared with the rest of the host); free space there"
                ) from err
            raise KernelError(os_error_message(f"writing the host record {self.path}", err)) from err

    def remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return
        except OSError as err:
            raise KernelError(os_error_message(f"removing the host record {self.path}", err)) from err
        fsync_dir(self.path.parent)


# =========================================================================== the pure decision


@dataclass(frozen=True)
class Move:
    """One write the plan needs: ``item`` (a Task or a Knob) from what it holds to ``to``."""

    item: Task | Knob
    to: frozenset[int]
    wish: frozenset[int]

    @property
    def kind(self) -> str:
        return "task" if isinstance(self.item, Task) else self.item.kind

    @property
    def ident(self) -> str:
        return self.item.key if isinstance(self.item, Task) else self.item.ident


@dataclass(frozen=True)
class HostPlan:
    exclusive: frozenset[int]
    host_cpus: frozenset[int]  #: where everything outside the slots may run
    moves: tuple[Move, ...]
    record: HostRecord  #: the record that holds once every move is made
    immovable: tuple[str, ...]  #: what stays on exclusive CPUs, and why
    problems: tuple[str, ...] = ()


def confine(wish: frozenset[int], online: frozenset[int], exclusive: frozenset[int]) -> frozenset[int]:
    """``wish`` without the exclusive CPUs; all host CPUs where nothing of it would remain.

    Narrowing keeps an operator's pin (a daemon pinned to CPU 2 stays on 2); replacing the mask only
    when nothing remains keeps such a task running.
    """
    kept = (wish or online) & online - exclusive
    return kept or (online - exclusive)


def plan_host(
    view: HostView,
    exclusive: frozenset[int],
    record: HostRecord,
    parts: Collection[Part] = PARTS,
) -> HostPlan:
    """What every task and setting of ``view`` should hold while ``exclusive`` CPUs are held (pure)."""
    online = view.online
    exclusive = exclusive & online
    host_cpus = online - exclusive
    problems: list[str] = []
    confining = bool(exclusive)
    if confining and not host_cpus:
        problems.append(
            f"every online CPU ({format_cpulist(online)}) is exclusive: the rest of the host has nowhere to "
            "run, so it is left where it is; reserve a CPU for it ([placement] reserved_cpus)"
        )
        confining = False
    wishes = _TaskWishes(view.tasks, record.tasks)
    moves: list[Move] = []
    tasks: dict[str, Entry] = {}
    immovable: list[str] = []
    for task in view.tasks:
        recorded = record.tasks.get(task.key)
        if task.in_slot:
            continue  # a worker that joined a slot after it was confined: its cpuset decides now
        wish = wishes.wish(task)
        if task.pinned:
            if confining and task.cpus & exclusive and task.kthread and not task.flags & PF_WQ_WORKER:
                immovable.append(
                    f"kernel thread {task.comm} (pid {task.tid}) is bound to CPU(s) {_cpus(task.cpus)}"
                )
            continue
        if task.cgroup_confined or task.part not in parts:
            to = wish
        else:
            to = confine(wish, online, exclusive) if confining else wish
        if to != task.cpus:
            moves.append(Move(task, to, wish))
        if to != wish:
            tasks[task.key] = Entry(wish, to, task.comm, task.pid)
        elif recorded is not None and to != task.cpus:
            # Being put back: keep the entry until the write has succeeded.
            tasks[task.key] = Entry(wish, to, task.comm, task.pid)
    knobs: dict[str, Entry] = {}
    for knob in view.knobs:
        recorded = record.knobs.get(knob.ident)
        wish = recorded.before if recorded is not None and knob.cpus == recorded.after else knob.cpus
        to = confine(wish, online, exclusive) if confining and KNOB_PART[knob.kind] in parts else wish
        if to != knob.cpus:
            moves.append(Move(knob, to, wish))
        if to != wish or (recorded is not None and to != knob.cpus):
            knobs[knob.ident] = Entry(wish, to, knob.label)
    return HostPlan(
        exclusive=exclusive,
        host_cpus=host_cpus,
        moves=tuple(moves),
        record=HostRecord(exclusive if confining else frozenset(), tasks, knobs, record.irqbalance),
        immovable=tuple(immovable),
        problems=tuple(problems),
    )


class _TaskWishes:
    """Each task's wish, following inheritance: a task that holds exactly what its nearest recorded
    ancestor was given inherited it (it was born confined), and wants what that ancestor wants."""

    _MAX_DEPTH = 64

    def __init__(self, tasks: Sequence[Task], recorded: Mapping[str, Entry]) -> None:
        self._by_tid = {t.tid: t for t in tasks}
        self._recorded = recorded
        self._memo: dict[int, frozenset[int]] = {}

    def wish(self, task: Task) -> frozenset[int]:
        found = self._memo.get(task.tid)
        if found is None:
            found = self._memo[task.tid] = self._wish(task, 0)
        return found

    def _wish(self, task: Task, depth: int) -> frozenset[int]:
        entry = self._recorded.get(task.key)
        if entry is not None:
            # Still what we gave it: it wants what it had; changed since: its owner's choice wins.
            return entry.before if task.cpus == entry.after else task.cpus
        ancestor = self._recorded_ancestor(task, depth)
        if ancestor is not None:
            given = self._recorded[ancestor.key].after
            if task.cpus == given:
                return self.wish(ancestor)
        return task.cpus

    def _recorded_ancestor(self, task: Task, depth: int) -> Task | None:
        current = task
        for _ in range(self._MAX_DEPTH - depth):
            parent_tid = current.pid if current.tid != current.pid else current.ppid
            parent = self._by_tid.get(parent_tid)
            if parent is None or parent.tid == current.tid:
                return None
            if parent.key in self._recorded:
                return parent
            current = parent
        return None


def _cpus(cpus: Iterable[int]) -> str:
    return format_cpulist(cpus) or "none"


# =========================================================================== backends (the kernel edge)


class HostBackend(Protocol):
    """One kind of host state: what it holds now, and how to change one item of it."""

    def read(self) -> Sequence[Task] | Sequence[Knob]: ...

    def write(self, item: Any, cpus: frozenset[int]) -> None:
        """Set ``item`` to ``cpus``; OSError as the kernel answered (ESRCH: gone, EIO: managed...)."""
        ...


class Notifier(Protocol):
    """Something that must be told which CPUs are exclusive (irqbalance)."""

    def notify(
        self, exclusive: frozenset[int], record: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, Any] | None, tuple[str, ...]]:
        """Tell it; return what to record for putting it back later, and warnings."""
        ...


@dataclass
class HostReport:
    """What one partitioning pass did, for logs, ``GET /v1/node`` and the doctor."""

    exclusive: frozenset[int] = frozenset()
    host_cpus: frozenset[int] = frozenset()
    moved: dict[str, int] = field(default_factory=dict)  #: kind -> items changed
    confined: dict[str, int] = field(default_factory=dict)  #: kind -> items held confined after the pass
    immovable: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "exclusive_cpus": format_cpulist(self.exclusive),
            "host_cpus": format_cpulist(self.host_cpus),
            "moved": dict(self.moved),
            "confined": dict(self.confined),
            "immovable": list(self.immovable),
            "problems": list(self.problems),
            "warnings": list(self.warnings),
            "seconds": round(self.seconds, 4),
            "at": self.at,
        }


#: How many individual failures a report lists before it only counts them.
_REPORT_LIMIT = 20


class HostPartitioner:
    """Confines the host to the CPUs that are not exclusive, records what it changed, puts it back.

    ``tasks`` and ``knobs`` are the backends (procfs tasks, cgroups, interrupts, the workqueue);
    ``record`` is where the changes are written first. Thread-safe: one lock around every pass.
    """

    def __init__(
        self,
        online: Callable[[], frozenset[int]],
        tasks: HostBackend | None,
        knobs: Sequence[HostBackend],
        record: RecordFile,
        *,
        parts: Collection[Part] = PARTS,
        notifiers: Sequence[Notifier] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._online = online
        self._tasks = tasks
        self._knobs = tuple(knobs)
        self._record_file = record
        self.parts = validate_parts(parts)
        self._notifiers = tuple(notifiers)
        self._clock = clock
        self._lock = threading.Lock()
        self._exclusive: frozenset[int] | None = None
        self.last: HostReport | None = None

    @property
    def exclusive(self) -> frozenset[int] | None:
        """The exclusive CPUs of the last pass (None before the first)."""
        return self._exclusive

    def apply(self, exclusive: frozenset[int]) -> HostReport:
        """Make the host match ``exclusive`` (empty: put everything back); record first, then change."""
        with self._lock:
            return self._apply(frozenset(exclusive))

    def sweep(self) -> HostReport | None:
        """Apply the last exclusive set again: confines tasks that widened their affinity since, new
        kernel threads, interrupts something moved back. None before the first apply.

        The exclusive set is read under the lock: a sweep that started while an allocation was
        changing it must not put back what that allocation has just confined."""
        with self._lock:
            exclusive = self._exclusive
            if exclusive is None or (not exclusive and self._record_file.load().empty):
                return None  # nothing held off any CPU, nothing left to put back
            return self._apply(exclusive)

    def _apply(self, exclusive: frozenset[int]) -> HostReport:
        """The body of :meth:`apply`; the caller holds the lock."""
        began = time.monotonic()
        record = self._record_file.load()
        view = self._read()
        plan = plan_host(view, exclusive, record, self.parts)
        report = HostReport(plan.exclusive, plan.host_cpus, at=self._clock())
        report.problems += plan.problems
        report.immovable += _limited(plan.immovable, "kernel threads")
        irqbalance, warnings = self._notify(plan.record.exclusive, record.irqbalance)
        report.warnings += warnings
        wanted = replace(plan.record, irqbalance=irqbalance)
        # The union of what was recorded and what is about to change: whatever instant the agent
        # dies at, the file names everything that may differ from its wish.
        self._save(_union(record, wanted), record)
        failed, gone = self._move(plan.moves, report)
        final = _settle(wanted, record, failed, gone, self._kinds_read())
        self._save(final, _union(record, wanted))
        report.confined = {
            "tasks": len(final.tasks),
            **{kind: sum(1 for k in final.knobs if k.startswith(kind + ":")) for kind in KNOB_PART},
        }
        report.seconds = time.monotonic() - began
        self._exclusive = plan.exclusive
        self.last = report
        return report

    def restore(self) -> HostReport:
        """Put back everything recorded (nothing exclusive)."""
        return self.apply(frozenset())

    def recorded(self) -> HostRecord:
        with self._lock:
            return self._record_file.load()

    # -- internals --------------------------------------------------------------------------------

    def _read(self) -> HostView:
        tasks: list[Task] = []
        if self._tasks is not None:
            tasks = [t for t in self._tasks.read() if isinstance(t, Task)]
        knobs = [k for backend in self._knobs for k in backend.read() if isinstance(k, Knob)]
        return HostView(self._online(), tuple(tasks), tuple(knobs))

    def _backend_for(self, move: Move) -> HostBackend:
        if isinstance(move.item, Task):
            assert self._tasks is not None  # a task move comes only from the task backend's read
            return self._tasks
        return self._knob_backends[move.item.kind]

    @property
    def _knob_backends(self) -> dict[str, HostBackend]:
        found: dict[str, HostBackend] = {}
        for backend in self._knobs:
            for kind in getattr(backend, "kinds", ()):
                found[kind] = backend
        return found

    def _kinds_read(self) -> frozenset[str]:
        return frozenset(self._knob_backends)

    def _move(self, moves: Sequence[Move], report: HostReport) -> tuple[set[str], set[str]]:
        """Make the moves; return the idents of those that did not happen, and of those among them
        whose item is gone (a task that exited, an interrupt freed)."""
        failed: set[str] = set()
        gone: set[str] = set()
        refusals: list[str] = []
        for move in moves:
            try:
                self._backend_for(move).write(move.item, move.to)
            except OSError as err:
                failed.add(move.ident)
                if err.errno in (errno.ESRCH, errno.ENOENT):
                    gone.add(move.ident)
                else:
                    refusals.append(_refusal(move, err))
                continue
            report.moved[move.kind] = report.moved.get(move.kind, 0) + 1
        report.immovable += _limited(refusals, "refusals")
        return failed, gone

    def _notify(
        self, exclusive: frozenset[int], recorded: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, Any] | None, list[str]]:
        if "irqs" not in self.parts:
            exclusive = frozenset()
        state = recorded
        warnings: list[str] = []
        for notifier in self._notifiers:
            state, said = notifier.notify(exclusive, state)
            warnings += said
        return state, warnings

    def _save(self, record: HostRecord, previous: HostRecord) -> None:
        if record != previous:
            self._record_file.save(record)


def _refusal(move: Move, err: OSError) -> str:
    item = move.item
    reason = os.strerror(err.errno) if err.errno else str(err)
    if isinstance(item, Task):
        what = f"task {item.comm} (pid {item.tid})"
        if err.errno == errno.EINVAL:
            reason = "its cpuset or the kernel pins it there"
    elif item.kind == "irq":
        what = f"interrupt {item.key}" + (f" ({item.label})" if item.label else "")
        if err.errno == errno.EIO:
            reason = "the kernel keeps its affinity (a managed or per-CPU interrupt)"
    else:
        what = f"{item.kind} {item.key}"
    return f"{what} stays on CPU(s) {_cpus(item.cpus)}: {reason}"


def _limited(lines: Sequence[str], what: str) -> list[str]:
    if len(lines) <= _REPORT_LIMIT:
        return list(lines)
    return [*lines[:_REPORT_LIMIT], f"... and {len(lines) - _REPORT_LIMIT} more {what}"]


def _union(old: HostRecord, new: HostRecord) -> HostRecord:
    """``new``, plus what only ``old`` names (kept until the move that puts it back has happened)."""
    return HostRecord(
        exclusive=new.exclusive,
        tasks={**old.tasks, **new.tasks},
        knobs={**old.knobs, **new.knobs},
        irqbalance=new.irqbalance,
    )


def _settle(
    wanted: HostRecord,
    old: HostRecord,
    failed: Collection[str],
    gone: Collection[str],
    kinds_read: Collection[str],
) -> HostRecord:
    """The record once the moves are made. A failed move left its item as it was, which the old
    record describes (a refused confinement: no entry; a refused put-back: the old entry, retried
    on the next pass); an item that is gone needs no entry. Entries of kinds no backend read this
    time (a backend missing on this start) are kept for a start that has it."""
    # A put-back that happened needs its entry no more (entries with before == after mark one).
    tasks = {k: e for k, e in wanted.tasks.items() if e.before != e.after}
    knobs = {k: e for k, e in wanted.knobs.items() if e.before != e.after}
    for ident in failed:
        for mine, before in ((tasks, old.tasks), (knobs, old.knobs)):
            if ident not in mine and ident not in before:
                continue
            mine.pop(ident, None)
            if ident not in gone and ident in before:
                mine[ident] = before[ident]
    for ident, entry in old.knobs.items():
        if ident.partition(":")[0] not in kinds_read:
            knobs.setdefault(ident, entry)
    return replace(wanted, tasks=tasks, knobs=knobs)


__all__ = [
    "KNOB_PART",
    "PARTS",
    "PF_KTHREAD",
    "PF_NO_SETAFFINITY",
    "PF_WQ_WORKER",
    "Entry",
    "HostBackend",
    "HostPartitioner",
    "HostPlan",
    "HostRecord",
    "HostReport",
    "HostView",
    "Knob",
    "Move",
    "Notifier",
    "Part",
    "RecordFile",
    "Task",
    "confine",
    "plan_host",
    "validate_parts",
]
