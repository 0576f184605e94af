"""Fixtures for the cgroup tests: fake cgroupfs trees, and throwaway groups on the real kernel.

The tests in ``v2vm/`` need a pure cgroup v2 kernel; they are collected only when
NODEAGENT_IN_CGROUP2_VM=1 (set inside the VM that runs them), so ordinary runs never see them.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodeagent.cgroups import CgroupHost, CgroupManager, detect, open_manager
from tests.trees import write_tree

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]

_counter = itertools.count()


@pytest.fixture
def fake_tree(tmp_path: Path) -> Callable[[dict[str, str]], Path]:
    return lambda files: write_tree(tmp_path, files)


def unique_name(prefix: str = "natest") -> str:
    return f"{prefix}{os.getpid()}-{next(_counter)}"


@pytest.fixture
def real_host() -> CgroupHost:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    return detect()


@pytest.fixture
def v1_group(real_host: CgroupHost) -> Iterator[CgroupManager]:
    """A fresh v1 group natest<pid>-<n>/slot on the real kernel, killed and removed afterwards."""
    if not real_host.v1_mounts:
        pytest.skip(f"no cgroup v1 hierarchies here (mode {real_host.mode})")
    yield from _throwaway(real_host, "v1")


@pytest.fixture
def unified_group(real_host: CgroupHost) -> Iterator[CgroupManager]:
    """A fresh group in the cgroup2 mount (controller-less on a hybrid host), removed afterwards."""
    if real_host.v2_mount is None:
        pytest.skip("no cgroup2 mount here")
    yield from _throwaway(real_host, "v2")


def _throwaway(host: CgroupHost, version: str) -> Iterator[CgroupManager]:
    top = unique_name()
    manager = open_manager(host, f"{top}/slot", version=version)  # type: ignore[arg-type]
    top_manager = open_manager(host, top, version=version)  # type: ignore[arg-type]
    try:
        yield manager
    finally:
        top_manager.kill(timeout=10)
        top_manager.delete(timeout=10)
        assert not top_manager.exists()


class Child:
    """A Python child process started paused; ``release()`` lets it run its code."""

    def __init__(self, code: str) -> None:
        self._read_fd, self._write_fd = os.pipe()
        prelude = f"import os\nos.read({self._read_fd}, 1)\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", prelude + code],
            pass_fds=(self._read_fd,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(self._read_fd)
        self.pid = self.proc.pid

    def release(self) -> None:
        os.write(self._write_fd, b"x")
        os.close(self._write_fd)
        self._write_fd = -1

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def stop(self) -> None:
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.communicate(timeout=10)


@pytest.fixture
def spawn() -> Iterator[Callable[[str], Child]]:
    """Start paused Python children; every one is killed (by pid) and reaped at the end."""
    children: list[Child] = []

    def start(code: str) -> Child:
        child = Child(code)
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop()


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
