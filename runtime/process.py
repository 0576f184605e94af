"""A worker process as the agent knows it: identity, the keeper's state file, exit records, handles.

A pid alone does not name a process: pids are reused. A process is ``(pid, start_time)``, where
start_time is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot; fixed for the process's
life). A pidfd opened and *then* checked against that start time refers to our process and no
other, for as long as we hold it, even if the pid is later reused.

The keeper writes ``worker.json`` in the worker's run directory, atomically and durably (write,
fsync, rename, fsync the directory): once when it takes custody of the worker after exec, and
again, final, once the worker has exited and nothing of its tree is left. That file is how the exit
of a worker that died while the agent was down is still known, and how a new keeper finds what it
must carry on for a worker it did not start (:class:`Custody`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nodeagent.atomicfile import write_atomic
from nodeagent.errors import WorkerError
from nodeagent.kernelfs import Procfs

STATE_FILE = "worker.json"
STATE_SCHEMA = "nodeagent.worker-state/v1"
#: In a worker's run directory: the launch id of the launch the agent asked to stop. Once a main
#: process ends, the keeper ends what is left of its tree (every task of its slot): with the stop
#: grace after a stop the agent asked for, so helpers finish draining; with at most
#: ORPHAN_GRACE_SECONDS after a main process ended on its own (a crash, an exit, the OOM killer),
#: whose helpers are orphans of a server that is gone and whose restart waits for them.
STOP_REQUESTED = "stop-requested"
ORPHAN_GRACE_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    pid: int
    start_time: int


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """How a worker ended. ``code`` is set for a normal exit, ``signal`` when a signal ended it."""

    code: int | None
    signal: int | None
    oom_killed: bool
    finished_at: float
    #: "exited", "signaled", "oom-killed"; "unknown": it ended while a keeper watched it that was
    #: not its parent (it had outlived the keeper that started it), so when is known but not how;
    #: "lost": it ended while no keeper watched it, and nobody saw how or exactly when.
    reason: str
    #: Why the agent stopped it, when it did so on its own (a start-up timeout, a failed liveness
    #: probe): its exit status is then the answer to the agent's signal, not a verdict of its own.
    stopped_by: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.code == 0 and self.stopped_by is None

    def describe(self) -> str:
        if self.stopped_by is not None:
            return f"stopped by the agent ({self.stopped_by}), then {self._how()}"
        return self._how()

    def _how(self) -> str:
        if self.reason == "lost":
            return "ended while no keeper watched it; its exit status is unknown"
        if self.reason == "unknown":
            oom = " (the slot's OOM killer struck meanwhile)" if self.oom_killed else ""
            return f"ended after the keeper that started it was gone; its exit status is unknown{oom}"
        if self.oom_killed:
            return "killed by the kernel's OOM killer (the slot ran out of memory)"
        if self.signal is not None:
            return f"killed by signal {signal.Signals(self.signal).name}"
        return f"exited with status {self.code}"

    @classmethod
    def from_wait_status(cls, status: int, *, oom_kills: int, finished_at: float) -> ExitRecord:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            oom = sig == signal.SIGKILL and oom_kills > 0
            return cls(None, sig, oom, finished_at, "oom-killed" if oom else "signaled")
        return cls(os.WEXITSTATUS(status), None, False, finished_at, "exited")

    @classmethod
    def unknown(cls, *, oom_kills: int, finished_at: float) -> ExitRecord:
        return cls(None, None, oom_kills > 0, finished_at, "unknown")

    @classmethod
    def lost(cls, finished_at: float) -> ExitRecord:
        return cls(None, None, False, finished_at, "lost")

    def to_json(self) -> dict[str, Any]:
        """The stored and published form; ``description`` is for people and ignored when read."""
        return {**asdict(self), "description": self.describe()}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ExitRecord:
        return cls(
            code=body.get("code"),
            signal=body.get("signal"),
            oom_killed=bool(body.get("oom_killed", False)),
            finished_at=float(body.get("finished_at", 0.0)),
            reason=str(body.get("reason", "lost")),
            stopped_by=body.get("stopped_by"),
        )


@dataclass(frozen=True, slots=True)
class Custody:
    """What a keeper does for a worker besides waiting for it, kept in the state file so that a new
    keeper can carry on for a worker it did not start. Never the worker's argv or environment
    (they may hold secrets); only where things are."""

    #: The FIFOs that are the worker's stdout and stderr (the worker holds them open read-write, so
    #: it never gets EPIPE when no keeper reads; a keeper reopens them by path).
    stdout_fifo: str
    stderr_fifo: str
    log_dir: str
    log_max_bytes: int
    log_backups: int
    #: cgroup.procs files of the slot: what is left there is ended once the worker's main exits.
    cgroup_procs: tuple[str, ...] = ()
    stop_grace_seconds: float = 30.0
    oom_events: str | None = None
    #: The slot's OOM kill count just before exec (counted from inside the slot).
    oom_before: int = 0
    #: Free bytes the log leaves on its file system (the agent's reserve); 0: none kept.
    log_reserve_bytes: int = 0

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Custody:
        fixed = dict(body)
        fixed["cgroup_procs"] = tuple(fixed.get("cgroup_procs", ()))
        return cls(**fixed)


@dataclass(frozen=True)
class WorkerState:
    """The contents of the keeper's state file."""

    launch_id: str
    worker: ProcessIdentity
    #: The keeper that took custody after exec (the worker's parent).
    keeper: ProcessIdentity
    started_at: float
    exit: ExitRecord | None = None
    custody: Custody | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["schema"] = STATE_SCHEMA
        if self.exit is not None:
            body["exit"] = self.exit.to_json()
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkerState:
        if body.get("schema") != STATE_SCHEMA:
            raise ValueError(f"schema is {body.get('schema')!r}, expected {STATE_SCHEMA!r}")
        exit_body = body.get("exit")
        custody = body.get("custody")
        return cls(
            launch_id=str(body["launch_id"]),
            worker=ProcessIdentity(**body["worker"]),
            keeper=ProcessIdentity(**body["keeper"]),
            started_at=float(body["started_at"]),
            exit=ExitRecord.from_json(exit_body) if exit_body else None,
            custody=Custody.from_json(custody) if custody else None,
        )


def write_state(run_dir: Path, state: WorkerState, *, durable: bool = True) -> None:
    """Replace the state file atomically: a crash of the keeper leaves the old record or the new
    one, never half of one. ``durable`` (fsync of the file and of the rename) makes that hold for a
    crash of the whole host too, so a written exit is never lost. The record a keeper writes when
    it takes custody of a worker need not be: after a host crash that worker is gone anyway, and
    the previous record (or none) leads to the same verdict, so two fsyncs stay off the launch's
    heels."""
    write_atomic(
        run_dir / STATE_FILE, json.dumps(state.to_json(), sort_keys=True), mode=0o644, durable=durable
    )


def read_state(run_dir: Path) -> WorkerState | None:
    """The state file's contents, or None when there is none (never launched here)."""
    path = run_dir / STATE_FILE
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise WorkerError(f"cannot read worker state {path}: {err.strerror}") from err
    try:
        return WorkerState.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as err:
        raise WorkerError(
            f"worker state {path} is unreadable ({err}); remove it if no worker runs from this directory"
        ) from err


def process_start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None when no such process exists."""
    text = Procfs(proc).read_text(f"{pid}/stat")
    if text is None:
        return None
    # comm (field 2) may hold spaces and parentheses; the fields after its last ')' are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


def read_oom_kills(events_file: str | None) -> int:
    """The ``oom_kill`` counter of a memory cgroup (v1 memory.oom_control, v2 memory.events)."""
    if events_file is None:
        return 0
    if os.path.basename(events_file) == "memory.oom_control":
        # v1 counts a kill in the victim's own memory cgroup only: a container worker's processes
        # live in cgroups below the slot's (runtime/container.py), so the slot's count is the sum.
        # v2's memory.events is hierarchical already.
        total = 0
        for directory, _subdirs, files in os.walk(os.path.dirname(events_file)):
            if "memory.oom_control" in files:
                total += _oom_kill_in(os.path.join(directory, "memory.oom_control"))
        return total
    return _oom_kill_in(events_file)


def _oom_kill_in(events_file: str) -> int:
    try:
        with open(events_file) as handle:
            for line in handle:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except OSError:
        return 0
    return 0


def open_verified_pidfd(identity: ProcessIdentity, proc: Path = Path("/proc")) -> int | None:
    """A pidfd for exactly this process, or None when it is gone or its pid now names another.

    The pidfd is opened first and the start time checked after: if the check passes, the pidfd was
    opened on our process (a reused pid would carry a later start time).
    """
    try:
        pidfd = os.pidfd_open(identity.pid)
    except ProcessLookupError:
        return None
    if process_start_time(identity.pid, proc) != identity.start_time:
        os.close(pidfd)
        return None
    return pidfd


def fd_fired(fd: int) -> bool:
    """Whether ``fd`` polls readable: a pidfd once its process has exited (zombie or reaped), a
    keeper's notice pipe once the keeper closed its end; -1 stands for one that has fired."""
    if fd < 0:
        return True
    # poll(2), not select(2): a daemon holding two descriptors per worker passes fd 1024
    # (FD_SETSIZE) at about 500 workers, and select() refuses any descriptor from there on.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class Watcher(Protocol):
    """The agent's link to the keeper, as a worker handle needs it (see keeper_client.py)."""

    def watch(self, run_dir: Path, launch_id: str) -> int | None:
        """A notice descriptor for the worker of ``run_dir`` from a live keeper (starting one if
        none runs), or None when no keeper holds it any more: its record is final, or there is
        none. Raises WorkerError when no keeper can be reached."""
        ...


class WorkerProcess:
    """A worker the agent holds: its pidfd, the keeper's notice pipe, and its run directory.

    The keeper holds the write end of the notice pipe and closes it once the worker's exit record
    is final (its tree ended, the record on disk), so ``exit_fd`` turns readable exactly when
    :meth:`poll` has something to return, and a loop waiting on it wakes once per exit. The pipe
    also fires when the keeper dies; then :meth:`poll` asks ``keeper`` for a fresh notice from the
    keeper that replaces it, which re-adopts the worker.

    ``pidfd`` is -1 when the process was already gone (or its pid named a stranger) when we looked:
    then ``send_signal`` does nothing.
    """

    __slots__ = ("_exit", "_keeper", "_notice", "_pidfd", "run_dir", "state")  # one per slot

    def __init__(self, state: WorkerState, run_dir: Path, pidfd: int, notice: int, keeper: Watcher) -> None:
        self.state = state
        self.run_dir = run_dir
        self._pidfd = pidfd
        self._notice = notice
        self._keeper = keeper
        self._exit: ExitRecord | None = None

    @property
    def pid(self) -> int:
        return self.state.worker.pid

    @property
    def identity(self) -> ProcessIdentity:
        return self.state.worker

    @property
    def exit_fd(self) -> int | None:
        """Readable once :meth:`poll` has news (the exit is final, or the keeper went away)."""
        return None if self._notice < 0 or self._exit is not None else self._notice

    def send_signal(self, sig: int) -> None:
        """Ask the worker to stop with ``sig``, through its pidfd: never a stranger that inherited
        the pid. The run directory first says that this launch was asked to stop
        (:data:`STOP_REQUESTED`), so that the keeper gives what is left of its tree, once the main
        process ends, the whole stop grace to drain, not an orphan's."""
        if self._pidfd < 0:
            return
        # Unwritten, the remainder of its tree gets an orphan's grace: shorter, never longer. The
        # keeper makes the run directory when it takes custody, which may come after the launch
        # returned: a stop asked at once (a slot deleted as it starts) must not find none.
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.run_dir / STOP_REQUESTED).write_text(self.state.launch_id)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def poll(self, now: float | None = None) -> ExitRecord | None:
        """The exit record once the keeper has made it final, else None. Never raises: when no
        keeper can be reached it answers None and is asked again."""
        if self._exit is not None:
            return self._exit
        if not fd_fired(self._notice):
            return None
        record = self._final_record()
        if record is None:
            # The notice fired without a final record: the keeper that held it is gone. Ask for
            # the one that replaces it (it re-adopts the worker, or records how it ended).
            try:
                notice = self._keeper.watch(self.run_dir, self.state.launch_id)
            except WorkerError:
                return None  # no keeper now; the supervision loop asks again at its next tick
            if notice is not None:
                os.close(self._notice)
                self._notice = notice
                return None
            record = self._final_record() or ExitRecord.lost(time.time() if now is None else now)
        self._exit = record
        return record

    def _final_record(self) -> ExitRecord | None:
        try:
            state = read_state(self.run_dir)
        except WorkerError:
            return None
        if state is not None and state.launch_id == self.state.launch_id:
            return state.exit
        return None

    def close(self) -> None:
        for fd in (self._pidfd, self._notice):
            if fd >= 0:
                os.close(fd)
        self._pidfd = self._notice = -1

    def __del__(self) -> None:
        self.close()
