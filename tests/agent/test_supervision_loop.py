"""The supervision loop on real processes: it waits on every worker's pidfd at once, so idle
workers are never polled, an exit is seen as it happens, and timed work (a restart) runs when due.

The workers are ``sleep`` processes this test starts and ends itself (by pid); kernel, placement
and the store are the fakes and the tmp_path database of test_manager.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.manager import SlotManager
from nodeagent.agent.state import StateStore
from nodeagent.isolation.isolator import AppliedSlot
from nodeagent.runtime.env import SlotDescription
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.sandbox import SandboxSpec
from nodeagent.runtime.supervisor import Backoff, Supervisor
from nodeagent.schema.request import parse_slot_request
from nodeagent.schema.worker import WorkerSpec
from tests.agent.test_manager import TOPOLOGY, FakeCgroup, FakeIsolation, FakeRuntime, World, guaranteed

WAIT_SECONDS = 10.0  # generous: the machine may be busy; the loop normally reacts in milliseconds


class SleepProcess:
    """A real ``sleep`` worker held by a pidfd; counts how often supervision polls it."""

    def __init__(self, started: list[subprocess.Popen[bytes]]) -> None:
        self._popen = subprocess.Popen(["sleep", "600"])
        started.append(self._popen)
        self._pidfd = os.pidfd_open(self._popen.pid)
        self.polls = 0

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exit_fd(self) -> int | None:
        return self._pidfd if self._pidfd >= 0 else None

    def poll(self, now: float | None = None) -> ExitRecord | None:
        self.polls += 1
        status = self._popen.poll()
        if status is None:
            return None
        return (
            ExitRecord(None, -status, False, 0.0, "signaled")
            if status < 0
            else ExitRecord(status, None, False, 0.0, "exited")
        )

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.send_signal(sig)

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class SleepLauncher:
    def __init__(self, processes: dict[str, list[SleepProcess]], slot_id: str, started: list[Any]) -> None:
        self._processes, self._slot_id, self._started = processes, slot_id, started

    def launch(self, req: LaunchRequest) -> SleepProcess:
        process = SleepProcess(self._started)
        self._processes.setdefault(self._slot_id, []).append(process)
        return process


class SleepRuntime(FakeRuntime):
    def __init__(self, world: World, started: list[subprocess.Popen[bytes]]) -> None:
        super().__init__(world)
        self.processes: dict[str, list[SleepProcess]] = {}
        self._started = started
        self.backoff = Backoff(initial_seconds=0.2)

    def supervisor(
        self,
        slot: SlotDescription,
        applied: AppliedSlot | None,
        spec: WorkerSpec,
        sandbox: SandboxSpec | None = None,
    ) -> Supervisor:
        slot_id = slot.slot_id
        template = LaunchRequest(launch_id=slot_id, argv=spec.command, env={}, run_dir="/x", log_dir="/x")
        launcher = SleepLauncher(self.processes, slot_id, self._started)
        return Supervisor(spec, template, launcher, FakeCgroup(self.world, slot_id), backoff=self.backoff)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture
def supervised(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> Iterator[tuple[SlotManager, SleepRuntime]]:
    runtime = SleepRuntime(World(), started)
    manager = SlotManager(
        StateStore(tmp_path / "state.db"), TOPOLOGY, FakeIsolation(World()), runtime, tick_seconds=0.05
    )
    manager.start()
    yield manager, runtime
    manager.close()


def wait_for(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not check():
        assert time.monotonic() < deadline, "supervision did not get there in time"
        time.sleep(0.01)


def worker(manager: SlotManager, slot_id: str) -> dict[str, Any]:
    view = manager.get_slot(slot_id)
    assert view.worker is not None
    return view.worker.to_json()


def test_idle_workers_are_not_polled_and_an_exit_is_seen_without_polling_the_others(
    supervised: tuple[SlotManager, SleepRuntime],
) -> None:
    manager, runtime = supervised
    ids = [
        manager.allocate(
            parse_slot_request(
                {**guaranteed(f"w{i}", cpus=1), "worker": {"command": ["sleep"], "restart": "never"}}
            )
        ).slot.id
        for i in range(3)
    ]
    time.sleep(0.3)  # six ticks' worth of idling
    polls_before = {slot_id: runtime.processes[slot_id][0].polls for slot_id in ids}
    time.sleep(0.3)
    assert {slot_id: runtime.processes[slot_id][0].polls for slot_id in ids} == polls_before

    os.kill(runtime.processes[ids[0]][0].pid, signal.SIGKILL)
    wait_for(lambda: worker(manager, ids[0])["phase"] == "failed")
    assert worker(manager, ids[0])["last_exit"]["signal"] == signal.SIGKILL
    assert {slot_id: runtime.processes[slot_id][0].polls for slot_id in ids[1:]} == {
        slot_id: polls_before[slot_id] for slot_id in ids[1:]
    }


def test_a_restart_runs_when_its_backoff_is_over_and_the_new_worker_is_watched(
    supervised: tuple[SlotManager, SleepRuntime],
) -> None:
    manager, runtime = supervised
    slot_id = manager.allocate(
        parse_slot_request({**guaranteed(cpus=1), "worker": {"command": ["sleep"], "restart": "always"}})
    ).slot.id
    os.kill(runtime.processes[slot_id][0].pid, signal.SIGKILL)
    wait_for(
        lambda: worker(manager, slot_id)["restarts"] == 1 and worker(manager, slot_id)["phase"] == "running"
    )
    assert len(runtime.processes[slot_id]) == 2

    os.kill(runtime.processes[slot_id][1].pid, signal.SIGKILL)  # the relaunched worker's pidfd is armed too
    wait_for(lambda: worker(manager, slot_id)["restarts"] == 2)


def test_a_waiting_restart_shows_a_countdown_that_runs_between_ticks(
    supervised: tuple[SlotManager, SleepRuntime],
) -> None:
    manager, runtime = supervised
    runtime.backoff = Backoff(initial_seconds=60.0)
    slot_id = manager.allocate(
        parse_slot_request({**guaranteed(cpus=1), "worker": {"command": ["sleep"], "restart": "always"}})
    ).slot.id
    os.kill(runtime.processes[slot_id][0].pid, signal.SIGKILL)
    wait_for(lambda: worker(manager, slot_id)["phase"] == "backoff")
    first = worker(manager, slot_id)["next_restart_in"]
    time.sleep(0.2)  # the supervisor is not due for a minute: nothing ticks it meanwhile
    later = worker(manager, slot_id)["next_restart_in"]
    assert 0 < later < first <= 60.0


def test_release_stops_the_watched_worker(supervised: tuple[SlotManager, SleepRuntime]) -> None:
    manager, runtime = supervised
    slot_id = manager.allocate(
        parse_slot_request({**guaranteed(cpus=1), "worker": {"command": ["sleep"], "restart": "always"}})
    ).slot.id
    process = runtime.processes[slot_id][0]
    manager.release(slot_id)
    assert process.poll() is not None
    assert manager.list_slots() == []


def test_a_new_workers_first_probe_does_not_wait_for_the_next_tick(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    # The loop sleeps up to a tick (an hour here) on the agenda it had; a worker launched meanwhile
    # has its first readiness probe due at once, so adding it wakes the loop.
    runtime = SleepRuntime(World(), started)
    manager = SlotManager(
        StateStore(tmp_path / "state.db"), TOPOLOGY, FakeIsolation(World()), runtime, tick_seconds=3600
    )
    manager.start()
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            probe = {"tcp": {"port": listener.getsockname()[1]}, "period_seconds": 1}
            slot_id = manager.allocate(
                parse_slot_request(
                    {**guaranteed(cpus=1), "worker": {"command": ["sleep"], "readiness": probe}}
                )
            ).slot.id
            wait_for(lambda: worker(manager, slot_id)["phase"] == "running")
    finally:
        manager.close()
