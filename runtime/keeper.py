"""The per-worker keeper: parent of the worker, independent of the agent (like a container monitor).

The spawner forks one keeper per launch. The keeper starts its own session (so nothing aimed at the
agent's process group reaches it), forks the worker through ``enter_slot_and_exec``, records the
worker's identity, then pumps the worker's stdout and stderr into rotating log files and waits for
it. When the worker exits, the keeper writes its exit status, signal and OOM verdict to the state
file, whether the agent is running or not, drains what is left of the logs and exits.

The keeper itself stays out of the slot's cgroups: killing everything in the slot must not kill
the process that records how the slot's worker ended.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import time
import traceback
from pathlib import Path
from typing import NoReturn

from nodeagent.runtime.enter import enter_slot_and_exec
from nodeagent.runtime.logs import RotatingLog, log_path
from nodeagent.runtime.process import ExitRecord, ProcessIdentity, WorkerState, read_oom_kills, write_state
from nodeagent.runtime.request import LaunchRequest

#: After the worker exits, how long to keep pumping output that helpers or buffers still deliver.
DRAIN_SECONDS = 2.0
_READ_SIZE = 64 * 1024


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        text = handle.read()
    return int(text[text.rindex(")") + 2 :].split()[19])


def _report(fd: int, body: dict[str, object]) -> None:
    os.write(fd, json.dumps(body).encode())
    os.close(fd)


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


class _WorkerChild:
    """A worker child forked ahead of time, waiting for its launch request on a pipe.

    Forking before the request arrives takes the fork, and the copy-on-write faults that follow
    it, off the request's path.
    """

    def __init__(self) -> None:
        go_r, self.go_w = os.pipe2(os.O_CLOEXEC)
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.status_r, status_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (self.go_w, self.out_r, self.err_r, self.status_r):
                os.close(fd)
            message = _read_all(go_r)
            if not message:
                os._exit(0)
            enter_slot_and_exec(LaunchRequest.from_json(json.loads(message)), out_w, err_w, status_w)
        for fd in (go_r, out_w, err_w, status_w):
            os.close(fd)

    def go(self, message: bytes) -> None:
        """Send the request; returns once the worker has exec'd, or raises RuntimeError."""
        os.write(self.go_w, message)
        os.close(self.go_w)
        failure = _read_all(self.status_r)
        if failure:
            os.waitpid(self.pid, 0)
            os.close(self.out_r)
            os.close(self.err_r)
            step, errno_, text = [*failure.decode("utf-8", "replace").split("\0"), "", ""][:3]
            raise RuntimeError(f"{step}: {text} (errno {errno_})")

    def cancel(self) -> None:
        os.close(self.go_w)
        os.waitpid(self.pid, 0)


def _record_exit(req: LaunchRequest, state: WorkerState, status: int, oom_before: int) -> None:
    oom_kills = read_oom_kills(req.oom_events) - oom_before
    record = ExitRecord.from_wait_status(status, oom_kills=oom_kills, finished_at=time.time())
    write_state(Path(req.run_dir), dataclasses.replace(state, exit=record))


def _detach_stdio(run_dir: Path) -> None:
    """Let go of the agent's stdio (a pipe held open would keep whoever reads it waiting)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    diagnostics = os.open(run_dir / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.dup2(diagnostics, 2)
    os.close(devnull)
    os.close(diagnostics)


def _pump(req: LaunchRequest, state: WorkerState, *, out_r: int, err_r: int, oom_before: int) -> None:
    pid = state.worker.pid
    log_dir = Path(req.log_dir)
    sinks = {
        out_r: RotatingLog(log_path(log_dir, "stdout"), req.log_max_bytes, req.log_backups),
        err_r: RotatingLog(log_path(log_dir, "stderr"), req.log_max_bytes, req.log_backups),
    }
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (*sinks, pidfd):
        poller.register(fd, select.POLLIN)
    open_streams = set(sinks)
    drain_deadline: float | None = None
    while open_streams:
        timeout_ms = None
        if drain_deadline is not None:
            timeout_ms = max(0, int((drain_deadline - time.monotonic()) * 1000))
            if timeout_ms == 0:
                break
        for fd, _ in poller.poll(timeout_ms):
            if fd == pidfd:
                poller.unregister(pidfd)
                _, status = os.waitpid(pid, 0)
                _record_exit(req, state, status, oom_before)
                drain_deadline = time.monotonic() + DRAIN_SECONDS
                continue
            data = os.read(fd, _READ_SIZE)
            if data:
                sinks[fd].write(data)
            else:
                poller.unregister(fd)
                open_streams.discard(fd)
    if drain_deadline is None:
        # Both streams closed (the worker closed them itself); still wait to record its exit.
        _, status = os.waitpid(pid, 0)
        _record_exit(req, state, status, oom_before)
    for sink in sinks.values():
        sink.close()


def run_idle_keeper(request_fd: int, report_fd: int) -> NoReturn:
    """Body of a keeper forked ahead of time: pre-forks its worker child, then waits for a request.

    Reports ``{pid, start_time, ...}`` or ``{error}`` on ``report_fd``. Only what the launch needs
    happens before the report (entering the slot, exec); the rest (session, directories, state
    file) follows it, off the agent's request path. The state file does not depend on the agent
    being there to receive the report.
    """
    # The spawner ignores SIGCHLD so its keepers are reaped for it; we must wait for our worker.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    child = _WorkerChild()
    message = _read_all(request_fd)
    if not message:  # the spawner is shutting down
        child.cancel()
        os._exit(0)
    try:
        req = LaunchRequest.from_json(json.loads(message))
        oom_before = read_oom_kills(req.oom_events)
        child.go(message)
        worker = ProcessIdentity(child.pid, _start_time(child.pid))
        keeper = ProcessIdentity(os.getpid(), _start_time(os.getpid()))
    except (OSError, RuntimeError, ValueError, TypeError) as err:
        _report(report_fd, {"error": str(err)})
        os._exit(1)
    _report(
        report_fd,
        {
            "launch_id": req.launch_id,
            "pid": worker.pid,
            "start_time": worker.start_time,
            "keeper_pid": keeper.pid,
            "keeper_start_time": keeper.start_time,
        },
    )
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        run_dir = Path(req.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        Path(req.log_dir).mkdir(parents=True, exist_ok=True)
        _detach_stdio(run_dir)
        state = WorkerState(launch_id=req.launch_id, worker=worker, keeper=keeper, started_at=time.time())
        write_state(run_dir, state)
        _pump(req, state, out_r=child.out_r, err_r=child.err_r, oom_before=oom_before)
    except BaseException:  # noqa: BLE001 - report, then leave without unwinding into the spawner's code
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
