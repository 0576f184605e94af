"""The spawner: a small single-threaded process that forks keepers (and through them, workers).

Why a separate process: the agent is multi-threaded, and running Python between fork and exec in a
multi-threaded process can deadlock on a lock another thread held at fork time. The spawner is
started once (``python -m nodeagent.runtime.spawner FD``, paying interpreter start-up once, not per
launch), never starts a thread, and keeps a small memory footprint so its forks stay cheap.

Everything that can happen before a request does: the spawner forks an idle keeper, which forks
the worker child, which sets itself up and waits. The spawner hands the agent that child's request
and status pipes and the keeper's request pipe (SCM_RIGHTS), with both processes' identities. A
launch is then the agent writing the request to the child and reading the child's status pipe
until EOF (exec done) or an error: one wake-up of the child and one of the agent, no fork, no
round trip through the spawner. The child hands the request on to its keeper just before exec;
the keeper reads it once the agent closes the keeper's pipe, so it takes no CPU mid-launch. The
agent then asks for the next one ("arm"), off the launch's path. Closing the pipes unused
dismisses a keeper and its child.

::

    agent ──socketpair──> spawner ──fork──> keeper ──fork──> child (waits)
    agent ══request pipe══> child ──join slot, hand request to keeper, exec──> worker
    agent <══status pipe (EOF at exec)══ child;  agent closes the keeper's pipe: keeper takes over

The spawner exits when the agent's end closes; keepers and workers it started live on.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from nodeagent.cgroups.delegation import KEEPER, ProcessPlacement
from nodeagent.errors import WorkerError
from nodeagent.runtime.enter import Trace
from nodeagent.runtime.keeper import run_idle_keeper
from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd
from nodeagent.runtime.request import LaunchRequest, LaunchResult

_MAX_MESSAGE = 1 << 16
_ARM = b"arm"
_GONE_TIMEOUT = 5.0
#: What a pipe holds at most without raising fs.pipe-max-size (the child passes the request on
#: in one write, before the keeper reads).
MAX_REQUEST_BYTES = (1 << 20) - 64


# --- the spawner process -------------------------------------------------------------------------


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


def _fork_keeper(channel: socket.socket) -> tuple[bytes, list[int]]:
    """Fork an idle keeper; returns its announcement and the agent's ends of its pipes."""
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    request_r, request_w = os.pipe2(os.O_CLOEXEC)
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        channel.close()
        for fd in (go_w, status_r, request_w, ready_r):
            os.close(fd)
        run_idle_keeper(request_r, go_r, status_w, ready_w)
    for fd in (go_r, status_w, request_r, ready_w):
        os.close(fd)
    announcement = _read_all(ready_r)
    os.close(ready_r)
    theirs = [go_w, status_r, request_w]
    if not announcement:
        for fd in theirs:
            os.close(fd)
        return json.dumps({"error": "a keeper exited before it was ready (see the agent's log)"}).encode(), []
    return announcement, theirs


def serve(fd: int) -> None:
    """The spawner's loop: arm one keeper per "arm", until the agent closes its end."""
    channel = socket.socket(fileno=fd)
    # Keepers are reaped by the kernel; the spawner never waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Objects that exist now are never collected: a collection would touch (and so copy) the pages
    # every keeper and child shares with us.
    gc.freeze()
    while True:
        try:
            message = channel.recv(_MAX_MESSAGE)
        except OSError:
            return  # the agent went away with a reply unread
        if message != _ARM:
            return
        announcement, fds = _fork_keeper(channel)
        try:
            socket.send_fds(channel, [announcement], fds)
        except OSError:
            return  # the agent went away; closing our copies dismisses the keeper
        finally:
            for theirs in fds:
                os.close(theirs)


# --- the agent's side ----------------------------------------------------------------------------


@dataclass
class _Armed:
    """An idle keeper and its worker child, as the agent holds them: pipe ends and identities."""

    go: int
    status: int
    keeper: int
    identity: dict[str, Any]

    def fire(self, message: bytes) -> bytes:
        """Send the request to the child; returns its failure report, empty once it has exec'd.
        The child hands the request on to the keeper, which wakes when we close its pipe."""
        try:
            _write_all(self.go, message)
            delivered = True
        except BrokenPipeError:
            delivered = False  # the child died before reading; its status pipe says why, if it could
        self._close("go")
        report = _read_all(self.status)
        self._close("keeper")
        if not report and not delivered:
            return b"start worker child\x000\x00the pre-forked child exited before its request"
        return report

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            setattr(self, name, -1)
            os.close(fd)

    def close(self) -> None:
        for name in ("go", "status", "keeper"):
            self._close(name)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _wait_gone(child: ProcessIdentity) -> None:
    """Wait until a failed child has left its slot: EOF on its status pipe comes when it closes its
    files, a little before it leaves its cgroups; its pidfd turns readable after that."""
    pidfd = open_verified_pidfd(child)
    if pidfd is None:
        return
    try:
        # poll, not select: select refuses descriptors from 1024 up, which a daemon holding two
        # pidfds per worker passes at about 500 workers.
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll(_GONE_TIMEOUT * 1000)
    finally:
        os.close(pidfd)


def _describe_failure(report: bytes) -> str:
    step, errno_, text = [*report.decode("utf-8", "replace").split("\0"), "", ""][:3]
    return f"{step}: {text} (errno {errno_})"


class Spawner:
    """The agent's handle on its spawner process. Thread-safe: one launch on the wire at a time."""

    def __init__(
        self,
        python: str = sys.executable,
        *,
        idle_keepers: int = 2,
        placement: ProcessPlacement | None = None,
    ) -> None:
        """``idle_keepers``: how many keepers (each with its worker child) wait ready; two absorb
        a launch that follows another before the spawner has forked the next one. ``placement``:
        where the spawner and its keepers belong (the delegated cgroup's ``keeper/`` leaf under
        systemd); without one they stay in the agent's cgroup."""
        self._python = python
        self._placement = placement
        self._idle_keepers = max(1, idle_keepers)
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._armed: collections.deque[_Armed] = collections.deque()
        self._arms_pending = 0
        self._trace = Trace(None)

    def start(self) -> None:
        if self._process is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # No preexec_fn: CPython can then use vfork, which is safe from a threaded process.
            argv = [self._python, "-m", "nodeagent.runtime.spawner", str(theirs.fileno())]
            if self._placement is not None:
                argv = self._placement.command(KEEPER, argv)
            self._process = subprocess.Popen(
                argv,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                # Not the agent's working directory: `python -m` puts it first on sys.path, and a
                # checkout there would shadow the installed package.
                cwd="/",
            )
        except OSError as err:
            ours.close()
            raise WorkerError(f"cannot start the spawner with {self._python}: {err}") from err
        finally:
            theirs.close()
        self._channel = ours
        self._trace = Trace.from_environment()
        self._request_arm()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def launch(self, req: LaunchRequest) -> LaunchResult:
        """Launch a worker; returns once it has exec'd inside its slot. Raises WorkerError."""
        if self._channel is None:
            self.start()
        self._trace.stamp(req.launch_id, "agent-request")
        message = json.dumps(req.to_json()).encode()
        if len(message) > MAX_REQUEST_BYTES:
            raise WorkerError(
                f"the launch request for {req.launch_id} is {len(message)} bytes, over {MAX_REQUEST_BYTES}; "
                "shrink the worker's environment or arguments"
            )
        with self._lock:
            armed = self._take_armed()
            try:
                self._trace.stamp(req.launch_id, "agent-send")
                report = armed.fire(message)
            except OSError as err:
                raise WorkerError(
                    f"cannot launch {list(req.argv)} for {req.launch_id}: the keeper is gone ({err})"
                ) from err
            finally:
                armed.close()
                self._request_arm()
        self._trace.stamp(req.launch_id, "agent-done")
        if report:
            _wait_gone(ProcessIdentity(armed.identity["pid"], armed.identity["start_time"]))
            raise WorkerError(
                f"cannot launch {list(req.argv)} for {req.launch_id}: {_describe_failure(report)}"
            )
        return LaunchResult(launch_id=req.launch_id, **armed.identity)

    def _request_arm(self) -> None:
        if self._channel is None:
            return
        try:
            while len(self._armed) + self._arms_pending < self._idle_keepers:
                self._channel.send(_ARM)
                self._arms_pending += 1
        except OSError:
            pass  # the next launch finds the spawner gone and says so

    def _receive_armed(self, flags: int = 0) -> None:
        assert self._channel is not None
        try:
            message, fds, _, _ = socket.recv_fds(
                self._channel, _MAX_MESSAGE, 3, socket.MSG_CMSG_CLOEXEC | flags
            )
        except BlockingIOError:
            raise  # nothing ready yet (MSG_DONTWAIT): not an error
        except OSError as err:
            raise WorkerError(f"the spawner is unreachable ({err}); restart the agent") from err
        if not message:
            raise WorkerError("the spawner exited; restart the agent")
        self._arms_pending -= 1
        body = json.loads(message)
        if "error" in body or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            raise WorkerError(f"the spawner could not prepare a keeper: {body.get('error', body)}")
        self._armed.append(_Armed(fds[0], fds[1], fds[2], body))

    def _take_armed(self) -> _Armed:
        if not self._armed:
            self._request_arm()
            self._receive_armed()
        with contextlib.suppress(BlockingIOError):
            while self._arms_pending:  # collect the ones that are ready, without waiting
                self._receive_armed(socket.MSG_DONTWAIT)
        return self._armed.popleft()

    def idle_children(self) -> list[ProcessIdentity]:
        """The pre-forked worker children waiting for a request, in the order launches take them
        (after waiting for those the spawner is still preparing)."""
        with self._lock:
            if self._channel is None:
                return []
            self._request_arm()
            while self._arms_pending:
                self._receive_armed()
            return [ProcessIdentity(a.identity["pid"], a.identity["start_time"]) for a in self._armed]

    def close(self) -> None:
        with self._lock:
            while self._armed:
                self._armed.popleft().close()  # dismisses an idle keeper and its child
            if self._channel is not None:
                self._channel.close()  # with it go the keepers still in flight
                self._channel = None
                self._arms_pending = 0
            if self._process is not None:
                self._process.wait(timeout=10)
                self._process = None
            if self._trace.fd is not None:
                os.close(self._trace.fd)
                self._trace = Trace(None)

    def __enter__(self) -> Spawner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
