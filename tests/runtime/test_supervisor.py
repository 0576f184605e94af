"""The supervisor's state machine on a fake clock, with fake workers, probes and cgroup."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import pytest

from nodeagent.errors import WorkerError
from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.probes import ProbeResult
from nodeagent.runtime.process import ExitRecord
from nodeagent.runtime.supervisor import (
    DEFINITE_BACKOFF_MAX_SECONDS,
    Backoff,
    Phase,
    Supervisor,
    startup_interval,
)
from nodeagent.schema.worker import HttpCheck, Probe, RestartPolicy, TcpCheck, WorkerSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeWorker:
    pid: int
    signals: list[int] = field(default_factory=list)
    exit: ExitRecord | None = None
    closed: bool = False

    def poll(self, now: float | None = None) -> ExitRecord | None:
        return self.exit

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def close(self) -> None:
        self.closed = True


class FakeLauncher:
    def __init__(self) -> None:
        self.launched: list[FakeWorker] = []
        self.requests: list[LaunchRequest] = []
        self.fail_with: str | None = None

    def launch(self, req: LaunchRequest) -> FakeWorker:
        self.requests.append(req)
        if self.fail_with:
            raise WorkerError(self.fail_with)
        worker = FakeWorker(pid=100 + len(self.launched))
        self.launched.append(worker)
        return worker

    @property
    def current(self) -> FakeWorker:
        return self.launched[-1]


class FakeCgroup:
    def __init__(self) -> None:
        self.oom_kills = 0
        self.kills = 0
        self.tasks: list[int] = []
        self.signals: list[tuple[int, int]] = []

    def kill_all(self, timeout: float) -> None:
        self.kills += 1
        self.tasks = []

    def signal_all(self, sig: int, but: int | None = None) -> None:
        self.signals.extend((pid, sig) for pid in self.tasks if pid != but)

    def oom_kill_count(self) -> int:
        return self.oom_kills

    def pids(self) -> list[int]:
        return list(self.tasks)


def exited(code: int | None = None, sig: int | None = None) -> ExitRecord:
    return ExitRecord(code, sig, False, 0.0, "exited" if sig is None else "signaled")


HTTP = Probe(http=HttpCheck(port=8000), period_seconds=1.0, failure_threshold=2)
TEMPLATE = LaunchRequest(launch_id="slot-a", argv=("worker",), env={}, run_dir="/run", log_dir="/logs")


def make(spec: WorkerSpec, probe_results: list[bool] | list[ProbeResult] | None = None, **kw):
    clock, launcher, cgroup = Clock(), FakeLauncher(), FakeCgroup()
    results = probe_results if probe_results is not None else []
    checked: list[Probe] = []

    def check(probe: Probe, host: str) -> bool | ProbeResult:
        checked.append(probe)
        return results.pop(0) if results else True

    sup = Supervisor(
        spec,
        TEMPLATE,
        launcher,
        cgroup,
        clock=clock,
        check=check,
        backoff=kw.pop("backoff", Backoff(initial_seconds=1.0)),
    )
    return sup, clock, launcher, cgroup, checked


def test_a_supervisor_and_its_status_carry_no_instance_dict():
    # One of each per slot: a dict each was ~1.5 KB of the daemon's memory per slot at 500 slots.
    sup, _, _, _, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    assert not hasattr(sup, "__dict__")
    assert not hasattr(sup.tick(), "__dict__")


def test_running_only_once_ready():
    sup, clock, _, _, _ = make(WorkerSpec(command=("w",), readiness=HTTP), probe_results=[False, True])
    sup.start()
    assert sup.tick().phase is Phase.STARTING  # first probe failed
    clock.now += 1.0
    assert sup.tick().phase is Phase.RUNNING


def test_a_slow_starter_is_probed_at_its_startup_period_until_first_ready_then_every_period():
    slow = Probe(
        http=HttpCheck(port=8000), period_seconds=10.0, startup_period_seconds=1.0, failure_threshold=3
    )
    sup, clock, _, _, checked = make(
        WorkerSpec(command=("w",), readiness=slow), probe_results=[False, False, True, True]
    )
    sup.start()
    phases = []
    for _ in range(3):
        phases.append(sup.tick().phase)
        clock.now += 1.0
    assert phases == [Phase.STARTING, Phase.STARTING, Phase.RUNNING]
    clock.now += 5.0  # not yet due: once ready, the probe's own 10 s period applies
    sup.tick()
    assert len(checked) == 3
    clock.now += 5.0
    sup.tick()
    assert len(checked) == 4


def test_by_default_a_starting_worker_is_probed_every_50_ms():
    sup, _, _, _, _ = make(
        WorkerSpec(command=("w",), readiness=Probe(http=HttpCheck(port=8000))), probe_results=[False]
    )
    sup.start()
    sup.tick()
    assert sup.due_in() == pytest.approx(0.05)


def test_readiness_loss_makes_it_unready_then_running_again():
    sup, clock, _, _, _ = make(
        WorkerSpec(command=("w",), readiness=HTTP), probe_results=[True, False, False, True]
    )
    sup.start()
    phases = []
    for _ in range(4):
        phases.append(sup.tick().phase)
        clock.now += 1.0
    assert phases == [Phase.RUNNING, Phase.RUNNING, Phase.UNREADY, Phase.RUNNING]


@pytest.mark.parametrize(
    ("policy", "record", "phase"),
    [
        pytest.param(RestartPolicy.NEVER, exited(0), Phase.EXITED, id="never-success"),
        pytest.param(RestartPolicy.NEVER, exited(3), Phase.FAILED, id="never-failure"),
        pytest.param(RestartPolicy.ON_FAILURE, exited(0), Phase.EXITED, id="on-failure-success"),
        pytest.param(RestartPolicy.ON_FAILURE, exited(3), Phase.BACKOFF, id="on-failure-failure"),
        pytest.param(
            RestartPolicy.ON_FAILURE, exited(sig=signal.SIGSEGV), Phase.BACKOFF, id="on-failure-crash"
        ),
        pytest.param(RestartPolicy.ALWAYS, exited(0), Phase.BACKOFF, id="always-success"),
    ],
)
def test_restart_policy(policy, record, phase):
    sup, _, launcher, _, _ = make(WorkerSpec(command=("w",), restart=policy))
    sup.start()
    launcher.current.exit = record
    status = sup.tick()
    assert status.phase is phase
    assert status.last_exit == record
    assert launcher.current.closed


def test_crashing_worker_backs_off_exponentially_then_crashloops():
    sup, clock, launcher, _, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    delays, phases = [], []
    for _ in range(5):
        launcher.current.exit = exited(1)
        status = sup.tick()
        delays.append(status.next_restart_in)
        phases.append(status.phase)
        clock.now += status.next_restart_in - 0.001
        assert sup.tick().phase is status.phase  # not yet
        clock.now += 0.001
        assert sup.tick().phase is Phase.RUNNING
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert phases == [Phase.BACKOFF, Phase.BACKOFF, Phase.CRASHLOOP, Phase.CRASHLOOP, Phase.CRASHLOOP]
    assert len(launcher.launched) == 6
    assert [r.launch_id for r in launcher.requests[:2]] == ["slot-a-1", "slot-a-2"]


def test_backoff_resets_after_a_long_healthy_run():
    sup, clock, launcher, _, _ = make(
        WorkerSpec(command=("w",)), backoff=Backoff(initial_seconds=1.0, reset_after_seconds=60)
    )
    sup.start()
    launcher.current.exit = exited(1)
    clock.now += sup.tick().next_restart_in
    sup.tick()
    clock.now += 61
    launcher.current.exit = exited(1)
    assert sup.tick().next_restart_in == 1.0


def test_liveness_failure_stops_gracefully_then_kills_the_slot():
    liveness = Probe(tcp=TcpCheck(port=1), period_seconds=1.0, failure_threshold=2)
    spec = WorkerSpec(command=("w",), liveness=liveness, stop_grace_seconds=5)
    sup, clock, launcher, cgroup, _ = make(spec, probe_results=[False, False])
    sup.start()
    worker = launcher.current
    assert sup.tick().phase is Phase.RUNNING
    clock.now += 1
    assert sup.tick().phase is Phase.STOPPING
    assert worker.signals == [signal.SIGTERM]
    clock.now += 4.9
    sup.tick()
    assert cgroup.kills == 0
    clock.now += 0.1
    sup.tick()
    assert cgroup.kills == 1
    worker.exit = exited(sig=signal.SIGKILL)
    status = sup.tick()
    assert status.phase is Phase.BACKOFF
    assert "liveness probe failed" in status.message


def test_liveness_kill_counts_as_failure_even_with_a_clean_exit():
    liveness = Probe(tcp=TcpCheck(port=1), period_seconds=1.0, failure_threshold=1)
    sup, _, launcher, _, _ = make(WorkerSpec(command=("w",), liveness=liveness), probe_results=[False])
    sup.start()
    sup.tick()
    launcher.current.exit = exited(0)
    assert sup.tick().phase is Phase.BACKOFF


def test_stop_ends_in_stopped_and_kills_leftover_helpers():
    sup, _, launcher, cgroup, _ = make(WorkerSpec(command=("w",), restart=RestartPolicy.ALWAYS))
    sup.start()
    cgroup.tasks = [100, 101]
    sup.stop()
    assert sup.tick().phase is Phase.STOPPING
    launcher.current.exit = exited(sig=signal.SIGTERM)
    status = sup.tick()
    assert status.phase is Phase.STOPPED
    assert cgroup.kills == 1
    assert len(launcher.launched) == 1


def test_stop_during_backoff_cancels_the_restart():
    sup, clock, launcher, _, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    launcher.current.exit = exited(1)
    sup.tick()
    sup.stop()
    clock.now += 100
    assert sup.tick().phase is Phase.STOPPED
    assert len(launcher.launched) == 1


def test_sigkill_with_a_new_oom_kill_in_the_slot_is_an_oom():
    sup, _, launcher, cgroup, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    cgroup.oom_kills = 1
    launcher.current.exit = exited(sig=signal.SIGKILL)
    status = sup.tick()
    assert status.last_exit is not None
    assert (status.last_exit.oom_killed, status.last_exit.reason) == (True, "oom-killed")
    assert "OOM" in status.message


@pytest.mark.parametrize("policy", list(RestartPolicy))
def test_a_launch_failure_fails_at_once_whatever_the_policy(policy):
    sup, clock, launcher, _, _ = make(WorkerSpec(command=("w",), restart=policy))
    launcher.fail_with = "exec w: No such file"
    sup.start()
    status = sup.status()
    assert status.phase is Phase.FAILED
    assert "launch failed: exec w: No such file" in status.message
    assert status.next_restart_in is None
    clock.now += 600
    assert sup.tick().phase is Phase.FAILED  # never retried silently
    assert len(launcher.launched) == 0


def test_an_exit_0_before_the_worker_was_ever_ready_is_a_failure():
    sup, _, launcher, _, _ = make(
        WorkerSpec(command=("w",), readiness=HTTP, restart=RestartPolicy.ON_FAILURE), probe_results=[False]
    )
    sup.start()
    launcher.launched[-1].exit = exited(0)
    status = sup.tick()
    assert status.phase is Phase.BACKOFF
    assert "exited with status 0 before it was ever ready" in status.message


def test_a_worker_not_ready_by_its_startup_timeout_is_stopped_and_counted_as_failed():
    spec = WorkerSpec(
        command=("w",), readiness=HTTP, startup_timeout_seconds=5, stop_grace_seconds=1, restart="on-failure"
    )
    sup, clock, launcher, _, _ = make(spec, probe_results=[False] * 20)
    sup.start()
    for _ in range(5):
        clock.now += 1.0
        status = sup.tick()
    assert status.phase is Phase.STOPPING
    assert "not ready within its startup timeout of 5s" in status.message
    assert signal.SIGTERM in launcher.launched[-1].signals
    launcher.launched[-1].exit = exited(sig=signal.SIGTERM)
    status = sup.tick()
    assert status.phase is Phase.BACKOFF
    assert status.consecutive_failures == 1


def test_the_exit_after_a_startup_timeout_reads_as_the_agents_stop_not_as_the_workers_verdict():
    spec = WorkerSpec(command=("w",), readiness=HTTP, startup_timeout_seconds=2, restart="never")
    sup, clock, launcher, _, _ = make(spec, probe_results=[False] * 20)
    sup.start()
    for _ in range(3):
        clock.now += 1.0
        sup.tick()
    launcher.launched[-1].exit = exited(0)  # a server that handles SIGTERM well exits 0
    status = sup.tick()
    assert status.phase is Phase.FAILED
    assert status.last_exit is not None
    assert status.last_exit.stopped_by == "not ready within its startup timeout of 2s"
    assert status.last_exit.describe() == (
        "stopped by the agent (not ready within its startup timeout of 2s), then exited with status 0"
    )
    assert ExitRecord.from_json(status.last_exit.to_json()) == status.last_exit


NOT_FOUND = ProbeResult(False, True, "GET /v2/models/m/ready: HTTP 404", 0.0)
REFUSED = ProbeResult(False, False, "connection refused: nothing listens on 127.0.0.1:8000", 0.0)


@pytest.mark.parametrize(
    ("definite_in_row", "interval"),
    [(0, 0.05), (1, 0.05), (20, 0.05), (21, 0.1), (22, 0.2), (23, 0.4), (24, 0.8), (25, 1.0), (80, 1.0)],
)
def test_the_startup_probe_backs_off_while_the_server_answers_not_ready(definite_in_row, interval):
    assert startup_interval(Probe(http=HttpCheck(port=8000)), definite_in_row) == pytest.approx(interval)


def test_the_back_off_never_makes_the_startup_probe_slower_than_its_period_or_faster_than_its_start():
    probe = Probe(http=HttpCheck(port=8000), period_seconds=0.3, startup_period_seconds=0.05)
    assert startup_interval(probe, 60) == DEFINITE_BACKOFF_MAX_SECONDS  # the caller keeps the period
    slow_start = Probe(http=HttpCheck(port=8000), startup_period_seconds=2.0, period_seconds=10)
    assert startup_interval(slow_start, 60) == 2.0


def test_a_server_that_answers_not_ready_is_asked_less_often_one_that_is_not_listening_as_often():
    probe = Probe(http=HttpCheck(port=8000), period_seconds=10.0)
    for results, expected in ((NOT_FOUND, 1.0), (REFUSED, 0.05)):
        sup, clock, _, _, checked = make(
            WorkerSpec(command=("w",), readiness=probe), probe_results=[results] * 2000
        )
        sup.start()
        start = clock.now
        first_second = 0
        while clock.now < start + 20.0:
            sup.tick()
            clock.now += 0.01
            if clock.now - start < 1.0:
                first_second = len(checked)
            elif clock.now - start < 10.0:
                settled = len(checked)
        assert first_second == pytest.approx(20, abs=2)  # the grace: as often as at any start
        per_second = (len(checked) - settled) / 10.0
        assert per_second == pytest.approx(1 / expected, rel=0.25), per_second
        status = sup.status()
        assert status.last_probe == results
        assert status.ready_when == "probe"
        assert status.to_json()["last_probe"]["detail"] == results.detail


def test_a_worker_without_a_readiness_probe_is_running_once_started_and_says_so():
    sup, _, _, _, _ = make(WorkerSpec(command=("w",)))
    sup.start()
    status = sup.tick()
    assert (status.phase, status.ready_when, status.last_probe) == (Phase.RUNNING, "started", None)


def test_an_adopted_worker_without_a_readiness_probe_is_running_at_once():
    sup, _, _, _, _ = make(WorkerSpec(command=("w",)))
    sup.resume(FakeWorker(pid=77))
    assert sup.status().phase is Phase.RUNNING


def test_an_adopted_worker_with_a_readiness_probe_is_checked_at_the_first_tick():
    slow = Probe(http=HttpCheck(port=8000), period_seconds=10.0, initial_delay_seconds=30.0)
    sup, _, _, _, _ = make(WorkerSpec(command=("w",), readiness=slow), probe_results=[True])
    sup.resume(FakeWorker(pid=77))
    assert sup.status().phase is Phase.STARTING
    assert sup.due_in() == 0
    assert sup.tick().phase is Phase.RUNNING


def test_resume_exited_applies_the_policy():
    sup, _, launcher, _, _ = make(WorkerSpec(command=("w",), restart=RestartPolicy.ON_FAILURE))
    sup.resume_exited(exited(sig=signal.SIGKILL))
    assert sup.status().phase is Phase.BACKOFF
    assert launcher.launched == []


def test_a_launch_first_empties_the_slot_of_what_nobody_knows():
    sup, _, launcher, cgroup, _ = make(WorkerSpec(command=("w",)))
    cgroup.tasks = [4242]  # say a worker that exec'd as its keeper died, before custody
    sup.start()
    assert cgroup.kills == 1
    assert cgroup.pids() == []
    assert len(launcher.launched) == 1
