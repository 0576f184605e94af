"""fd_fired on real pidfds, including descriptors past select()'s FD_SETSIZE (1024): a
daemon holding two pidfds per worker gets there at about 500 workers."""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Iterator

import pytest

from nodeagent.runtime.process import fd_fired

HIGH_FD = 1500


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def pidfd_at(pid: int, fd: int | None) -> int:
    pidfd = os.pidfd_open(pid)
    if fd is None:
        return pidfd
    os.dup2(pidfd, fd)
    os.close(pidfd)
    return fd


@pytest.mark.parametrize("fd", [pytest.param(None, id="low-fd"), pytest.param(HIGH_FD, id="fd-past-1024")])
def test_a_pidfd_reads_exited_only_once_its_process_has(
    child: subprocess.Popen[bytes], fd: int | None
) -> None:
    if fd is not None and resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= fd:
        pytest.skip(f"the open-files limit is below {fd}")
    pidfd = pidfd_at(child.pid, fd)
    try:
        assert not fd_fired(pidfd)
        child.kill()
        child.wait()
        assert fd_fired(pidfd)
    finally:
        os.close(pidfd)


def test_no_pidfd_stands_for_a_process_that_is_gone() -> None:
    assert fd_fired(-1)
