"""What a supervisor tells the loop about itself: when it next has timed work, and which fd says
its worker exited (fake clock and workers, as in test_supervisor.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from nodeagent.runtime.supervisor import Backoff, Phase, Supervisor
from nodeagent.schema.worker import HttpCheck, Probe, RestartPolicy, WorkerSpec
from tests.runtime.test_supervisor import TEMPLATE, Clock, FakeCgroup, FakeLauncher, FakeWorker, exited, make

SLOW_HTTP = Probe(http=HttpCheck(port=8000), period_seconds=10.0, initial_delay_seconds=3.0)


@pytest.mark.parametrize(
    ("spec", "due"),
    [
        pytest.param(WorkerSpec(command=("w",)), None, id="no-probes-nothing-timed"),
        pytest.param(
            WorkerSpec(command=("w",), readiness=SLOW_HTTP), 3.0, id="readiness-after-initial-delay"
        ),
        pytest.param(WorkerSpec(command=("w",), liveness=SLOW_HTTP), 3.0, id="liveness-after-initial-delay"),
    ],
)
def test_a_started_worker_is_due_when_its_first_probe_is(spec: WorkerSpec, due: float | None) -> None:
    sup, _, _, _, _ = make(spec)
    sup.start()
    assert sup.due_in() == due


def test_after_a_probe_the_next_is_due_a_period_later() -> None:
    sup, clock, _, _, _ = make(WorkerSpec(command=("w",), readiness=SLOW_HTTP), probe_results=[True])
    sup.start()
    clock.now += 3.0
    assert sup.tick().phase is Phase.RUNNING
    assert sup.due_in() == 10.0
    clock.now += 4.0
    assert sup.due_in() == 6.0


def test_a_stopping_worker_is_due_at_the_end_of_its_grace_period_then_no_more() -> None:
    sup, clock, _, _, _ = make(WorkerSpec(command=("w",), stop_grace_seconds=5.0))
    sup.start()
    sup.stop()
    assert sup.due_in() == 5.0
    clock.now += 5.0
    assert sup.due_in() == 0.0
    sup.tick()  # kills the slot's processes; only the exit is left to wait for
    assert sup.due_in() is None


def test_a_worker_in_backoff_is_due_when_its_restart_is() -> None:
    sup, clock, launcher, _, _ = make(
        WorkerSpec(command=("w",), restart=RestartPolicy.ALWAYS), backoff=Backoff(initial_seconds=4.0)
    )
    sup.start()
    launcher.current.exit = exited(1)
    assert sup.tick().phase is Phase.BACKOFF
    assert sup.due_in() == 4.0
    clock.now += 4.0
    assert sup.due_in() == 0.0
    assert sup.tick().phase is Phase.RUNNING
    assert sup.due_in() is None


@pytest.mark.parametrize(
    ("policy", "code"),
    [
        pytest.param(RestartPolicy.NEVER, 1, id="failed"),
        pytest.param(RestartPolicy.ON_FAILURE, 0, id="exited"),
    ],
)
def test_a_worker_that_ended_for_good_has_nothing_due(policy: RestartPolicy, code: int) -> None:
    sup, _, launcher, _, _ = make(WorkerSpec(command=("w",), restart=policy))
    sup.start()
    launcher.current.exit = exited(code)
    sup.tick()
    assert sup.due_in() is None
    assert sup.exit_fd() is None


@dataclass
class WaitableWorker(FakeWorker):
    exit_fd: int | None = None


class WaitableLauncher(FakeLauncher):
    def launch(self, req):  # type: ignore[no-untyped-def]
        worker = WaitableWorker(pid=200 + len(self.launched), exit_fd=40 + len(self.launched))
        self.launched.append(worker)
        return worker


def test_exit_fd_is_the_live_workers_and_changes_with_a_restart() -> None:
    clock, launcher = Clock(), WaitableLauncher()
    spec = WorkerSpec(command=("w",), restart=RestartPolicy.ALWAYS)
    sup = Supervisor(
        spec, TEMPLATE, launcher, FakeCgroup(), clock=clock, backoff=Backoff(initial_seconds=1.0)
    )
    assert sup.exit_fd() is None
    sup.start()
    assert sup.exit_fd() == 40
    launcher.current.exit = exited(1)
    sup.tick()
    assert sup.exit_fd() is None  # in backoff: nothing alive to wait on
    clock.now += 1.0
    sup.tick()
    assert sup.exit_fd() == 41


def test_a_handle_without_an_exit_fd_offers_none() -> None:
    sup, _, _, _, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    assert sup.phase is Phase.RUNNING
    assert sup.exit_fd() is None
