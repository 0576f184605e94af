"""The controller reporter against a real HTTP server run by the test: registration, heartbeats,
coalescing, an outage with backoff and a recovery, and a controller that hangs.

Time: the outage test drives the reporter with a fake clock advanced by its own waits, so backoff
delays are asserted exactly, whatever the machine's speed. Elsewhere real time is used with
bounded waits only (``wait_for``), never assertions on how fast something happened.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodeagent.agent.reporter import (
    HEARTBEAT_SCHEMA,
    REGISTER_SCHEMA,
    Reporter,
    ReporterConfig,
    backoff_delay,
    next_epoch,
)
from nodeagent.agent.service import NodeInfo
from nodeagent.agent.slot import Slot, SlotState
from nodeagent.devices.synthetic import synthetic_topology
from nodeagent.devices.topology import Topology
from nodeagent.errors import ConfigError
from nodeagent.placement import Assignment
from nodeagent.runtime.supervisor import Phase, WorkerStatus
from nodeagent.schema.request import parse_slot_request

BOUND = 10.0  # seconds: generous upper bound for anything that should happen "soon"


def wait_for(predicate: Callable[[], bool], timeout: float = BOUND) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.005)


# --------------------------------------------------------------------------- a recording controller


@dataclass
class Received:
    path: str
    body: dict[str, Any]
    authorization: str | None
    status: int


@dataclass
class ControllerState:
    """What the fake controller knows and how it behaves; shared by its restarts."""

    mode: str = "ok"  # ok | 503 | hang
    hang_seconds: float = 3.0
    requests: list[Received] = field(default_factory=list)
    registered: set[str] = field(default_factory=set)
    latest: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (epoch, sequence)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def heartbeats(self) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path.endswith("/heartbeat")]

    def paths(self) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests]


def _handler(state: ControllerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if state.mode == "hang":
                state.release.wait(state.hang_seconds)
            status = self._decide(body)
            with state.lock:
                state.requests.append(Received(self.path, body, self.headers.get("Authorization"), status))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _decide(self, body: dict[str, Any]) -> int:
            # What a controller should do with the protocol: drop stale reports, ask to register.
            if state.mode == "503":
                return 503
            node = body["node_id"]
            key = (body["instance"]["epoch"], body["sequence"])
            with state.lock:
                if key <= state.latest.get(node, (-1, -1)):
                    return 409
                if self.path == "/v1/nodes/register":
                    state.registered.add(node)
                elif node not in state.registered:
                    return 404
                state.latest[node] = key
            return 204

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


class Controller:
    """A ThreadingHTTPServer on 127.0.0.1 that can be stopped and started again on the same port.

    A restart keeps ``state.requests`` (the test's record) but forgets registrations, like a
    controller that lost its memory."""

    def __init__(self, state: ControllerState) -> None:
        self.state = state
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.state.registered.clear()
        self.state.release.clear()
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self.state))
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self.state.release.set()  # let hanging handlers finish
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join(BOUND)
        self._server = None


@pytest.fixture
def controller() -> Iterator[Controller]:
    c = Controller(ControllerState())
    c.start()
    yield c
    c.stop()


# --------------------------------------------------------------------------- a fake service


def slot(slot_id: str, name: str, state: SlotState, phase: str | None) -> Slot:
    return Slot(
        id=slot_id,
        name=name,
        state=state,
        request=parse_slot_request({"name": name, "qos": "guaranteed", "resources": {"cpus": 2}}),
        assignment=Assignment(
            name=name,
            qos="guaranteed",
            cpus=(2, 3),
            exclusive=True,
            cpu_quota_millis=0,
            numa_nodes=(0,),
            memory_bytes=1 << 30,
            memory_by_node={},
            gpus=(0,),
            gpu_uuids=("GPU-0",),
        ),
        worker=None if phase is None else WorkerStatus(Phase(phase), 42, 0, 0, None, None, phase),
        created_at=1.0,
        updated_at=2.0,
    )


class FakeService:
    """The slice of SlotService the reporter uses; ``change()`` plays the slot manager."""

    def __init__(self) -> None:
        self.topo: Topology = synthetic_topology(2, 1, 2, 2, gpus_per_numa=1, mig={1: ["1g.10gb"]})
        self.slots = [
            slot("s1", "web", SlotState.RUNNING, "running"),
            slot("s2", "batch", SlotState.READY, None),
        ]
        self.callbacks: list[Callable[[], None]] = []

    def node(self) -> NodeInfo:
        return NodeInfo("node-natest", "natest-host", "0.1.0", 100.0, "v1", ("no resctrl",))

    def topology(self) -> Topology:
        return self.topo

    def capacity(self) -> dict[str, Any]:
        return {"resources": {"cpus": {"total": 8, "free": 6}}, "by_numa": {}, "shared_pool": {}}

    def list_slots(self) -> list[Slot]:
        return list(self.slots)

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

    def change(self) -> None:
        for cb in self.callbacks:
            cb()


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def make_reporter(service: FakeService, tmp_path: Path) -> Iterator[Callable[..., Reporter]]:
    made: list[Reporter] = []

    def make(url: str, **kwargs: Any) -> Reporter:
        hooks = {
            k: kwargs.pop(k) for k in ("clock", "wait", "rand", "on_success", "on_failure") if k in kwargs
        }
        config = ReporterConfig(url=url, epoch_file=tmp_path / "epoch", **kwargs)
        reporter = Reporter(config, service, **hooks)  # type: ignore[arg-type]
        made.append(reporter)
        return reporter

    yield make
    for r in made:
        r.stop(timeout=BOUND)


def order(r: Received) -> tuple[int, int]:
    return (r.body["instance"]["epoch"], r.body["sequence"])


# --------------------------------------------------------------------------- tests


def test_registers_then_heartbeats_with_the_documented_bodies(
    controller: Controller, make_reporter: Callable[..., Reporter]
) -> None:
    reporter = make_reporter(controller.url, token="natest-token", interval_seconds=3600)
    reporter.start()
    wait_for(lambda: len(controller.state.requests) >= 2)

    register, heartbeat = controller.state.requests[:2]
    assert [register.path, heartbeat.path] == ["/v1/nodes/register", "/v1/nodes/node-natest/heartbeat"]
    assert register.authorization == heartbeat.authorization == "Bearer natest-token"
    assert register.status == heartbeat.status == 204

    r = register.body
    assert r["schema"] == REGISTER_SCHEMA
    assert (r["node_id"], r["hostname"], r["agent_version"]) == ("node-natest", "natest-host", "0.1.0")
    assert r["degraded"] == ["no resctrl"]
    topo = r["topology"]
    assert (topo["sockets"], topo["cpus"], topo["cores"], topo["threads_per_core"]) == (2, 8, 4, 2)
    assert [n["cpus"] for n in topo["numa_nodes"]] == [4, 4]
    assert [g["numa"] for g in topo["gpus"]] == [0, 1]
    assert topo["gpus"][1]["mig"]["instances"][0]["profile"] == "1g.10gb"

    h = heartbeat.body
    assert h["schema"] == HEARTBEAT_SCHEMA
    assert h["instance"] == r["instance"]
    assert h["sequence"] > r["sequence"]
    assert h["capacity"]["resources"]["cpus"]["free"] == 6
    assert [d["kind"] for d in h["device_health"]] == ["gpu", "gpu"]
    assert [(s["id"], s["state"], s["worker_phase"], s["cpus"], s["gpus"]) for s in h["slots"]] == [
        ("s1", "running", "running", "2-3", ["GPU-0"]),
        ("s2", "ready", None, "2-3", ["GPU-0"]),
    ]
    wait_for(lambda: reporter.status()["last_success"] is not None)  # the reply is read after we log it
    status = reporter.status()
    assert status["registered"] is True
    assert status["consecutive_failures"] == 0
    assert status["last_success"] is not None


class ManualClock:
    """Time that moves only when the test says so; the reporter's waits are short real polls."""

    def __init__(self) -> None:
        self.now = 1000.0

    def clock(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(min(timeout, 0.01))


def test_twenty_changes_within_the_window_become_one_report(
    controller: Controller, make_reporter: Callable[..., Reporter], service: FakeService
) -> None:
    time_ = ManualClock()
    reporter = make_reporter(
        controller.url, interval_seconds=3600, coalesce_seconds=0.5, clock=time_.clock, wait=time_.wait
    )
    reporter.start()
    wait_for(lambda: len(controller.state.heartbeats()) == 1)

    for _ in range(20):
        service.change()  # the reporter subscribed itself on start
        time.sleep(0.01)  # the reporter thread gets to run between changes
        time_.now += 0.02  # 20 changes in 0.4 s of the reporter's time: inside one window
    time.sleep(0.2)
    assert len(controller.state.heartbeats()) == 1, "reported before the coalescing window closed"

    time_.now += 0.2  # past the window's end, 0.5 s after the first change
    wait_for(lambda: len(controller.state.heartbeats()) == 2)
    time.sleep(0.2)
    assert len(controller.state.heartbeats()) == 2


def test_periodic_heartbeats_without_changes(
    controller: Controller, make_reporter: Callable[..., Reporter]
) -> None:
    reporter = make_reporter(controller.url, interval_seconds=0.05)
    reporter.start()
    wait_for(lambda: len(controller.state.heartbeats()) >= 4)
    sequences = [order(h) for h in controller.state.heartbeats()]
    assert sequences == sorted(set(sequences))


class FakeTime:
    """A clock that only moves when the reporter waits, and records each distinct backoff wait.

    At the start of every backoff wait it also reports a change, as a busy API would: a change
    must not cut the backoff short."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.backoff_waits: dict[int, float] = {}  # consecutive failures -> first wait requested
        self.reporter: Reporter | None = None

    def clock(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        assert self.reporter is not None
        if timeout >= 100:
            return event.wait(0.05)  # the periodic wait: block for real, let time stand still
        failures = self.reporter.status()["consecutive_failures"]
        if failures and failures not in self.backoff_waits:
            self.backoff_waits[failures] = timeout
            self.reporter.notify_change()
        woken = event.wait(0.001)
        if not woken:
            self.now += timeout
        return woken


def test_outage_backs_off_with_full_jitter_and_recovery_resumes_in_order(
    controller: Controller, make_reporter: Callable[..., Reporter]
) -> None:
    fake = FakeTime()
    draws = [0.5, 0.9, 0.25, 0.999, 0.1, 0.75, 0.6, 0.3]
    drawn: list[float] = []

    def rand() -> float:
        drawn.append(draws[len(drawn)] if len(drawn) < len(draws) else 0.5)
        return drawn[-1]

    failed_at: list[float] = []
    successes: list[int] = []
    reporter = make_reporter(
        controller.url,
        interval_seconds=3600,
        backoff_initial=1.0,
        backoff_max=8.0,
        clock=fake.clock,
        wait=fake.wait,
        rand=rand,
        on_failure=lambda: failed_at.append(fake.now),
        on_success=lambda: successes.append(1),
    )
    fake.reporter = reporter
    reporter.start()
    wait_for(lambda: len(controller.state.heartbeats()) == 1)
    before_outage = len(controller.state.requests)

    # Outage 1: the controller answers 503.
    controller.state.mode = "503"
    reporter.notify_change()
    wait_for(lambda: reporter.status()["consecutive_failures"] >= 3)
    # Outage 2: the controller is gone (connection refused).
    controller.stop()
    wait_for(lambda: reporter.status()["consecutive_failures"] >= 8)

    caps = [1, 2, 4, 8, 8, 8, 8, 8]  # min(backoff_max, initial * 2**(n-1))
    expected = [cap * r for cap, r in zip(caps, draws, strict=False)]
    assert [fake.backoff_waits[n] for n in range(1, 9)] == pytest.approx(expected)
    assert all(0 <= w < cap for w, cap in zip(expected, caps, strict=True))
    # The reporter's time between failed attempts is exactly the backoff: changes did not hurry it.
    gaps = [b - a for a, b in itertools.pairwise(failed_at[:8])]
    assert gaps == pytest.approx(expected[:7])
    assert reporter.status()["last_error"] is not None

    # Recovery: a fresh controller on the same port, which has forgotten the node.
    controller.state.mode = "ok"
    controller.start()
    wait_for(lambda: reporter.status()["consecutive_failures"] == 0)
    wait_for(lambda: controller.state.paths()[-1].endswith("/heartbeat"))

    after = controller.state.requests[before_outage:]
    accepted = [r for r in after if r.status == 204]
    # The forgotten node is told 404, registers again, then heartbeats.
    assert [r.path for r in after if r.status != 503][-3:] == [
        "/v1/nodes/node-natest/heartbeat",
        "/v1/nodes/register",
        "/v1/nodes/node-natest/heartbeat",
    ]
    assert [r.status for r in after if r.status != 503][-3:] == [404, 204, 204]
    assert accepted
    everything = [order(r) for r in controller.state.requests]
    assert everything == sorted(everything)
    assert len(set(everything)) == len(everything), "sequence numbers must never repeat"
    assert len(successes) >= 2


def test_a_later_agent_start_outranks_every_report_of_the_earlier_one(
    controller: Controller, make_reporter: Callable[..., Reporter]
) -> None:
    first = make_reporter(controller.url, interval_seconds=0.02)
    first.start()
    wait_for(lambda: len(controller.state.heartbeats()) >= 3)
    first.stop(timeout=BOUND)
    second = make_reporter(controller.url, interval_seconds=3600)
    second.start()
    wait_for(
        lambda: len(controller.state.heartbeats()) >= 4 and controller.state.paths()[-1].endswith("beat")
    )

    assert second.epoch > first.epoch
    assert second.instance_id != first.instance_id
    statuses = {r.body["instance"]["id"]: r.status for r in controller.state.requests}
    assert statuses[second.instance_id] == 204  # its first sequence numbers are small, yet accepted


def test_notify_change_never_waits_for_a_hanging_controller(
    controller: Controller, make_reporter: Callable[..., Reporter]
) -> None:
    controller.state.mode = "hang"  # every request takes 3 s
    reporter = make_reporter(controller.url, interval_seconds=3600, timeout_seconds=10)
    reporter.start()
    time.sleep(0.3)  # the reporter is now (most likely) inside its register request

    started = time.monotonic()
    for _ in range(100):
        reporter.notify_change()
    status = reporter.status()
    elapsed = time.monotonic() - started

    assert elapsed < 1.5, f"notify_change/status took {elapsed:.2f}s: they waited on the controller"
    assert status["registered"] is False
    controller.state.release.set()
    wait_for(lambda: reporter.status()["registered"])


def test_stop_is_prompt_while_idle(controller: Controller, make_reporter: Callable[..., Reporter]) -> None:
    reporter = make_reporter(controller.url, interval_seconds=3600)
    reporter.start()
    wait_for(lambda: len(controller.state.heartbeats()) == 1)
    thread = reporter._thread
    reporter.stop(timeout=BOUND)
    assert thread is not None
    assert not thread.is_alive()
    assert reporter.status()["next_attempt"] is None


@pytest.mark.parametrize(
    ("failures", "rand", "expected"),
    [
        pytest.param(0, 0.5, 0.0, id="no-failure-no-wait"),
        pytest.param(1, 0.5, 0.5, id="first-failure-half-of-initial"),
        pytest.param(3, 0.999, 3.996, id="third-failure-cap-4"),
        pytest.param(10, 0.5, 30.0, id="capped-at-max"),
        pytest.param(10_000, 0.5, 30.0, id="huge-count-does-not-overflow"),
        pytest.param(4, 0.0, 0.0, id="full-jitter-reaches-zero"),
    ],
)
def test_backoff_delay(failures: int, rand: float, expected: float) -> None:
    assert backoff_delay(failures, 1.0, 60.0, rand) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("stored", "now_ms", "expected"),
    [
        pytest.param(None, 5000, 5000, id="no-file-clock"),
        pytest.param("7000\n", 5000, 7001, id="clock-went-back-file-wins"),
        pytest.param("3000\n", 5000, 5000, id="clock-ahead-clock-wins"),
        pytest.param("garbage", 5000, 5000, id="unreadable-file-clock"),
    ],
)
def test_next_epoch_grows_and_is_stored(
    tmp_path: Path, stored: str | None, now_ms: int, expected: int
) -> None:
    path = tmp_path / "epoch"
    if stored is not None:
        path.write_text(stored)
    assert next_epoch(path, now_ms) == expected
    assert next_epoch(path, now_ms) == expected + 1
    assert path.read_text() == f"{expected + 1}\n"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        pytest.param({"url": "controller:8443"}, "not an http(s) URL", id="no-scheme"),
        pytest.param({"url": "ftp://c"}, "not an http(s) URL", id="wrong-scheme"),
        pytest.param(
            {"url": "http://c", "interval_seconds": 0}, "interval_seconds must be positive", id="zero"
        ),
        pytest.param(
            {"url": "http://c", "backoff_max": 0.5}, "below backoff_initial", id="max-below-initial"
        ),
        pytest.param({"url": "http://c", "coalesce_seconds": -1}, "coalesce_seconds", id="negative-coalesce"),
    ],
)
def test_config_errors_say_what_is_wrong(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ReporterConfig(**kwargs)
