"""The host keeper: one small process per state directory, the parent of every worker.

It outlives the agent (it has its own session and is nobody's child but init's once running), so
workers keep a parent that records how they end, carries their output and ends what they leave
behind while the agent restarts or is down. It is one single-threaded process that imports only
the runtime's launch path and the stdlib, freezes its start-up objects out of the garbage
collector, and holds a few descriptors and a small object per worker: no per-worker process.

What it does:

- **Launch, one hop, no Python between fork and exec on the hot path.** For a connected agent it
  forks worker children ahead of time (``arm``; with ``prepare_sandbox`` the child also builds the
  default sandbox's request-independent part while it waits: sandbox.prepare_sandbox) and hands
  the agent each idle child's request and status pipes (SCM_RIGHTS, see keeper_protocol.py). A
  launch is then the agent writing the request to the child, which joins the slot's cgroups,
  enters its netns, sets affinity, memory policy and rlimits, builds the rest of the sandbox,
  drops privileges, seals the sandbox, hands the request to the keeper on a pipe and execs
  (enter.py); the agent reads the status pipe until EOF. The keeper reads the handed-over
  request only once the agent closes the child's done pipe, so it takes no CPU mid-launch.
- **Parent and subreaper.** Workers are its children; with ``PR_SET_CHILD_SUBREAPER`` whatever
  their trees orphan is reparented to it and reaped.
- **Exit records, durably.** It reaps each worker, ends what is left of its tree (SIGTERM to what
  is left in the slot's cgroups, SIGKILL after the worker's stop grace; a slot without cgroups:
  the worker's process group), then writes the exit record to ``run/worker.json`` (fsync +
  rename) and only then closes the worker's notice pipe, which is what wakes a connected agent.
- **Output.** A worker's stdout and stderr are FIFOs in its run directory (``stdout.fifo``,
  ``stderr.fifo``) that the worker holds open read-write: with no keeper reading, its writes
  neither fail with EPIPE nor raise SIGPIPE; they fill the FIFO (1 MiB) and wait for a reader. The
  keeper copies both into one time-ordered stream (logs.py) and rotates it.
- **Finding workers again.** ``<dir>/workers/<pid>-<start time>`` links to each worker's run
  directory while the keeper has custody. A keeper that starts (after another was killed)
  re-adopts every live worker found there (a pidfd verified against the start time, the FIFOs
  reopened by path); one that ended unwatched is recorded ``lost``, after its tree is ended too.

What survives what: an agent restart or crash touches nothing here (the agent reconnects). A keeper
death leaves workers running: they are reparented to init, their FIFOs keep what they write, and
the agent starts a new keeper, which re-adopts them; it sees when each ends (pidfd) but, no longer
their parent, not how (``unknown``). SIGTERM makes the keeper copy what the FIFOs hold, end the
trees of workers it is finishing, record them, and exit, leaving running workers to the next one.

Files in ``<dir>`` (0700): ``keeper.sock`` (the agent connects here), ``keeper.lock`` (flock held
for the keeper's life, so two never run; holds "pid start_time"), ``keeper.log`` (its own
diagnostics), ``io/`` (FIFOs of idle children), ``workers/`` (the custody links).

    python -m nodeagent.runtime.keeper DIR      (the agent starts it; see keeper_client.py)
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import heapq
import itertools
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from nodeagent.libc import libc
from nodeagent.runtime import keeper_protocol as proto
from nodeagent.runtime import sandbox
from nodeagent.runtime.custody import INDEX_DIR, IO_DIR, READ_SIZE, KeptWorker, WorkerCustody, log, unlink
from nodeagent.runtime.enter import FAILED_MARK, Trace, enter_slot_and_exec, prepare_child, report_failure
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.logs import LogStream
from nodeagent.runtime.process import (
    Custody,
    ProcessIdentity,
    WorkerState,
    process_start_time,
)

PR_SET_CHILD_SUBREAPER = 36
#: Capacity of a worker's stdout/stderr FIFO: what a worker may write while no keeper reads
#: before its writes wait. Pages are allocated only while data sits there.
FIFO_BYTES = 1 << 20
#: Workers per status reply (each takes a few hundred bytes of a message's 64 KiB).
STATUS_PAGE = 100

_libc = libc  # the process's one handle (nodeagent/libc.py)


def _close(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def _read_available(fd: int) -> tuple[bytes, bool]:
    """What a non-blocking descriptor holds now, and whether it reached EOF."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return data, False
        if not chunk:
            return data, True
        data += chunk


class _Child:
    """A worker child forked ahead of time, until the agent is done with it."""

    __slots__ = (
        "done_r",
        "err_fifo",
        "err_r",
        "handoff",
        "handoff_r",
        "identity",
        "notice",
        "out_fifo",
        "out_r",
        "status",
    )

    def __init__(self, identity: ProcessIdentity) -> None:
        self.identity = identity
        self.done_r = self.handoff_r = self.out_r = self.err_r = self.notice = -1
        self.out_fifo = self.err_fifo = ""
        self.handoff = b""
        #: Its wait status, once reaped (it may exit before the keeper has read its hand-over).
        self.status: int | None = None


class Keeper(WorkerCustody):
    """The keeper's state and event loop (one thread; every descriptor non-blocking or one-shot)."""

    def __init__(self, directory: Path, listener: socket.socket, open_files: tuple[int, int]) -> None:
        self.dir = directory
        self.identity = ProcessIdentity(os.getpid(), process_start_time(os.getpid()) or 0)
        self._listener = listener
        self._open_files = open_files
        self._trace = Trace.from_environment()
        self._epoll = select.epoll()
        self._handlers: dict[int, Callable[[], None]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._fifo_names = itertools.count()
        self._children: dict[int, _Child] = {}  # pid -> idle or launching child
        self._workers: dict[ProcessIdentity, KeptWorker] = {}
        self._child_workers: dict[int, KeptWorker] = {}  # pid -> worker that is our child
        self._connections: dict[int, tuple[socket.socket, bool]] = {}  # fd -> (socket, said hello)
        #: log dir -> (its stream, or None when it cannot be written; workers using it)
        self._logs: dict[str, tuple[LogStream | None, int]] = {}
        self._stopping = False
        (directory / IO_DIR).mkdir(mode=0o700, exist_ok=True)
        (directory / INDEX_DIR).mkdir(mode=0o700, exist_ok=True)
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a handler, so the wake-up pipe hears it
        signal.signal(signal.SIGTERM, self._on_sigterm)
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        self._watch(self._wake_r, self._reap)
        listener.setblocking(False)
        self._watch(listener.fileno(), self._accept)

    # ------------------------------------------------------------------ the loop

    def _watch(self, fd: int, handler: Callable[[], None]) -> None:
        self._handlers[fd] = handler
        self._epoll.register(fd, select.EPOLLIN)

    def _unwatch(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def _after(self, seconds: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + seconds, next(self._order), action))

    def run(self) -> None:
        adopted = self._adopt_all()
        self._clean_io()
        log(f"started for {self.dir}; re-adopted {adopted} worker(s)")
        gc.freeze()  # start-up objects are never collected: a collection would touch shared pages
        while not self._stopping:
            timeout = -1.0
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            for fd, _ in self._epoll.poll(timeout):
                handler = self._handlers.get(fd)
                if handler is not None:
                    self._guarded(handler)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._guarded(heapq.heappop(self._timers)[2])
        self._shutdown()

    @staticmethod
    def _guarded(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:  # noqa: BLE001 - the keeper must survive any one bad event: every worker depends on it
            log("error handling an event:\n" + traceback.format_exc())

    def _on_sigterm(self, _sig: int, _frame: object) -> None:
        self._stopping = True

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        uid = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)[4:8]
        if int.from_bytes(uid, sys.byteorder) not in (0, os.geteuid()):
            conn.close()  # only root or our own user may drive workers
            return
        conn.setblocking(False)
        self._connections[conn.fileno()] = (conn, False)
        fd = conn.fileno()
        self._watch(fd, lambda: self._serve(fd))

    def _drop(self, fd: int) -> None:
        self._unwatch(fd)
        conn, _ = self._connections.pop(fd)
        conn.close()

    def _reply(self, fd: int, body: dict[str, object], fds: list[int] | None = None) -> bool:
        try:
            proto.send(self._connections[fd][0], body, fds or (), socket.MSG_DONTWAIT)
        except OSError:
            # An agent that does not read (or is gone) is dropped rather than allowed to stall
            # the loop; the children it had are dismissed when their descriptors close.
            self._drop(fd)
            return False
        return True

    def _serve(self, fd: int) -> None:
        conn, greeted = self._connections[fd]
        try:
            body, fds = proto.receive(conn, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except (OSError, proto.ProtocolError) as err:
            log(f"dropping a connection: {err}")
            self._drop(fd)
            return
        for extra in fds:
            os.close(extra)  # agents send no descriptors
        if body is None:
            self._drop(fd)
            return
        op = body["op"]
        try:
            if not greeted:
                self._hello(fd, conn, body)
            elif op == "arm":
                self._arm(
                    fd,
                    pid_namespace=body.get("pid_namespace") is True,
                    prepare_sandbox=body.get("prepare_sandbox") is True,
                )
            elif op == "watch":
                self._watch_request(fd, body)
            elif op == "status":
                offset = body.get("offset", 0)
                self._reply(fd, self._status(offset if isinstance(offset, int) else 0))
            else:
                self._reply(fd, {"op": "error", "request": op, "message": f"unknown request {op!r}"})
        except OSError as err:
            log(f"{op} failed: {err}")
            if fd in self._connections:
                self._reply(
                    fd, {"op": "error", "request": op, "message": f"the keeper could not {op}: {err}"}
                )

    def _hello(self, fd: int, conn: socket.socket, body: dict[str, object]) -> None:
        if body["op"] != "hello" or body.get("protocol") != proto.PROTOCOL:
            message = (
                f"this keeper (pid {self.identity.pid}, for {self.dir}) speaks protocol "
                f"{proto.PROTOCOL} and was sent {body['op']!r} with protocol {body.get('protocol')!r}"
            )
            self._reply(
                fd,
                {
                    "op": "error",
                    "request": "hello",
                    "message": message,
                    "protocol": proto.PROTOCOL,
                    "pid": self.identity.pid,
                },
            )
            if fd in self._connections:
                self._drop(fd)
            return
        self._connections[fd] = (conn, True)
        self._reply(
            fd,
            {
                "op": "welcome",
                "protocol": proto.PROTOCOL,
                "pid": self.identity.pid,
                "start_time": self.identity.start_time,
            },
        )

    def _status(self, offset: int) -> dict[str, object]:
        """One page of the keeper's account (a message has room for about a hundred workers)."""
        page = sorted(self._workers.values(), key=lambda w: w.identity.pid)[offset : offset + STATUS_PAGE]
        workers = [
            {
                "pid": w.identity.pid,
                "start_time": w.identity.start_time,
                "launch_id": w.launch_id,
                "run_dir": str(w.run_dir),
                "child": w.is_child,
                "finishing": w.finishing,
                "final": w.final,
            }
            for w in page
        ]
        return {
            "op": "status",
            "protocol": proto.PROTOCOL,
            "pid": self.identity.pid,
            "start_time": self.identity.start_time,
            "workers": workers,
            "total": len(self._workers),
            "idle_children": [c.identity.pid for c in self._children.values()],
        }

    # ------------------------------------------------------------------ arming a worker child

    def _arm(self, fd: int, *, pid_namespace: bool = False, prepare_sandbox: bool = False) -> None:
        """Fork a worker child ahead of its request; with ``pid_namespace`` the child is PID 1 of a
        new pid namespace (a root worker's: runtime/sandbox/pidns.py), armed when asked for; with
        ``prepare_sandbox`` it builds the request-independent part of the default sandbox while it
        waits (sandbox.prepare_sandbox), for a request whose spec fits it."""
        base = self.dir / IO_DIR / f"{self.identity.pid}-{next(self._fifo_names)}"
        out_fifo, err_fifo = f"{base}.out", f"{base}.err"
        opened: list[int] = []
        try:
            for path in (out_fifo, err_fifo):
                os.mkfifo(path, 0o600)
            # The keeper's read ends first (opening for reading never waits when non-blocking); the
            # read-write ends become the child's stdout and stderr.
            for path in (out_fifo, err_fifo):
                opened.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
                with contextlib.suppress(OSError):  # not allowed a large pipe: the default 64 KiB
                    fcntl.fcntl(opened[-1], fcntl.F_SETPIPE_SZ, FIFO_BYTES)
            for path in (out_fifo, err_fifo):
                opened.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            for _ in range(5):  # request, status, hand-over, done, notice
                opened.extend(os.pipe2(os.O_CLOEXEC))
        except OSError:
            for end in opened:
                os.close(end)
            for path in (out_fifo, err_fifo):
                unlink(path)
            raise
        out_r, err_r, out_w, err_w, go_r, go_w, status_r, status_w, handoff_r, handoff_w = opened[:10]
        done_r, done_w, notice_r, notice_w = opened[10:]
        pid = sandbox.fork_into_new_pid_namespace() if pid_namespace else os.fork()
        if pid == 0:
            # A root worker's spec (read-only root, init) never fits a prepared sandbox.
            prepare = prepare_sandbox and not pid_namespace
            self._child_body(go_r, status_w, handoff_w, out_w, err_w, prepare=prepare)
        for end in (go_r, status_w, handoff_w, out_w, err_w):
            os.close(end)
        child = _Child(ProcessIdentity(pid, process_start_time(pid) or 0))
        child.out_fifo, child.err_fifo, child.out_r, child.err_r = out_fifo, err_fifo, out_r, err_r
        child.handoff_r, child.done_r = handoff_r, done_r
        child.notice = notice_w
        os.set_blocking(handoff_r, False)
        os.set_blocking(done_r, False)
        self._children[pid] = child
        self._watch(done_r, lambda: self._on_done(child))
        pidfd = os.pidfd_open(pid)
        try:
            self._reply(
                fd,
                {
                    "op": "armed",
                    "pid": pid,
                    "start_time": child.identity.start_time,
                    "pid_namespace": pid_namespace,
                },
                [go_w, status_r, done_w, notice_r, pidfd],
            )
        finally:
            # Only the agent holds these now: its closing them is what the child and we wait for.
            for end in (go_w, status_r, done_w, notice_r, pidfd):
                os.close(end)

    def _child_body(
        self, go_r: int, status_w: int, handoff_w: int, out_w: int, err_w: int, *, prepare: bool
    ) -> NoReturn:
        """The forked child: prepare (its process state, and the part of the default sandbox that
        no request changes), wait for the request, enter the slot and exec (enter.py)."""
        try:
            gc.disable()  # it execs soon; a collection would only copy pages shared with the keeper
            keep = [go_r, status_w, handoff_w] + ([self._trace.fd] if self._trace.fd is not None else [])
            prepared = None
            try:
                prepare_child(out_w, err_w, keep, self._open_files)
                if prepare:
                    prepared = sandbox.prepare_sandbox()
                message = b""
                while chunk := os.read(go_r, 65536):
                    message += chunk
            except BaseException as err:  # noqa: BLE001 - a forked child must never unwind into the keeper
                report_failure(f"prepare\0{0}\0{err!r}".encode("utf-8", "replace"), status_w, handoff_w)
                os._exit(127)
            if not message:
                os._exit(0)  # dismissed before any request
            try:
                req = LaunchRequest.from_json(json.loads(message))
            except BaseException as err:  # noqa: BLE001
                report_failure(f"read request\0{0}\0{err!r}".encode("utf-8", "replace"), status_w, handoff_w)
                os._exit(127)
            self._trace.stamp(req.launch_id, "child-woke")
            enter_slot_and_exec(req, message, status_w, handoff_w, trace=self._trace, prepared=prepared)
        finally:
            os._exit(127)

    def _on_done(self, child: _Child) -> None:
        """The agent closed the child's done pipe (launch over, child dropped, or agent gone)."""
        _, eof = _read_available(child.done_r)
        if not eof:
            return
        self._unwatch(child.done_r)
        os.close(child.done_r)
        child.done_r = -1
        # What the child handed over is complete at EOF: at exec (close-on-exec) or at its exit.
        self._watch(child.handoff_r, lambda: self._on_handoff(child))
        self._on_handoff(child)

    def _on_handoff(self, child: _Child) -> None:
        data, eof = _read_available(child.handoff_r)
        child.handoff += data
        if not eof:
            return
        self._unwatch(child.handoff_r)
        os.close(child.handoff_r)
        child.handoff_r = -1
        body = child.handoff
        request: tuple[int, LaunchRequest] | None = None
        if body and not body.startswith(FAILED_MARK):
            count, _, message = body.partition(b"\n")
            try:
                request = int(count), LaunchRequest.from_json(json.loads(message))
            except (ValueError, TypeError, KeyError) as err:
                log(f"child {child.identity.pid} handed over a request that cannot be read: {err!r}")
        if request is None:
            self._dismiss(child)  # dropped unused, or its launch failed (the agent has the report)
        else:
            self._take_custody(child, *request)

    def _dismiss(self, child: _Child) -> None:
        for end in (child.out_r, child.err_r, child.notice):
            _close(end)
        for path in (child.out_fifo, child.err_fifo):
            unlink(path)
        child.out_r = child.err_r = child.notice = -1
        if child.status is not None:
            self._children.pop(child.identity.pid, None)
        # else: reaped later; _reap forgets it then

    # ------------------------------------------------------------------ custody

    def _take_custody(self, child: _Child, oom_before: int, req: LaunchRequest) -> None:
        run_dir, log_dir = Path(req.run_dir), Path(req.log_dir)
        for directory in (run_dir, log_dir):
            try:
                directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as err:
                log(f"cannot create {directory} for worker {child.identity.pid}: {err}")
        fifos = []
        for path, name in ((child.out_fifo, "stdout.fifo"), (child.err_fifo, "stderr.fifo")):
            try:
                os.replace(path, run_dir / name)  # beside worker.json: found again with it
                fifos.append(str(run_dir / name))
            except OSError:
                fifos.append(path)  # another filesystem: it stays where it is, named in custody
        custody = Custody(
            stdout_fifo=fifos[0],
            stderr_fifo=fifos[1],
            log_dir=str(log_dir),
            log_max_bytes=req.log_max_bytes,
            log_backups=req.log_backups,
            log_reserve_bytes=req.log_reserve_bytes,
            # A probe's tree is its process group: its slot's cgroups hold its worker too.
            cgroup_procs=req.cgroup_procs if req.end_slot_on_exit else (),
            stop_grace_seconds=req.stop_grace_seconds,
            oom_events=req.oom_events,
            oom_before=oom_before,
        )
        state = WorkerState(req.launch_id, child.identity, self.identity, time.time(), None, custody)
        # The agent has held the notice pipe's read end since it armed the child.
        worker = KeptWorker(state, run_dir, is_child=True, notices=[child.notice])
        self._children.pop(child.identity.pid, None)
        self._workers[worker.identity] = worker
        self._attach_output(worker, {child.out_r: "stdout", child.err_r: "stderr"})
        if child.status is not None:
            self._main_exited(worker, child.status)  # /bin/true: gone before we got here
            return
        self._child_workers[worker.identity.pid] = worker
        self._link(worker)
        self._record(worker)

    # ------------------------------------------------------------------ exits

    def _reap(self) -> None:
        _read_available(self._wake_r)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if (child := self._children.get(pid)) is not None:
                child.status = status
                if child.done_r < 0 and child.handoff_r < 0:
                    self._children.pop(pid)  # dismissed or failed, and now reaped
            elif (worker := self._child_workers.pop(pid, None)) is not None:
                self._main_exited(worker, status)
            # else: an orphan of some worker's tree, reparented to us (subreaper): reaped, no record

    def _watch_request(self, fd: int, body: dict[str, object]) -> None:
        run_dir, launch_id = Path(os.path.realpath(str(body.get("run_dir")))), str(body.get("launch_id"))
        worker = next(
            (w for w in self._workers.values() if w.launch_id == launch_id and w.run_dir == run_dir),
            None,
        ) or self._adopt(run_dir, launch_id=launch_id)
        if worker is None or worker.final:
            self._reply(fd, {"op": "final"})
            return
        notice_r, notice_w = os.pipe2(os.O_CLOEXEC)
        worker.notices = [end for end in worker.notices if _has_reader(end)]
        worker.notices.append(notice_w)
        try:
            self._reply(
                fd,
                {"op": "watching", "pid": worker.identity.pid, "start_time": worker.identity.start_time},
                [notice_r],
            )
        finally:
            os.close(notice_r)

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        """SIGTERM: copy what the FIFOs hold, finish the workers already ending, leave the rest
        running for the next keeper (their custody links stay)."""
        self._listener.close()
        unlink(str(self.dir / proto.SOCKET_NAME))
        for worker in list(self._workers.values()):
            if worker.finishing:
                self._signal(self._tree(worker), signal.SIGKILL)
                self._finalize(worker)
            for end in list(worker.streams):
                data, _ = _read_available(end)
                if data:
                    self._pump_data(worker, end, data)
        for stream, _ in self._logs.values():
            if stream is not None:
                stream.close()
        log(f"stopped on SIGTERM; {sum(not w.final for w in self._workers.values())} worker(s) left running")


def _has_reader(write_end: int) -> bool:
    """Whether anyone still holds the read end of a notice pipe (an agent that went away does not);
    the write end of a pipe without readers polls POLLERR. Closes the write end when not."""
    poller = select.poll()
    poller.register(write_end, 0)
    if any(event & select.POLLERR for _, event in poller.poll(0)):
        os.close(write_end)
        return False
    return True


def _bind(directory: Path) -> socket.socket:
    path = directory / proto.SOCKET_NAME
    unlink(str(path))  # a dead keeper's: we hold the lock, so no live keeper uses it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def main(argv: list[str]) -> int:
    """Take the lock, listen, then fork the keeper proper and exit: the agent that started us
    reaps this process, and the keeper is left with init (or the unit's subreaper) as parent."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m nodeagent.runtime.keeper STATE_DIR/keeper\n")
        return 2
    directory = Path(argv[0]).absolute()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(directory / proto.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.stderr.write(f"another keeper holds {directory / proto.LOCK_NAME}; using that one\n")
        return proto.EXIT_ALREADY_RUNNING
    listener = _bind(directory)
    if os.fork() != 0:
        os._exit(0)
    # The keeper proper: the lock is held through the descriptor we inherited.
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log(f"cannot become a child subreaper (errno {ctypes.get_errno()}); orphans go to init")
    identity = f"{os.getpid()} {process_start_time(os.getpid())}\n".encode()
    os.ftruncate(lock, 0)
    os.pwrite(lock, identity, 0)
    # Hold every worker's descriptors; children get the original limit back before exec.
    open_files = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files[1], open_files[1]))
    sandbox.warm_up()  # cap_last_cap and the default seccomp filter, once, shared by every child
    keeper = Keeper(directory, listener, open_files)
    keeper.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
