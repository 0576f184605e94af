"""Fixtures for the runtime's tests: throwaway v1 slots, a host keeper of the test's own, clean-up
by verified pidfd.

The tests in ``v2vm/`` need a pure cgroup v2 kernel; they are collected only when
NODEAGENT_IN_CGROUP2_VM=1 (set inside the VM that runs them), so ordinary runs never see them.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.keeper_client import KeeperClient, keeper_identity, stop_keeper
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.process import ExitRecord, ProcessIdentity, open_verified_pidfd, read_state
from tests.runtime.slotcg import V1Slot

collect_ignore = [] if os.environ.get("NODEAGENT_IN_CGROUP2_VM") == "1" else ["v2vm"]


def _v1_available() -> bool:
    return all(
        (Path("/sys/fs/cgroup") / ctrl / "cgroup.procs").exists()
        for ctrl in ("cpuset", "memory", "pids", "freezer")
    )


@pytest.fixture
def slot() -> Iterator[V1Slot]:
    if not _v1_available():
        pytest.skip("needs cgroup v1 cpuset, memory, pids and freezer hierarchies")
    made = V1Slot()
    yield made
    made.remove()


def wait_gone(identity: ProcessIdentity, timeout: float = 10.0) -> bool:
    """Until ``identity`` has exited (True), or ``timeout``."""
    pidfd = open_verified_pidfd(identity)
    if pidfd is None:
        return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(pidfd)


def kill(identity: ProcessIdentity, sig: int = signal.SIGKILL) -> None:
    """Signal exactly this process (verified pidfd), if it is still there."""
    pidfd = open_verified_pidfd(identity)
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
        os.close(pidfd)


@pytest.fixture
def kill_workers() -> Iterator[list[ProcessIdentity]]:
    """Workers the test started; SIGKILLed at the end (by verified pidfd) if still there."""
    workers: list[ProcessIdentity] = []
    yield workers
    for identity in workers:
        kill(identity)
    for identity in workers:
        wait_gone(identity)


def stop_test_keeper(directory: Path, client: KeeperClient | None = None) -> None:
    """Close the client, stop the keeper of ``directory`` and wait for its idle children to go."""
    idle: list[ProcessIdentity] = []
    if client is not None:
        with contextlib.suppress(Exception):
            idle = client.idle_children()
        client.close()  # the idle children read EOF and exit
    stop_keeper(directory)
    for identity in idle:
        assert wait_gone(identity), f"idle child {identity.pid} is still there"


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[KeeperClient]:
    """A host keeper of the test's own (in tmp_path), stopped at the end; workers it leaves
    running are the test's to kill (``kill_workers`` or the slot's removal)."""
    client = KeeperClient(tmp_path / "keeper")
    client.connect()
    yield client
    stop_test_keeper(tmp_path / "keeper", client)


def current_keeper(directory: Path) -> ProcessIdentity:
    identity = keeper_identity(directory)
    assert identity is not None, f"no keeper identity in {directory}"
    return identity


def make_request(tmp_path: Path, slot: V1Slot | None, argv: list[str], **extra: object) -> LaunchRequest:
    fields: dict[str, object] = {
        "launch_id": f"natest{os.getpid()}-{time.monotonic_ns()}",
        "argv": tuple(argv),
        "env": {"PATH": "/usr/bin:/bin", "NATEST": "1"},
        "run_dir": str(tmp_path / "run"),
        "log_dir": str(tmp_path / "logs"),
        "cgroup_procs": slot.procs_files if slot else (),
        "oom_events": slot.oom_events if slot else None,
    }
    fields.update(extra)
    return LaunchRequest(**fields)  # type: ignore[arg-type]


def wait_for_exit(run_dir: Path, timeout: float = 10.0) -> ExitRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state is not None and state.exit is not None:
            return state.exit
        time.sleep(0.02)
    raise AssertionError(f"no exit recorded in {run_dir} within {timeout}s")


def wait_until(what: str, check, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)
