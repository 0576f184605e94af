"""Run a command the way the launch path will: fork, (join cgroups), enter_sandbox, switch to the
spec's user, seal_sandbox, exec. Output (stdout and stderr together) comes back through a pipe.

Each test keeps the children it started in the ``sandboxed`` fixture, which SIGKILLs by pid any
that still run at the end; a pid namespace child takes its whole namespace with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeagent.runtime.sandbox import (
    PrivateDir,
    SandboxSpec,
    enter_sandbox,
    fork_into_new_pid_namespace,
    init_argv,
    seal_sandbox,
    switch_user,
)

NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
#: The dumb-init this package installs beside the interpreter.
INIT = os.path.join(os.path.dirname(sys.executable), "dumb-init")


@dataclass
class Finished:
    returncode: int
    output: str


class Child:
    def __init__(self, pid: int, output_fd: int) -> None:
        self.pid = pid
        self._fd = output_fd
        self._chunks: list[bytes] = []
        self.finished: Finished | None = None

    def read_available(self, wait: float = 0.05) -> str:
        """Read what the child wrote so far (waiting up to ``wait`` for more); all output so far."""
        self._read_once(wait)
        return b"".join(self._chunks).decode(errors="replace")

    def _read_once(self, wait: float) -> bool:
        """One read; False at end of file or when nothing came within ``wait``."""
        if self._fd < 0 or not select.select([self._fd], [], [], wait)[0]:
            return False
        chunk = os.read(self._fd, 65536)
        self._chunks.append(chunk)
        return bool(chunk)

    def wait_for_output(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.read_available()
            if text in seen:
                return seen
            if self.poll() is not None:
                break
        raise AssertionError(f"{text!r} not seen within {timeout}s; output: {self.read_available(0)!r}")

    def poll(self) -> Finished | None:
        if self.finished is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                # What is still in the pipe; a grandchild holding it open must not keep us here.
                while self._read_once(0):
                    pass
                os.close(self._fd)
                self._fd = -1
                output = b"".join(self._chunks).decode(errors="replace")
                self.finished = Finished(os.waitstatus_to_exitcode(status), output)
        return self.finished

    def wait(self, timeout: float = 20.0) -> Finished:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            finished = self.poll()
            if finished is not None:
                return finished
            self.read_available()
        self.kill()
        raise AssertionError(
            f"child {self.pid} still ran after {timeout}s; output: {self.read_available(0)!r}"
        )

    def kill(self) -> None:
        if self.finished is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)


def start(
    spec: SandboxSpec | None,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    before: Callable[[], None] | None = None,
    cgroup_procs: Sequence[str] = (),
    user: int | None = None,
) -> Child:
    """Start ``argv`` in a sandbox made from ``spec``; with ``spec=None``, the same child without a
    sandbox (the control), as ``user`` if given."""
    read_end, write_end = os.pipe()
    in_pid_ns = spec is not None and "pid" in spec.namespaces
    pid = fork_into_new_pid_namespace() if in_pid_ns else os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            for procs in cgroup_procs:
                with open(procs, "w") as handle:
                    handle.write("0")
            if before is not None:
                before()
            final = list(argv)
            program: str | int = final[0]
            if spec is not None:
                if spec.init is not None and in_pid_ns:
                    # As the agent does: opened before the mounts (the init may lie under /tmp).
                    final = list(init_argv(spec.init, argv))
                    program = os.open(spec.init, os.O_RDONLY | os.O_CLOEXEC)
                enter_sandbox(spec)
                switch_user(spec)
                seal_sandbox(spec)
            elif user is not None:
                os.setgroups([])
                os.setgid(user)
                os.setuid(user)
            os.execve(program, final, env if env is not None else ENV)
        except BaseException as err:  # noqa: BLE001 - a forked child must never return into pytest
            with contextlib.suppress(OSError):
                os.write(2, f"sandbox child failed: {err!r}\n".encode())
        finally:
            os._exit(127)
    os.close(write_end)
    return Child(pid, read_end)


def run(spec: SandboxSpec | None, argv: Sequence[str], timeout: float = 20.0, **kwargs: object) -> Finished:
    return start(spec, argv, **kwargs).wait(timeout)  # type: ignore[arg-type]


#: An interpreter a non-root worker can run: this test run's own may live under root's home.
WORKER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def python(code: str) -> list[str]:
    return [WORKER_PYTHON, "-I", "-c", code]


@pytest.fixture
def sandboxed() -> Iterator[list[Child]]:
    """Children a test started; any still running at the end is killed by pid."""
    children: list[Child] = []
    yield children
    for child in children:
        child.kill()


def in_child(action: Callable[[], object], timeout: float = 20.0) -> object:
    """Run ``action`` in a forked child and return what it returned (JSON-able), or raise
    AssertionError with the child's exception. For primitives that change the calling process
    for good (unshare, mounts, capabilities, a seccomp filter)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            try:
                body = {"value": action()}
            except BaseException as err:  # noqa: BLE001 - reported to the parent
                body = {"error": repr(err)}
            os.write(write_end, json.dumps(body).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    reader = Child(pid, read_end)
    finished = reader.wait(timeout)
    if not finished.output:
        raise AssertionError(f"child died with status {finished.returncode} before it answered")
    body = json.loads(finished.output)
    if "error" in body:
        raise AssertionError(f"in the child: {body['error']}")
    return body["value"]


def os_error_of(action: Callable[[], object]) -> int:
    """The errno ``action`` fails with; 0 if it succeeds."""
    try:
        action()
    except OSError as err:
        return err.errno or -1
    return 0


#: A worker filling its private places (argv: the slot's memory usage file, its HOME, a name for
#: /var/tmp): JSON with the usage after each step and what the last, oversized write met.
PRIVATE_PLACES = """
import errno, json, sys
usage_file, home, name = sys.argv[1:4]
def usage():
    return int(open(usage_file).read())
def fill(path, size):
    try:
        with open(path, "wb") as out:
            out.write(b"x" * size)
        return "written"
    except OSError as err:
        return errno.errorcode[err.errno]
seen = {"before": usage()}
seen["home"] = fill(home + "/f", 8 << 20)
seen["after_home"] = usage()
seen["var_tmp"] = fill("/var/tmp/" + name, 8 << 20)
seen["after_var_tmp"] = usage()
seen["home_past_its_size"] = fill(home + "/g", 16 << 20)
print(json.dumps(seen))
"""


def check_private_places(
    run_in_slot: Callable[[SandboxSpec, list[str]], Finished], usage_file: str, home: Path
) -> None:
    """HOME (a 16 MiB tmpfs of the worker's own) and /var/tmp (an overlay whose writes live in a
    tmpfs) are charged to the slot's memory cgroup, size-limited, and leave nothing on the host."""
    home.mkdir()
    name = f"natest{os.getpid()}-private"
    spec = SandboxSpec(
        uid=NOBODY,
        gid=NOBODY,
        private_dirs=(PrivateDir(str(home), 16 << 20, 0o700, NOBODY, NOBODY),),
        private_views=("/var/tmp",),
    )
    finished = run_in_slot(spec, [*python(PRIVATE_PLACES), usage_file, str(home), name])
    assert finished.returncode == 0, finished.output
    seen = json.loads(finished.output)
    assert (seen["home"], seen["var_tmp"], seen["home_past_its_size"]) == ("written", "written", "ENOSPC")
    assert seen["after_home"] - seen["before"] >= 7 << 20, seen
    assert seen["after_var_tmp"] - seen["after_home"] >= 7 << 20, seen
    assert list(home.iterdir()) == []
    assert not os.path.exists(f"/var/tmp/{name}")
