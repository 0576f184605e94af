"""A worker process as the agent knows it: identity, the keeper's state file, exit records, pidfds.

A pid alone does not name a process: pids are reused. A process is ``(pid, start_time)``, where
start_time is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot; fixed for the process's
life). A pidfd opened and *then* checked against that start time refers to our process and no
other, for as long as we hold it, even if the pid is later reused.

The keeper writes ``worker.json`` in the worker's run directory (atomically: write, then rename):
once when the worker has exec'd, and again when it has exited. That file is how the exit of a
worker that died while the agent was down is still known.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nodeagent.errors import WorkerError

STATE_FILE = "worker.json"
STATE_SCHEMA = "nodeagent.worker-state/v1"


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int


@dataclass(frozen=True)
class ExitRecord:
    """How a worker ended. ``code`` is set for a normal exit, ``signal`` when a signal ended it."""

    code: int | None
    signal: int | None
    oom_killed: bool
    finished_at: float
    #: "exited", "signaled", "oom-killed", or "lost" (it ended and nobody saw how).
    reason: str

    @property
    def succeeded(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.reason == "lost":
            return "ended while unobserved; its exit status is unknown"
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
        )


@dataclass(frozen=True)
class WorkerState:
    """The contents of the keeper's state file."""

    launch_id: str
    worker: ProcessIdentity
    keeper: ProcessIdentity
    started_at: float
    exit: ExitRecord | None = None

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["schema"] = STATE_SCHEMA
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkerState:
        if body.get("schema") != STATE_SCHEMA:
            raise ValueError(f"schema is {body.get('schema')!r}, expected {STATE_SCHEMA!r}")
        exit_body = body.get("exit")
        return cls(
            launch_id=str(body["launch_id"]),
            worker=ProcessIdentity(**body["worker"]),
            keeper=ProcessIdentity(**body["keeper"]),
            started_at=float(body["started_at"]),
            exit=ExitRecord(**exit_body) if exit_body else None,
        )


def write_state(run_dir: Path, state: WorkerState) -> None:
    path = run_dir / STATE_FILE
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state.to_json(), sort_keys=True))
    os.replace(tmp, path)


def read_state(run_dir: Path) -> WorkerState | None:
    """The state file's contents, or None when there is none (never launched here)."""
    path = run_dir / STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
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
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses; the fields after its last ')' are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


def read_oom_kills(events_file: str | None) -> int:
    """The ``oom_kill`` counter of a memory cgroup (v1 memory.oom_control, v2 memory.events)."""
    if events_file is None:
        return 0
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


def pidfd_exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited (zombie or reaped); -1 stands for gone."""
    if pidfd < 0:
        return True
    # poll(2), not select(2): a daemon holding two pidfds per worker passes fd 1024 (FD_SETSIZE)
    # at about 500 workers, and select() refuses any descriptor from there on.
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class WorkerProcess:
    """A worker the agent holds by pidfd, plus the run directory its keeper writes to.

    ``pidfd`` is -1 when the process was already gone (or its pid named a stranger) when we looked:
    then ``poll`` reports the exit the keeper recorded, and ``send_signal`` does nothing.
    """

    def __init__(self, state: WorkerState, run_dir: Path, pidfd: int, keeper_pidfd: int | None) -> None:
        self.state = state
        self.run_dir = run_dir
        self._pidfd = pidfd
        self._keeper_pidfd = keeper_pidfd
        self._exit: ExitRecord | None = None

    @property
    def pid(self) -> int:
        return self.state.worker.pid

    @property
    def identity(self) -> ProcessIdentity:
        return self.state.worker

    @property
    def exit_fd(self) -> int | None:
        """The worker's pidfd, for a loop that waits on many workers at once; None when gone."""
        return self._pidfd if self._pidfd >= 0 else None

    def send_signal(self, sig: int) -> None:
        """Signal the worker through its pidfd: never a stranger that inherited the pid."""
        if self._pidfd < 0:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, sig)

    def poll(self, now: float | None = None) -> ExitRecord | None:
        """The exit record once the worker has exited and its keeper has written it down, else None.

        If the keeper died too without writing one, the exit is recorded as ``lost``.
        """
        if self._exit is not None:
            return self._exit
        if not pidfd_exited(self._pidfd):
            return None
        # Look at the keeper before the file: a keeper that wrote the record and then exited
        # between the two looks must not make us call the exit lost.
        keeper_gone = self._keeper_pidfd is None or pidfd_exited(self._keeper_pidfd)
        state = read_state(self.run_dir)
        if state is not None and state.launch_id == self.state.launch_id and state.exit is not None:
            self._exit = state.exit
        elif keeper_gone:
            self._exit = ExitRecord.lost(time.time() if now is None else now)
        return self._exit

    def close(self) -> None:
        for fd in (self._pidfd, self._keeper_pidfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._pidfd = -1
        self._keeper_pidfd = None

    def __del__(self) -> None:
        self.close()
