from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.runtime.process import ProcessIdentity, open_verified_pidfd
from nodeagent.runtime.request import LaunchRequest, LaunchResult
from nodeagent.runtime.spawner import Spawner
from tests.runtime.slotcg import V1Slot


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


@pytest.fixture
def kill_keepers() -> Iterator[list[ProcessIdentity]]:
    """Keepers the test started; SIGKILLed at the end (by verified pidfd) if still there."""
    keepers: list[ProcessIdentity] = []
    yield keepers
    for identity in keepers:
        pidfd = open_verified_pidfd(identity)
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    with Spawner() as started:
        yield started


def make_request(tmp_path: Path, slot: V1Slot | None, argv: list[str], **extra: object) -> LaunchRequest:
    fields: dict[str, object] = {
        "launch_id": f"natest{os.getpid()}",
        "argv": tuple(argv),
        "env": {"PATH": "/usr/bin:/bin", "NATEST": "1"},
        "run_dir": str(tmp_path / "run"),
        "log_dir": str(tmp_path / "logs"),
        "cgroup_procs": slot.procs_files if slot else (),
        "oom_events": slot.oom_events if slot else None,
    }
    fields.update(extra)
    return LaunchRequest(**fields)  # type: ignore[arg-type]


def keeper_of(result: LaunchResult) -> ProcessIdentity:
    return ProcessIdentity(result.keeper_pid, result.keeper_start_time)
