"""Probes for real: HTTP status and body matches against a local server, the gRPC health check
against grpcio's own health service, and probes run off the supervising thread (a check in flight
holds no lock and no tick; its result wakes the loop)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest

from nodeagent.runtime.launch_request import LaunchRequest
from nodeagent.runtime.probes import (
    body_matches,
    check_probe,
    grpc_request,
    grpc_serving,
    json_field,
    run_probe,
    same_json,
)
from nodeagent.runtime.supervisor import Phase, Supervisor
from nodeagent.schema.worker import BodyMatch, Probe, WorkerSpec, parse_worker_spec
from tests.runtime.test_supervisor import FakeCgroup, FakeLauncher

# =========================================================================== plain data


@pytest.mark.parametrize(
    ("document", "path", "found"),
    [
        ({"a": {"b": 1}}, "a.b", (True, 1)),
        ([{"workers": [{"status": "READY"}]}], "0.workers.0.status", (True, "READY")),
        ({"a": [1]}, "a.1", (False, None)),
        ({"a": 1}, "a.b", (False, None)),
        ({"0": "key"}, "0", (True, "key")),
    ],
)
def test_json_field(document: Any, path: str, found: tuple[bool, Any]) -> None:
    assert json_field(document, path) == found


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (1, 1.0, True),
        (True, 1, False),
        ("1", 1, False),
        (None, None, True),
        ([1], [1], True),
        (False, False, True),
    ],
)
def test_json_equality(a: Any, b: Any, same: bool) -> None:
    assert same_json(a, b) is same


def test_body_matches() -> None:
    assert body_matches(BodyMatch(contains="READY"), b'{"status": "READY"}')
    assert not body_matches(BodyMatch(contains="READY"), b"LOADING")
    ready = BodyMatch(json_field="status", equals="READY")
    assert body_matches(ready, b'{"status": "READY"}')
    assert not body_matches(ready, b'{"status": "LOADING"}')
    assert not body_matches(ready, b"not json")
    assert body_matches(BodyMatch(json_field="missing", equals=None), b'{"missing": null}')
    assert not body_matches(BodyMatch(json_field="missing", equals=None), b"{}")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        pytest.param({"contains": "a", "json_field": "b", "equals": 1}, ["exactly one"], id="both"),
        pytest.param({}, ["exactly one"], id="neither"),
        pytest.param({"json_field": "status"}, ["needs 'equals'"], id="no-equals"),
        pytest.param({"contains": "a", "equals": 1}, ["goes with json_field"], id="equals-with-contains"),
    ],
)
def test_bad_body_matches_are_refused(raw: dict[str, Any], words: list[str]) -> None:
    from nodeagent.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        parse_worker_spec({"command": ["x"], "readiness": {"http": {"port": 1, "body": raw}}})
    for word in words:
        assert word in str(err.value)


def test_a_status_range_must_be_in_order() -> None:
    from nodeagent.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="lowest, highest"):
        parse_worker_spec({"command": ["x"], "readiness": {"http": {"port": 1, "status": [299, 200]}}})


def test_grpc_messages_by_hand() -> None:
    assert grpc_request("") == b"\x00\x00\x00\x00\x00"
    assert grpc_request("m") == b"\x00\x00\x00\x00\x03\x0a\x01m"
    assert grpc_request("x" * 200)[5:8] == b"\x0a\xc8\x01"  # a two-byte length varint
    assert grpc_serving(b"\x00\x00\x00\x00\x02\x08\x01")
    assert not grpc_serving(b"\x00\x00\x00\x00\x02\x08\x02")  # NOT_SERVING
    assert not grpc_serving(b"\x00\x00\x00\x00\x00")  # UNKNOWN (the default)
    assert not grpc_serving(b"\x01\x00\x00\x00\x02\x08\x01")  # compressed
    assert not grpc_serving(b"")


# =========================================================================== HTTP, for real


class Answers(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes]]] = {
        "/ready": (200, b'{"status": "READY"}'),
        "/loading": (200, b'[{"workers": [{"status": "LOADING"}]}]'),
        "/models": (200, b'[{"workers": [{"status": "READY"}]}]'),
        "/teapot": (418, b"short and stout"),
        "/moved": (302, b""),
    }

    def do_GET(self) -> None:
        status, body = self.routes.get(self.path, (404, b""))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    ("check", "passes"),
    [
        ({"path": "/ready"}, True),
        ({"path": "/moved"}, True),  # 2xx and 3xx by default
        ({"path": "/moved", "status": 200}, False),
        ({"path": "/teapot"}, False),
        ({"path": "/teapot", "status": 418}, True),
        ({"path": "/teapot", "status": [400, 499], "body": {"contains": "stout"}}, True),
        ({"path": "/ready", "body": {"json_field": "status", "equals": "READY"}}, True),
        ({"path": "/loading", "body": {"json_field": "0.workers.0.status", "equals": "READY"}}, False),
        ({"path": "/models", "body": {"json_field": "0.workers.0.status", "equals": "READY"}}, True),
        ({"path": "/ready", "body": {"contains": "LOADING"}}, False),
        ({"path": "/nothing"}, False),
    ],
)
def test_http_probe(http_port: int, check: dict[str, Any], passes: bool) -> None:
    probe = Probe.model_validate({"http": {"port": http_port, **check}})
    assert check_probe(probe, "127.0.0.1") is passes


@pytest.mark.parametrize(
    ("check", "passed", "definite", "detail"),
    [
        ({"path": "/ready"}, True, False, "GET /ready: HTTP 200"),
        ({"path": "/teapot"}, False, False, "GET /teapot: HTTP 418 short and stout"),
        ({"path": "/nothing"}, False, True, "GET /nothing: HTTP 404"),
        (
            {"path": "/ready", "body": {"contains": "LOADING"}},
            False,
            False,
            'GET /ready: HTTP 200, but the body does not match: {"status": "READY"}',
        ),
    ],
)
def test_an_http_probe_says_what_came_back(
    http_port: int, check: dict[str, Any], passed: bool, definite: bool, detail: str
) -> None:
    result = run_probe(Probe.model_validate({"http": {"port": http_port, **check}}), "127.0.0.1")
    assert (result.passed, result.definite, result.detail) == (passed, definite, detail)


def test_a_probe_of_a_port_nobody_listens_on_says_so_and_that_it_may_come() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        result = run_probe(Probe.model_validate({"http": {"port": port}}), "127.0.0.1")
    assert (result.passed, result.definite) == (False, False)
    assert result.detail == f"connection refused: nothing listens on 127.0.0.1:{port}"


def test_an_overlong_answer_is_cut_to_one_short_line(http_port: int) -> None:
    Answers.routes["/long"] = (503, b"loading\n" + b"x" * 5000)
    try:
        result = run_probe(Probe.model_validate({"http": {"port": http_port, "path": "/long"}}), "127.0.0.1")
    finally:
        del Answers.routes["/long"]
    assert result.detail.startswith("GET /long: HTTP 503 loading xxx")
    assert result.detail.endswith("...")
    assert len(result.detail) < 250


def test_a_probe_port_that_was_never_bound_is_a_bug_not_a_failure() -> None:
    with pytest.raises(ValueError, match="never bound"):
        check_probe(Probe.model_validate({"http": {"port": "http"}}), "127.0.0.1")


# =========================================================================== gRPC, for real


@pytest.fixture(scope="module")
def grpc_port() -> Iterator[int]:
    grpc = pytest.importorskip("grpc")  # the dev extra installs it (a gRPC server to probe)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("ready.Model", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("loading.Model", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None).wait()


@pytest.mark.parametrize(
    ("service", "passes"), [("", True), ("ready.Model", True), ("loading.Model", False), ("unknown", False)]
)
def test_grpc_health_probe(grpc_port: int, service: str, passes: bool) -> None:
    probe = Probe.model_validate({"grpc": {"port": grpc_port, "service": service}})
    assert check_probe(probe, "127.0.0.1") is passes


def test_grpc_probe_of_a_port_that_speaks_http_1_fails(http_port: int) -> None:
    assert not check_probe(Probe.model_validate({"grpc": {"port": http_port}}), "127.0.0.1")


# =========================================================================== off the ticking thread


TEMPLATE = LaunchRequest(launch_id="slot-a", argv=("worker",), env={}, run_dir="/run", log_dir="/logs")


def test_a_probe_in_flight_holds_up_no_tick_and_its_result_wakes_the_loop() -> None:
    release = threading.Event()
    ticking = threading.RLock()  # what the supervision loop holds while it ticks
    threads: list[str] = []

    def check(probe: Probe, host: str) -> bool:
        threads.append(threading.current_thread().name)
        release.wait()  # a server that accepts and takes its time to answer
        return True

    spec = WorkerSpec(command=("w",), readiness=Probe.model_validate({"http": {"port": 1}}))
    sup = Supervisor(spec, TEMPLATE, FakeLauncher(), FakeCgroup(), check=check)
    woken = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sup.attach(pool, woken.set)
        with ticking:
            sup.start()
            # Submitted, and the tick returns while the check waits: it is on the pool's thread.
            assert sup.tick().phase is Phase.STARTING
            assert sup.due_in() is None  # nothing timed: the result will wake the loop
            assert sup.tick().phase is Phase.STARTING  # still in flight: not submitted twice
        release.set()
        assert woken.wait(30)
        with ticking:
            assert sup.tick().phase is Phase.RUNNING
    assert len(threads) == 1
    assert threads[0] != threading.current_thread().name


def test_a_probe_that_raises_counts_as_a_failure() -> None:
    def check(probe: Probe, host: str) -> bool:
        raise RuntimeError("a bug in a probe")

    probe = Probe.model_validate({"http": {"port": 1}, "failure_threshold": 1})
    spec = WorkerSpec(command=("w",), liveness=probe)
    sup = Supervisor(spec, TEMPLATE, FakeLauncher(), FakeCgroup(), check=check)
    woken = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sup.attach(pool, woken.set)
        sup.start()
        sup.tick()
        assert woken.wait(30)
        assert sup.tick().phase is Phase.STOPPING
        assert "liveness probe failed" in sup.message


def test_probe_specs_round_trip_through_json() -> None:
    probe = Probe.model_validate(
        {"grpc": {"port": "grpc", "service": "s"}, "period_seconds": 0.5, "startup_period_seconds": 0.1}
    )
    assert Probe.model_validate(json.loads(probe.model_dump_json())) == probe


def test_the_wait_for_a_pool_thread_and_the_loop_does_not_stretch_the_period() -> None:
    now = [1000.0]
    release = threading.Event()

    def check(probe: Probe, host: str) -> bool:
        release.wait()
        return False

    spec = WorkerSpec(command=("w",), readiness=Probe.model_validate({"http": {"port": 1}}))
    sup = Supervisor(spec, TEMPLATE, FakeLauncher(), FakeCgroup(), check=check, clock=lambda: now[0])
    woken = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        sup.attach(pool, woken.set)
        sup.start()
        sup.tick()  # submitted at 1000.00
        now[0] += 0.03  # the check and the wake-up took 30 ms
        release.set()
        assert woken.wait(30)
        sup.tick()  # recorded at 1000.03
        assert sup.due_in() == pytest.approx(0.02)  # due at 1000.05: a period after it was submitted
