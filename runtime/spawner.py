"""The spawner: a small single-threaded process that forks keepers (and through them, workers).

Why a separate process: the agent is multi-threaded, and running Python between fork and exec in a
multi-threaded process can deadlock on a lock another thread held at fork time. The spawner is
started once (``python -m nodeagent.runtime.spawner FD``, paying interpreter start-up once, not per
launch), never starts a thread, and keeps a small memory footprint so its forks stay cheap.

Protocol: JSON messages over a SOCK_SEQPACKET socketpair, one request, one reply. The spawner
exits when the agent's end closes; keepers and workers it started live on.

::

    agent ──socketpair──> spawner ──fork──> keeper (setsid) ──fork──> enter_slot_and_exec ──exec──> worker
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from nodeagent.errors import WorkerError
from nodeagent.runtime.keeper import run_idle_keeper
from nodeagent.runtime.request import LaunchRequest, LaunchResult

_MAX_MESSAGE = 1 << 20


# --- the spawner process -------------------------------------------------------------------------


class _IdleKeeper:
    """A keeper forked ahead of the next request (which it reads from a pipe), so no fork is on the
    request's path; it pre-forks its worker child in turn."""

    def __init__(self, channel: socket.socket) -> None:
        request_r, self.request_w = os.pipe2(os.O_CLOEXEC)
        self.report_r, report_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:
            channel.close()
            os.close(self.request_w)
            os.close(self.report_r)
            run_idle_keeper(request_r, report_w)
        os.close(request_r)
        os.close(report_w)

    def launch(self, message: bytes) -> bytes:
        with os.fdopen(self.request_w, "wb") as request:
            request.write(message)
        with os.fdopen(self.report_r, "rb") as report:
            body = report.read()
        if not body:
            return json.dumps(
                {"error": "the keeper exited without reporting (see keeper.log in the run directory)"}
            ).encode()
        return body

    def dismiss(self) -> None:
        os.close(self.request_w)
        os.close(self.report_r)


def serve(fd: int) -> None:
    """The spawner's loop: one launch at a time, until the agent closes its end."""
    channel = socket.socket(fileno=fd)
    # Keepers are reaped by the kernel; the spawner never waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    idle = _IdleKeeper(channel)
    while True:
        message = channel.recv(_MAX_MESSAGE)
        if not message:
            idle.dismiss()
            return
        channel.send(idle.launch(message))
        idle = _IdleKeeper(channel)


# --- the agent's side ----------------------------------------------------------------------------


class Spawner:
    """The agent's handle on its spawner process. Thread-safe: one launch on the wire at a time."""

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self._process is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # No preexec_fn: CPython can then use vfork, which is safe from a threaded process.
            self._process = subprocess.Popen(
                [self._python, "-m", "nodeagent.runtime.spawner", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except OSError as err:
            ours.close()
            raise WorkerError(f"cannot start the spawner with {self._python}: {err}") from err
        finally:
            theirs.close()
        self._channel = ours

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def launch(self, req: LaunchRequest) -> LaunchResult:
        """Launch a worker; returns once it has exec'd inside its slot. Raises WorkerError."""
        if self._channel is None:
            self.start()
        assert self._channel is not None
        with self._lock:
            try:
                self._channel.send(json.dumps(req.to_json()).encode())
                reply = self._channel.recv(_MAX_MESSAGE)
            except OSError as err:
                raise WorkerError(f"the spawner is unreachable ({err}); restart the agent") from err
        if not reply:
            raise WorkerError("the spawner exited; restart the agent")
        body = json.loads(reply)
        if "error" in body:
            raise WorkerError(f"cannot launch {list(req.argv)} for {req.launch_id}: {body['error']}")
        return LaunchResult(**body)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._process is not None:
            self._process.wait(timeout=10)
            self._process = None

    def __enter__(self) -> Spawner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
