"""Stopping a worker on a fake clock: the spec's stop signal to the main process and (scope "slot")
to every other process in the slot, drain before the signal for a worker that served, the pre_stop
hook before the signal (in the probe pool or inline), SIGKILL after the grace."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from nodeagent.errors import InvalidRequest
from nodeagent.runtime.ports import bind
from nodeagent.runtime.supervisor import Phase, Supervisor
from nodeagent.schema.worker import Probe, WorkerSpec, parse_worker_spec
from tests.runtime.test_supervisor import TEMPLATE, Clock, FakeCgroup, FakeLauncher, exited

READY = {"http": {"port": 8000}, "period_seconds": 1.0}


Made = tuple[Supervisor, Clock, FakeLauncher, FakeCgroup, list[Probe]]


def make(check_results: list[bool] | None = None, **spec: Any) -> Made:
    clock, launcher, cgroup = Clock(), FakeLauncher(), FakeCgroup()
    checked: list[Probe] = []
    results = check_results if check_results is not None else []

    def check(probe: Probe, host: str) -> bool:
        checked.append(probe)
        return results.pop(0) if results else True

    worker = parse_worker_spec({"command": ["w"], **spec})
    sup = Supervisor(worker, TEMPLATE, launcher, cgroup, clock=clock, check=check)
    return sup, clock, launcher, cgroup, checked


def running(sup: Supervisor, cgroup: FakeCgroup, launcher: FakeLauncher) -> None:
    sup.start()
    cgroup.tasks = [launcher.current.pid, 4242]  # the worker and a helper it forked
    assert sup.tick().phase is Phase.RUNNING


def test_the_stop_signal_goes_to_the_main_process_and_each_other_process_once() -> None:
    sup, _, launcher, cgroup, _ = make(stop_signal="SIGQUIT")
    running(sup, cgroup, launcher)
    sup.stop()
    assert launcher.current.signals == [signal.SIGQUIT]
    assert cgroup.signals == [(4242, signal.SIGQUIT)]


def test_scope_main_signals_the_main_process_alone() -> None:
    sup, _, launcher, cgroup, _ = make(stop_signal="INT", stop_scope="main")
    running(sup, cgroup, launcher)
    sup.stop()
    assert launcher.current.signals == [signal.SIGINT]
    assert cgroup.signals == []


def test_drain_shows_the_worker_unready_at_once_and_signals_it_after() -> None:
    sup, clock, launcher, cgroup, _ = make(readiness=READY, drain_seconds=5, stop_grace_seconds=2)
    running(sup, cgroup, launcher)
    sup.stop()
    assert sup.status().phase is Phase.STOPPING  # no longer running: balancers move away now
    assert "draining for 5s" in sup.message
    assert launcher.current.signals == []
    assert sup.due_in() == pytest.approx(5.0)
    clock.now += 4.9
    sup.tick()
    assert launcher.current.signals == []
    clock.now += 0.1
    sup.tick()
    assert launcher.current.signals == [signal.SIGTERM]
    assert sup.due_in() == pytest.approx(2.0)
    clock.now += 2.0
    sup.tick()
    assert cgroup.kills == 1  # grace over: SIGKILL to the slot
    launcher.current.exit = exited(sig=signal.SIGKILL)
    assert sup.tick().phase is Phase.STOPPED


def test_a_worker_that_never_served_is_not_drained() -> None:
    sup, _, launcher, _, _ = make([False], readiness=READY, drain_seconds=5)
    sup.start()
    assert sup.tick().phase is Phase.STARTING
    sup.stop()
    assert launcher.current.signals == [signal.SIGTERM]


def test_pre_stop_runs_before_the_signal_and_a_failing_one_does_not_stop_the_stop() -> None:
    hook = {"exec": {"argv": ["/bin/drain"]}, "timeout_seconds": 3}
    sup, _, launcher, cgroup, checked = make([False], pre_stop=hook)
    running(sup, cgroup, launcher)
    sup.stop()
    assert [p.argv for p in checked] == [("/bin/drain",)]
    assert checked[0].timeout_seconds == 3
    assert launcher.current.signals == [signal.SIGTERM]
    assert "pre_stop failed or timed out" in sup.message


def test_in_the_probe_pool_the_signal_waits_for_the_hook_or_its_timeout() -> None:
    release = threading.Event()

    def check(probe: Probe, host: str) -> bool:
        release.wait()
        return True

    clock, launcher, cgroup = Clock(), FakeLauncher(), FakeCgroup()
    spec = parse_worker_spec({"command": ["w"], "pre_stop": {"exec": {"argv": ["x"]}, "timeout_seconds": 10}})
    sup = Supervisor(spec, TEMPLATE, launcher, cgroup, clock=clock, check=check)
    woken = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sup.attach(pool, woken.set)
        running(sup, cgroup, launcher)
        sup.stop()
        assert launcher.current.signals == []
        assert sup.due_in() == pytest.approx(10.0)  # the hook's timeout
        release.set()
        assert woken.wait(30)
        sup.tick()
        assert launcher.current.signals == [signal.SIGTERM]
        assert "pre_stop done" in sup.message


def test_a_hook_past_its_timeout_no_longer_holds_the_signal() -> None:
    release = threading.Event()

    def check(probe: Probe, host: str) -> bool:
        release.wait()
        return True

    clock, launcher, cgroup = Clock(), FakeLauncher(), FakeCgroup()
    spec = parse_worker_spec({"command": ["w"], "pre_stop": {"exec": {"argv": ["x"]}, "timeout_seconds": 2}})
    sup = Supervisor(spec, TEMPLATE, launcher, cgroup, clock=clock, check=check)
    with ThreadPoolExecutor(1) as pool:
        sup.attach(pool, lambda: None)
        running(sup, cgroup, launcher)
        sup.stop()
        clock.now += 2.0
        sup.tick()
        assert launcher.current.signals == [signal.SIGTERM]
        release.set()


@pytest.mark.parametrize(
    ("given", "name"), [("SIGTERM", "SIGTERM"), ("term", "SIGTERM"), ("QUIT", "SIGQUIT"), (2, "SIGINT")]
)
def test_stop_signal_names(given: Any, name: str) -> None:
    assert parse_worker_spec({"command": ["w"], "stop_signal": given}).stop_signal == name


@pytest.mark.parametrize(("given", "words"), [("SIGSTOP", "does not stop"), ("SIGFOO", "unknown signal")])
def test_bad_stop_signals(given: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_worker_spec({"command": ["w"], "stop_signal": given})


def test_a_pre_stop_hook_needs_exactly_one_action() -> None:
    with pytest.raises(InvalidRequest, match="exactly one of 'http' or 'exec'"):
        parse_worker_spec({"command": ["w"], "pre_stop": {"timeout_seconds": 1}})


def test_a_pre_stop_request_may_name_a_port() -> None:
    spec = parse_worker_spec(
        {"command": ["w"], "ports": {"http": {}}, "pre_stop": {"http": {"port": "http", "path": "/drain"}}}
    )
    bound = bind(spec, {"http": 20005})
    assert bound.pre_stop is not None
    assert bound.pre_stop.http is not None
    assert bound.pre_stop.http.port == 20005
    with pytest.raises(InvalidRequest, match="pre_stop names port 'admin'"):
        bind(parse_worker_spec({"command": ["w"], "pre_stop": {"http": {"port": "admin", "path": "/"}}}), {})


def test_the_worker_spec_keeps_its_defaults() -> None:
    spec = WorkerSpec(command=("w",))
    defaults = (spec.stop_signal, spec.stop_scope, spec.pre_stop, spec.drain_seconds)
    assert defaults == ("SIGTERM", "slot", None, 0.0)
