"""The per-worker keeper: parent of the worker, independent of the agent (like a container monitor).

The spawner forks one keeper per launch, ahead of the request; the keeper pre-forks the worker
child, which the agent then drives directly (see spawner.py). Once the worker has exec'd, the
keeper starts its own session (so nothing aimed at the agent's process group reaches it), records
the worker's identity, then pumps the worker's stdout and stderr into rotating log files and waits for
it. When the worker exits, the keeper writes its exit status, signal and OOM verdict to the state
file, whether the agent is running or not, drains what is left of the logs and exits.

The keeper itself stays out of the slot's cgroups: killing everything in the slot must not kill
the process that records how the slot's worker ended.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import select
import signal
import time
import traceback
from pathlib import Path
from typing import NoReturn

from nodeagent.runtime.enter import FAILED_MARK, Trace, enter_slot_and_exec, prepare_child, report_failure
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


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


class _WorkerChild:
    """A worker child forked ahead of time, waiting for its launch request on ``go_r``.

    Forking (and the child's request-independent setup) before the request arrives takes them,
    and the copy-on-write faults that follow a fork, off the request's path. The request comes
    straight from the agent; the child reports a failure on ``status_w`` (read by the agent) and
    on a pipe of our own, on which it also sends the slot's OOM count once it is inside the slot.
    """

    def __init__(self, go_r: int, status_w: int, trace: Trace) -> None:
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.keeper_r, keeper_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:
            try:
                self._run(go_r, status_w, keeper_w, out_w=out_w, err_w=err_w, trace=trace)
            finally:
                os._exit(127)  # never unwind into the keeper's code
        for fd in (out_w, err_w, keeper_w):
            os.close(fd)

    @staticmethod
    def _run(go_r: int, status_w: int, keeper_w: int, *, out_w: int, err_w: int, trace: Trace) -> NoReturn:
        # It execs soon; a collection would only copy pages shared with the keeper.
        gc.disable()
        keep = (go_r, status_w, keeper_w) if trace.fd is None else (go_r, status_w, keeper_w, trace.fd)
        try:
            prepare_child(out_w, err_w, keep)
            message = _read_all(go_r)
        except BaseException as err:  # noqa: BLE001 - a forked child must never unwind into the keeper
            report_failure(f"prepare\0{0}\0{err!r}".encode("utf-8", "replace"), status_w, keeper_w)
            os._exit(127)
        if not message:  # dismissed before any request
            os._exit(0)
        try:
            req = LaunchRequest.from_json(json.loads(message))
        except BaseException as err:  # noqa: BLE001
            report_failure(f"read request\0{0}\0{err!r}".encode("utf-8", "replace"), status_w, keeper_w)
            os._exit(127)
        trace.stamp(req.launch_id, "child-woke")
        enter_slot_and_exec(req, message, status_w, keeper_w, trace)

    def outcome(self) -> tuple[int, LaunchRequest] | None:
        """Once the agent is done: the slot's OOM count before exec and the request the worker was
        started with; None when it failed or was dismissed."""
        body = _read_all(self.keeper_r)
        if not body or FAILED_MARK in body[:1]:
            return None
        count, _, message = body.partition(b"\n")
        return int(count), LaunchRequest.from_json(json.loads(message))

    def reap(self) -> None:
        os.waitpid(self.pid, 0)
        os.close(self.out_r)
        os.close(self.err_r)


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


def _announce(ready_fd: int, child: _WorkerChild) -> tuple[ProcessIdentity, ProcessIdentity]:
    """Tell the spawner who we are: the worker's identity is fixed now, before any request."""
    worker = ProcessIdentity(child.pid, _start_time(child.pid))
    keeper = ProcessIdentity(os.getpid(), _start_time(os.getpid()))
    body = {
        "pid": worker.pid,
        "start_time": worker.start_time,
        "keeper_pid": keeper.pid,
        "keeper_start_time": keeper.start_time,
    }
    os.write(ready_fd, json.dumps(body).encode())
    os.close(ready_fd)
    return worker, keeper


def run_idle_keeper(request_fd: int, go_r: int, status_w: int, ready_fd: int) -> NoReturn:
    """Body of a keeper forked ahead of time.

    Pre-forks the worker child (which reads its request from ``go_r`` and reports failures on
    ``status_w``, both driven by the agent), announces both identities on ``ready_fd``, then
    waits for EOF on ``request_fd``: the agent closes it once the launch is done, or dies. The
    child has by then handed over the request it exec'd with (or a failure, or nothing: the
    launch was dismissed). Only the child is on the request's path; the rest (session,
    directories, state file) happens here, after exec, off it. The state file does not depend on
    the agent being there.
    """
    # The spawner ignores SIGCHLD so its keepers are reaped for it; we must wait for our worker.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    trace = Trace.from_environment()
    child = _WorkerChild(go_r, status_w, trace)
    os.close(go_r)
    os.close(status_w)
    worker, keeper = _announce(ready_fd, child)
    # EOF when the agent is done with this launch (or gone): only then read what the child left,
    # so the keeper does not wake, and take a CPU, while the launch is on its way.
    _read_all(request_fd)
    try:
        outcome = child.outcome()
    except (OSError, ValueError, TypeError, KeyError):
        traceback.print_exc()
        outcome = None
    if outcome is None:
        child.reap()
        os._exit(0)
    oom_before, req = outcome
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
