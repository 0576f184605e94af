"""The agent's side of the host keeper (keeper.py): find it or start it, launch through it, re-attach.

::

    agent ──unix socket <dir>/keeper.sock──> keeper ──fork (ahead of time)──> child (waits)
    agent ══request pipe══> child ──join slot, hand the request to the keeper, exec──> worker
    agent <══status pipe (EOF at exec)══ child;  agent closes the done pipe: the keeper takes custody
    agent <══notice pipe (EOF once the exit record is final, or the keeper died)══ keeper

:class:`KeeperClient` connects to the keeper of a state directory, starting one when none runs
(``python -m nodeagent.runtime.keeper DIR``, which double-forks, so the keeper is never the agent's
child; a lock in the directory keeps a second one from starting). It keeps ``idle_children``
armed children in hand, so a launch is one write, one read to EOF and one close: no fork, no
round trip through the keeper. After ``rest_after`` seconds without a launch it keeps one child,
of the kind the last launch took (a child prepared for the sandbox is ~4.6 MB of PSS, a plain one
~3.6 MB: at rest the others are the agent's footprint, issue 23 item 7), and fills up again from
the next launch: one of that kind still finds its child in hand, one of another kind pays a fork,
as the first launch of a kind does. It is the supervisor's Launcher (:meth:`launch` returns a
:class:`WorkerProcess`) and the handles' Watcher (:meth:`watch`).

Keeper deaths: a thread waits on the keeper's pidfd; when the keeper dies it drops the armed
children it held (they exit when their request pipe closes) and starts a new keeper, which
re-adopts every live worker. Each worker's notice pipe fires at the same moment; its handle then
asks :meth:`watch` for the new keeper's notice (worker.py's supervision loop is woken by that).
A launch finds a dead keeper too (its pidfd), before it takes a child.

Thread-safe: one exchange with the keeper at a time.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nodeagent.cgroups.delegation import KEEPER, ProcessPlacement
from nodeagent.errors import WorkerError
from nodeagent.runtime import keeper_protocol as proto
from nodeagent.runtime.enter import Trace
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.process import (
    ProcessIdentity,
    WorkerProcess,
    WorkerState,
    fd_fired,
    open_verified_pidfd,
)
from nodeagent.runtime.sandbox import fits_prepared

log = logging.getLogger("nodeagent.keeper")

#: What a pipe holds at most without raising fs.pipe-max-size (the child passes the request on
#: to the keeper in one write).
MAX_REQUEST_BYTES = (1 << 20) - 64
#: How long the keeper may take to answer a request (it may be busy writing state files).
REPLY_TIMEOUT = 30.0
#: How long starting a keeper (and connecting to it) may take.
START_TIMEOUT = 30.0
_GONE_TIMEOUT = 5.0
#: Restarting a keeper that keeps failing to start: first retry after this, doubling to the max.
_RETRY_FIRST, _RETRY_MAX = 0.5, 30.0
#: How long without a launch before the idle children are cut to one, of the last launch's kind.
_REST_AFTER = 30.0
#: The failure a child reports when the keeper died before the launch handed its request over.
_KEEPER_LOST_STEP = b"hand the request to the keeper\0"
#: Variables of the agent's own service manager that the keeper must not inherit.
_NOT_INHERITED = (
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
)


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _describe_failure(report: bytes) -> str:
    step, errno_, text = [*report.decode("utf-8", "replace").split("\0"), "", ""][:3]
    return f"{step}: {text} (errno {errno_})"


class _Armed:
    """An idle worker child as the agent holds it: its pipes' ends, its pidfd and its identity."""

    def __init__(self, identity: ProcessIdentity, fds: list[int]) -> None:
        self.identity = identity
        self.go, self.status, self.done, self.notice, self.pidfd = fds

    def fire(self, message: bytes) -> bytes:
        """Send the request to the child; returns its failure report, empty once it has exec'd."""
        try:
            _write_all(self.go, message)
            delivered = True
        except BrokenPipeError:
            delivered = False  # the child died before reading; its status pipe says why, if it could
        self._close("go")
        report = _read_all(self.status)
        self._close("status")
        self._close("done")  # the keeper reads what the child handed over now, not mid-launch
        if not report and not delivered:
            return b"start worker child\x000\x00the pre-forked child exited before its request"
        return report

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            setattr(self, name, -1)
            os.close(fd)

    def close(self) -> None:
        """Drop the child: it reads EOF instead of a request and exits."""
        for name in ("go", "status", "done", "notice", "pidfd"):
            self._close(name)


def _wait_gone(pidfd: int, timeout: float = _GONE_TIMEOUT) -> bool:
    """Wait until a failed child has left its slot: EOF on its status pipe comes when it closes its
    files, a little before it leaves its cgroups; its pidfd turns readable after that."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


#: The kinds of idle child the keeper arms: one that waits with nothing built yet; one that built
#: the request-independent part of the default sandbox while it waited (sandbox.Prepared); one that
#: is PID 1 of a new pid namespace (a root worker's sandbox: rare, so armed when asked).
PLAIN, PREPARED, PID_NAMESPACE = "plain", "prepared", "pid namespace"


def child_kind(req: LaunchRequest) -> str:
    """The kind of child ``req`` takes. An exec probe joins its worker's namespaces, and a sandbox
    other than the default shape is built from scratch: a prepared child would have to leave its
    namespaces first, which costs more than building them."""
    if req.sandbox is None or req.join is not None:
        return PLAIN
    if "pid" in req.sandbox.namespaces:
        return PID_NAMESPACE
    return PREPARED if fits_prepared(req.sandbox) else PLAIN


def keeper_identity(directory: Path) -> ProcessIdentity | None:
    """The keeper last started for ``directory`` (from its lock file), alive or not."""
    try:
        pid, start_time = (directory / proto.LOCK_NAME).read_text().split()
        return ProcessIdentity(int(pid), int(start_time))
    except (OSError, ValueError):
        return None


def stop_keeper(directory: Path, timeout: float = 10.0) -> ProcessIdentity | None:
    """SIGTERM the keeper of ``directory`` and wait for it (SIGKILL after ``timeout``); its workers
    keep running. Returns the keeper stopped, None when none ran. For tests, benchmarks and
    uninstalling; the agent never stops its keeper."""
    identity = keeper_identity(directory)
    pidfd = None if identity is None else open_verified_pidfd(identity)
    if pidfd is None:
        return None
    if fd_fired(pidfd):  # it ended already (a zombie its parent has not reaped yet): none runs
        os.close(pidfd)
        return None
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, sig)
            if _wait_gone(pidfd, timeout):
                break
    finally:
        os.close(pidfd)
    return identity


class _Vanished(Exception):
    """The connection ended before the keeper answered: nobody is there to answer."""


class KeeperClient:
    """The agent's connection to the keeper of ``directory`` (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        python: str = sys.executable,
        idle_children: int = 2,
        placement: ProcessPlacement | None = None,
        rest_after: float = _REST_AFTER,
    ) -> None:
        """``idle_children``: how many armed children wait in hand; two absorb a launch that
        follows another before the keeper has forked the next one. ``placement``: where the keeper
        (and through it every worker until it joins its slot) starts: under systemd, the delegated
        cgroup's ``keeper/`` leaf, outside the agent's unit, so that stopping the agent's unit never
        takes the keeper with it; without one it starts in the agent's cgroup. ``rest_after``: seconds
        without a launch after which one child, of the kind the last launch took, is kept in hand
        instead."""
        self.directory = directory
        self._python = python
        self._placement = placement
        self._idle_children = max(1, idle_children)
        self._rest_after = rest_after
        self._last_launch = time.monotonic()
        #: Resting: one child kept in hand, of ``_last_kind`` (no launch for ``rest_after`` seconds).
        self._resting = False
        #: The kind the last launch took: the one a host's next launch most likely asks for (a
        #: sandboxed host's are all prepared; exec probes come often enough to keep it from resting).
        self._last_kind = PLAIN
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._keeper: ProcessIdentity | None = None
        self._keeper_pidfd = -1
        #: Armed children in hand and arm requests outstanding, by kind (PLAIN, PREPARED, ...).
        self._armed: dict[str, collections.deque[_Armed]] = {
            kind: collections.deque() for kind in (PLAIN, PREPARED, PID_NAMESPACE)
        }
        self._pending = dict.fromkeys(self._armed, 0)
        #: Kinds kept at ``idle_children`` in hand: plain from the start, prepared once a launch
        #: took one (a host whose workers are sandboxed from then on; the first pays a fork).
        self._kept = [PLAIN]
        #: The kind each arm request outstanding asked for, oldest first.
        self._arm_order: collections.deque[str] = collections.deque()
        self._arm_error = ""
        self._trace = Trace(None)
        self._closed = False
        self._retry_at = 0.0
        self._retry_delay = _RETRY_FIRST
        self._last_failure = ""
        self._wake_fd = -1
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    @property
    def keeper(self) -> ProcessIdentity | None:
        """The keeper connected now, if any."""
        return self._keeper

    def connect(self) -> ProcessIdentity:
        """Connect to the keeper, starting one when none runs. Raises WorkerError."""
        with self._lock:
            self._ensure()
            assert self._keeper is not None
            return self._keeper

    def close(self) -> None:
        """Drop the armed children and the connection; the keeper and its workers run on."""
        with self._lock:
            self._closed = True
            self._disconnect()
            if self._trace.fd is not None:
                os.close(self._trace.fd)
                self._trace = Trace(None)
        if self._thread is not None:
            os.eventfd_write(self._wake_fd, 1)
            self._thread.join(timeout=10)
            self._thread = None
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1

    def __enter__(self) -> KeeperClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what the runtime uses

    def launch(self, req: LaunchRequest) -> WorkerProcess:
        """Launch a worker; returns once it has exec'd inside its slot. Raises WorkerError."""
        self._trace.stamp(req.launch_id, "agent-request")
        message = json.dumps(req.to_json()).encode()
        if len(message) > MAX_REQUEST_BYTES:
            raise WorkerError(
                f"the launch request for {req.launch_id} is {len(message)} bytes, over {MAX_REQUEST_BYTES}; "
                "shrink the worker's environment or arguments"
            )
        for attempt in (1, 2):
            with self._lock:
                self._last_launch = time.monotonic()
                if self._resting:
                    self._resting = False  # the refill below arms up to idle_children again
                    if self._wake_fd >= 0:
                        os.eventfd_write(self._wake_fd, 1)  # the rest timer starts again
                self._last_kind = child_kind(req)
                armed = self._take_armed(self._last_kind)
                keeper = self._keeper
                try:
                    self._trace.stamp(req.launch_id, "agent-send")
                    report = armed.fire(message)
                except OSError as err:
                    armed.close()
                    raise WorkerError(f"cannot launch {list(req.argv)} for {req.launch_id}: {err}") from err
                finally:
                    self._request_arms()
            self._trace.stamp(req.launch_id, "agent-done")
            if not report:
                break
            _wait_gone(armed.pidfd)
            armed.close()
            with self._lock:
                keeper_died = not self._keeper_alive()
            if attempt == 1 and report.startswith(_KEEPER_LOST_STEP) and keeper_died:
                continue  # the keeper died under this launch; nothing ran: once more, with a new one
            raise WorkerError(
                f"cannot launch {list(req.argv)} for {req.launch_id}: {_describe_failure(report)}"
            )
        assert keeper is not None
        state = WorkerState(req.launch_id, armed.identity, keeper, time.time())
        return WorkerProcess(state, Path(req.run_dir), armed.pidfd, armed.notice, self)

    def watch(self, run_dir: Path, launch_id: str) -> int | None:
        """A notice pipe for the worker launched as ``launch_id`` from ``run_dir`` (the keeper
        re-adopts it if it has to), or None when no keeper holds it: its record is final, or there
        is none. Raises WorkerError when no keeper can be reached."""
        reply, fds = self._call({"op": "watch", "run_dir": str(run_dir), "launch_id": launch_id})
        if reply["op"] == "watching" and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        if reply["op"] == "final":
            return None
        raise WorkerError(f"the keeper could not watch {run_dir}: {reply.get('message', reply)}")

    def status(self) -> dict[str, Any]:
        """The keeper's own account: its identity, the workers in its custody (all pages of them),
        its idle children."""
        workers: list[Any] = []
        while True:
            reply, fds = self._call({"op": "status", "offset": len(workers)})
            for fd in fds:
                os.close(fd)
            page = reply.get("workers")
            if reply.get("op") != "status" or not isinstance(page, list):
                raise WorkerError(f"the keeper answered a status request with {reply}")
            workers += page
            if not page or len(workers) >= int(reply.get("total", 0)):
                return {**reply, "workers": workers}

    def idle_children(self, kind: str = PLAIN) -> list[ProcessIdentity]:
        """The armed children of ``kind`` in hand, in the order launches take them (after waiting
        for those the keeper is still preparing)."""
        with self._lock:
            self._ensure()
            self._request_arms()
            while any(self._pending.values()):
                self._receive_one()
            return [armed.identity for armed in self._armed[kind]]

    # ------------------------------------------------------------------ the connection

    def _keeper_alive(self) -> bool:
        return self._sock is not None and not fd_fired(self._keeper_pidfd)

    def _ensure(self) -> None:
        """Connected to a live keeper, or WorkerError. The lock is held."""
        if self._closed:
            raise WorkerError("the keeper client is closed")
        if self._keeper_alive():
            return
        self._disconnect()
        if time.monotonic() < self._retry_at:
            raise WorkerError(f"{self._last_failure} (retrying in {self._retry_at - time.monotonic():.1f}s)")
        try:
            self._connect()
        except WorkerError as err:
            self._last_failure = str(err)
            self._retry_at = time.monotonic() + self._retry_delay
            self._retry_delay = min(_RETRY_MAX, self._retry_delay * 2)
            raise
        self._retry_delay = _RETRY_FIRST
        self._retry_at = 0.0

    def _connect(self) -> None:
        path = self.directory / proto.SOCKET_NAME
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(str(path))
                identity = self._handshake(sock)
                break
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, _Vanished) as err:
                # Nobody listens, or a keeper that died was still listening through a child it had
                # just forked (which holds its descriptors until it closes them): start one, retry.
                sock.close()
                if time.monotonic() > deadline:
                    raise WorkerError(
                        f"cannot reach a keeper at {path} ({err}) within {START_TIMEOUT:g}s; "
                        f"see {self.directory / proto.LOG_NAME}"
                    ) from err
            except (OSError, proto.ProtocolError) as err:
                sock.close()
                raise WorkerError(f"the keeper at {path} did not complete the handshake: {err}") from err
            except WorkerError:
                sock.close()
                raise
            if self._start_keeper() == proto.EXIT_ALREADY_RUNNING:
                time.sleep(0.02)  # another keeper holds the lock: it is starting, or dying
        pidfd = open_verified_pidfd(identity)
        if pidfd is None:
            sock.close()
            raise WorkerError(f"the keeper (pid {identity.pid}) exited right after it answered")
        self._sock, self._keeper, self._keeper_pidfd = sock, identity, pidfd
        self._trace = self._trace if self._trace.fd is not None else Trace.from_environment()
        self._watch_keeper_death()
        self._request_arms()

    def _handshake(self, sock: socket.socket) -> ProcessIdentity:
        """Hello and welcome; _Vanished when the connection ends unanswered (no live keeper)."""
        sock.settimeout(REPLY_TIMEOUT)
        proto.send(sock, {"op": "hello", "protocol": proto.PROTOCOL})
        reply, fds = proto.receive(sock)
        for fd in fds:
            os.close(fd)
        if reply is None:
            raise _Vanished("the keeper closed the connection during the handshake")
        if reply["op"] != "welcome":
            pid = reply.get("pid", "?")
            raise WorkerError(
                f"{reply.get('message', reply)}; this agent speaks keeper protocol {proto.PROTOCOL}. "
                f"The keeper keeps its workers running. To replace it: kill -TERM {pid} (it exits and "
                "leaves its workers running), then restart the agent: the keeper it starts re-adopts "
                "them, without their exit codes"
            )
        return ProcessIdentity(int(reply["pid"]), int(reply["start_time"]))

    def _start_keeper(self) -> int:
        """Run ``python -m nodeagent.runtime.keeper``; it returns once the keeper listens (0), or
        says another holds the lock (EXIT_ALREADY_RUNNING)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
            log_fd = os.open(
                self.directory / proto.LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            with open(log_fd, "ab") as keeper_log:
                # No preexec_fn: CPython can then use vfork, which is safe from a threaded process.
                argv = [self._python, "-m", "nodeagent.runtime.keeper", str(self.directory)]
                if self._placement is not None:
                    argv = self._placement.command(KEEPER, argv)
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=keeper_log,
                    stderr=keeper_log,
                    start_new_session=True,
                    env=env,
                    cwd="/",
                )
            code = process.wait(timeout=START_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise WorkerError(
                f"cannot start a keeper for {self.directory} with {self._python}: {err}"
            ) from err
        if code not in (0, proto.EXIT_ALREADY_RUNNING):
            raise WorkerError(
                f"the keeper for {self.directory} exited with status {code} while starting: "
                f"{self._log_tail()}; fix that and the agent starts it again"
            )
        if code == 0:
            log.info("started a keeper", extra={"directory": str(self.directory)})
        return code

    def _log_tail(self, chars: int = 600) -> str:
        try:
            return (self.directory / proto.LOG_NAME).read_text()[-chars:].strip()
        except OSError:
            return "(no keeper.log)"

    def _disconnect(self) -> None:
        for armed in self._armed.values():
            while armed:
                armed.popleft().close()  # each child reads EOF instead of a request and exits
        self._pending = dict.fromkeys(self._armed, 0)
        self._arm_order.clear()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._keeper_pidfd >= 0:
            os.close(self._keeper_pidfd)
            self._keeper_pidfd = -1
        self._keeper = None

    # ------------------------------------------------------------------ requests and replies

    def _call(self, body: dict[str, object]) -> tuple[dict[str, Any], list[int]]:
        """One request and its reply; once more with a new keeper if this one died meanwhile."""
        for attempt in (1, 2):
            with self._lock:
                self._ensure()
                assert self._sock is not None
                try:
                    proto.send(self._sock, body)
                except OSError as err:
                    self._disconnect()
                    if attempt == 2:
                        raise WorkerError(f"lost the keeper of {self.directory}: {err}") from err
                    continue
                try:
                    while True:
                        received = self._receive_one()
                        if received is not None:
                            return received
                except WorkerError:
                    if attempt == 2:
                        raise  # (it disconnected: the next exchange starts or finds a new keeper)
        raise AssertionError("unreachable")

    def _receive_one(self) -> tuple[dict[str, Any], list[int]] | None:
        """Read one message; armed children (and failures to arm) are kept, None returned."""
        assert self._sock is not None
        try:
            reply, fds = proto.receive(self._sock)
        except (OSError, proto.ProtocolError) as err:
            self._disconnect()
            raise WorkerError(f"lost the keeper of {self.directory}: {err}") from err
        if reply is None:
            self._disconnect()
            raise WorkerError(f"the keeper of {self.directory} closed the connection; see {proto.LOG_NAME}")
        if reply["op"] == "armed" and len(fds) == 5:
            kind = self._arm_answered()
            self._armed[kind].append(
                _Armed(ProcessIdentity(int(reply["pid"]), int(reply["start_time"])), fds)
            )
            return None
        if reply["op"] == "error" and reply.get("request") == "arm":
            self._arm_answered()
            self._arm_error = str(reply.get("message"))
            return None
        return reply, fds

    def _arm_answered(self) -> str:
        """Replies come in the order of the requests: the oldest arm outstanding was answered."""
        kind = self._arm_order.popleft()
        self._pending[kind] -= 1
        return kind

    def _send_arm(self, kind: str) -> None:
        assert self._sock is not None
        body: dict[str, object] = {"op": "arm"}
        if kind == PID_NAMESPACE:
            body["pid_namespace"] = True
        elif kind == PREPARED:
            body["prepare_sandbox"] = True  # a keeper that predates it arms a plain child
        proto.send(self._sock, body)
        self._pending[kind] += 1
        self._arm_order.append(kind)

    def _request_arms(self) -> None:
        if self._sock is None:
            return
        try:
            for kind in self._kept:
                wanted = self._idle_children if not self._resting else int(kind == self._last_kind)
                while len(self._armed[kind]) + self._pending[kind] < wanted:
                    self._send_arm(kind)
        except OSError:
            pass  # the next exchange finds the keeper gone and says so

    def _take_armed(self, kind: str) -> _Armed:
        """A child of ``kind``; one armed now (a fork on this launch's path) when none is in hand.
        Prepared children are kept in hand from the first launch that takes one; children in a pid
        namespace never are (root workers are an opt-in, not worth children kept waiting)."""
        self._ensure()
        if kind == PREPARED and kind not in self._kept:
            self._kept.append(kind)
        armed = self._armed[kind]
        if not armed:
            self._request_arms()
            if not self._pending[kind]:
                try:
                    self._send_arm(kind)
                except OSError as err:
                    self._disconnect()
                    raise WorkerError(f"lost the keeper of {self.directory}: {err}") from err
            while not armed:
                if not self._pending[kind]:
                    what = " in a pid namespace" if kind == PID_NAMESPACE else ""
                    raise WorkerError(f"the keeper could not prepare a worker child{what}: {self._arm_error}")
                self._receive_one()
        return armed.popleft()

    # ------------------------------------------------------------------ keeper deaths

    def _watch_keeper_death(self) -> None:
        if self._thread is None:
            self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._thread = threading.Thread(target=self._watch_loop, name="nodeagent-keeper", daemon=True)
            self._thread.start()
        else:
            os.eventfd_write(self._wake_fd, 1)  # watch the new keeper's pidfd

    def _watch_loop(self) -> None:
        retry: float | None = None
        while True:
            with self._lock:
                if self._closed:
                    return
                pidfd = os.dup(self._keeper_pidfd) if self._keeper_pidfd >= 0 else -1
            poller = select.poll()
            poller.register(self._wake_fd, select.POLLIN)
            if pidfd >= 0:
                poller.register(pidfd, select.POLLIN)
            rest = self._rest_if_idle()
            waits = [t for t in (retry, rest) if t is not None]
            try:
                fired = {fd for fd, _ in poller.poll(min(waits) * 1000 if waits else None)}
            finally:
                if pidfd >= 0:
                    os.close(pidfd)
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
            if pidfd in fired or retry is not None:
                retry = self._replace_dead_keeper()

    def _rest_if_idle(self) -> float | None:
        """Cut the idle children to one, of the last launch's kind, once no launch came for
        ``rest_after`` seconds; returns the seconds until it is due (None: resting already, or
        closed)."""
        with self._lock:
            if self._closed or self._resting or self._sock is None:
                return None
            due = self._last_launch + self._rest_after - time.monotonic()
            if due > 0:
                return due
            self._resting = True
            try:
                # Arms answered but not yet read are children too: read them first.
                while any(self._pending.values()):
                    self._receive_one()
            except WorkerError:
                return None  # the keeper is gone (disconnected): its children with it
            for kind, armed in self._armed.items():
                while len(armed) > int(kind == self._last_kind):
                    armed.pop().close()  # it reads EOF instead of a request and exits
            return None

    def _replace_dead_keeper(self) -> float | None:
        """Start a new keeper if the one we had is dead; seconds until the next try on failure."""
        with self._lock:
            if self._closed or self._keeper_alive():
                return None
            gone = self._keeper
            try:
                self._ensure()
            except WorkerError as err:
                log.error("no keeper: %s", err)
                return max(0.1, self._retry_at - time.monotonic())
            log.warning(
                "the keeper exited; a new one took over its workers",
                extra={
                    "old_keeper": gone.pid if gone else None,
                    "keeper": self._keeper.pid if self._keeper else None,
                },
            )
            return None


__all__ = ["MAX_REQUEST_BYTES", "KeeperClient", "keeper_identity", "stop_keeper"]
